"""Bench (not a test): AdamW vs Muon (``optim.name``) on the demo's target, as bench.drafter_kinds runs its kinds.

    .venv/bin/python -m bench.optimizers [--steps 300] [--seeds 0,1] [--tiny .dflash/tiny] [--data PATH]
                                         [--prompts PATH] [--max-new 128] [--muon-lr X] [--out .dflash/optimizers]

For every seed, a DFlash drafter (decay weights) trained with AdamW and with Muon through the real ``dflash
train`` (the same seed, data, steps, lr and schedule; one target and one drafter thread), then ``dflash eval``
on each final checkpoint over the same held-out prompts. Prints one table: optimizer, seed, tau, acceptance at
draft positions 1..7, training Ktok/s. ``--muon-lr`` adds a third run per seed with ``optim.muon_lr`` set.
Each run lives in ``<out>/<optimizer>-s<seed>``; the table also goes to ``<out>/table.txt``.
"""

from __future__ import annotations

if not __package__:  # `python bench/optimizers.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.optimizers")

import argparse
import json
import shutil
import sys
import typing as t
from pathlib import Path

from bench import drafter_kinds as kinds

POSITIONS = kinds.POSITIONS


def parse_args(argv: t.Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds: each trains every optimizer")
    ap.add_argument("--muon-lr", type=float, default=None, help="also a Muon run with optim.muon_lr set")
    own, rest = ap.parse_known_args(argv)
    out = list(rest)
    if "--out" not in out:
        out += ["--out", str(kinds.REPO / ".dflash" / "optimizers")]
    if "--steps" not in out:
        out += ["--steps", "300"]
    a = kinds.parse_args(out)
    try:
        a.seeds = [int(s) for s in own.seeds.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"optimizers: --seeds: expected integers, got {own.seeds!r}") from None
    if not a.seeds:
        raise SystemExit("optimizers: --seeds: give at least one")
    a.muon_lr = own.muon_lr
    return a


def runs(a: argparse.Namespace) -> list[tuple[str, int, list[str]]]:
    """(label, seed, extra --set values) of every run, seed by seed."""
    arms: list[tuple[str, list[str]]] = [("adamw", ["optim.name=adamw"]), ("muon", ["optim.name=muon"])]
    if a.muon_lr is not None:
        arms.append((f"muon lr {a.muon_lr:g}", ["optim.name=muon", f"optim.muon_lr={a.muon_lr}"]))
    return [(label, seed, sets) for seed in a.seeds for label, sets in arms]


def train_args(a: argparse.Namespace, seed: int, sets: t.Sequence[str], run: Path) -> list[str]:
    b = argparse.Namespace(**{**vars(a), "seed": seed})
    return [*kinds.train_args(b, "dflash", "decay", run), *(x for s in sets for x in ("--set", s))]


def table(rows: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    head = ["optimizer", "seed", "steps", "tau", *(f"acc {i}" for i in range(1, POSITIONS + 1)), "train Ktok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i > 0 else "---" for i in range(len(head))) + "|"]
    for r in rows:
        acc = list(r["acceptance"])[:POSITIONS]
        cells = [str(r["optimizer"]), str(r["seed"]), str(r["steps"]), f"{r['tau']:.2f}"]
        cells += [f"{x:.2f}" for x in acc] + [""] * (POSITIONS - len(acc)) + [f"{r['ktok_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    a = parse_args(sys.argv[1:])
    for need in (a.target, a.data, a.prompts):
        if not need.exists():
            raise SystemExit(f"optimizers: {need} does not exist (dflash make-tiny --out {a.tiny})")
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, seed, sets in runs(a):
        run = a.out / f"{label.replace(' ', '-')}-s{seed}"
        if run.exists():
            shutil.rmtree(run)  # a fresh run (resume is off; old checkpoints would be evaluated)
        run.mkdir(parents=True)
        train_s = kinds.dflash(train_args(a, seed, sets, run), run / "train.log", a.threads)
        kinds.dflash(kinds.eval_args(a, run), run / "eval.log", a.threads)
        row = {**kinds.figures("dflash", "decay", a.steps, run, train_s), "optimizer": label, "seed": seed}
        (run / "figures.json").write_text(json.dumps(row))
        rows.append(row)
        print(f"{label} seed {seed}: {train_s:.0f}s, {row['ktok_s']:.2f} Ktok/s, tau {row['tau']:.2f}", flush=True)
    text = table(rows)
    (a.out / "table.txt").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
