"""Bench (not a test): DFlash vs DFlash2 drafters, decay vs D-PACE position weights, on the demo's data.

    .venv/bin/python -m bench.drafter_kinds [--steps 1000] [--seed 0] [--tiny .dflash/tiny] [--data PATH]
                                            [--prompts PATH] [--max-new 128] [--out .dflash/drafter-kinds] [--reuse]
                                            [--window N] [--max-length 256]

Trains the four combinations (dflash/decay, dflash/dpace, dflash2/decay, dflash2/dpace) one after another
through the real ``dflash train`` (a subprocess each), from configs/tiny-cpu.toml with the same seed and steps,
one target and one drafter thread (so each run is deterministic and the four see the same batches); then
``dflash eval`` (exact greedy speculative decoding, no DDTree) on each final checkpoint over the same held-out
prompts. Prints one table: tau, acceptance at draft positions 1..7, and the training Ktok/s (the mean of the
run's step lines, metrics.jsonl's ``ktok_s``).

``--window N``: full vs sliding attention instead (``dflash``/``decay`` both): one run with every layer full, one
with every layer sliding (``drafter.sliding_window = N``); each also evaluated on held-out prompts longer than the
training length (``data.max_length``): each held-out prompt after as many others as it takes to pass it
(``<out>/long-prompts.jsonl``), where a drafter meets positions it never trained at.

``--tiny``: the folder ``dflash make-tiny --out`` wrote; the data defaults to its ``store`` (what scripts/demo
builds with regen and prepare-data), else its ``train.jsonl``; the prompts to its ``eval.jsonl``. Each run
lives in ``<out>/<kind>-<weighting>`` (train.log, metrics.jsonl, checkpoints/, eval.json, eval.log); the
table also goes to ``<out>/table.txt`` and the figures to ``<out>/figures.json``.
"""

from __future__ import annotations

if not __package__:  # `python bench/drafter_kinds.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.drafter_kinds")

import argparse
import json
import os
import subprocess
import sys
import time
import typing as t
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMBOS = (("dflash", "decay"), ("dflash", "dpace"), ("dflash2", "decay"), ("dflash2", "dpace"))
POSITIONS = 7  # block 8: the anchor and 7 drafts


def parse_args(argv: t.Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="max_steps of every run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", type=Path, default=REPO / ".dflash" / "tiny", help="what dflash make-tiny --out wrote")
    ap.add_argument(
        "--data", type=Path, default=None, help="data.path (default: <tiny>/store, else <tiny>/train.jsonl)"
    )
    ap.add_argument("--target", type=Path, default=None, help="target.path (default: <tiny>/target)")
    ap.add_argument("--prompts", type=Path, default=None, help="held-out prompts (default: <tiny>/eval.jsonl)")
    ap.add_argument("--max-new", type=int, default=128, help="new tokens per prompt in the eval")
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-cpu.toml")
    ap.add_argument("--out", type=Path, default=REPO / ".dflash" / "drafter-kinds", help="the runs' parent folder")
    ap.add_argument("--reuse", action="store_true", help="keep a run that already has its eval.json")
    ap.add_argument("--window", type=int, default=None, help="full vs sliding layers of this window instead")
    ap.add_argument("--max-length", type=int, default=256, help="data.max_length (the training length)")
    ap.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of each command (1: no oversubscribed spinning)"
    )
    a = ap.parse_args(argv)
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    if a.window is not None and a.window < 1:
        ap.error("--window must be at least 1")
    if a.data is None:
        a.data = a.tiny / "store" if (a.tiny / "store" / "meta.json").is_file() else a.tiny / "train.jsonl"
    a.target = a.target or a.tiny / "target"
    a.prompts = a.prompts or a.tiny / "eval.jsonl"
    a.out = a.out.resolve()
    return a


def train_args(a: argparse.Namespace, kind: str, weighting: str, run: Path, *extra: str) -> list[str]:
    """``dflash train``'s arguments for one run; ``extra``: more ``--set`` values (the sliding window)."""
    sets = [
        f"target.path={a.target.resolve()}",
        f"data.path={a.data.resolve()}",
        f"max_steps={a.steps}",
        f"seed={a.seed}",
        f"output_dir={run.resolve()}",
        'devices.targets=["cpu"]',
        'devices.drafters=["cpu"]',
        f"drafter.kind={kind}",
        f"loss.position_weight={weighting}",
        "checkpoint.resume=never",
        f"data.max_length={a.max_length}",
        *extra,
    ]
    return ["train", "--config", str(a.config.resolve()), *(x for s in sets for x in ("--set", s))]


def eval_args(a: argparse.Namespace, run: Path, prompts: Path | None = None, name: str = "eval.json") -> list[str]:
    return [
        "eval",
        "--drafter",
        str(run / "checkpoints"),
        "--prompts",
        str((prompts or a.prompts).resolve()),
        "--max-new",
        str(a.max_new),
        "--ddtree-budget",
        "0",
        "--json",
        str(run / name),
    ]


def dflash(args: list[str], log: Path, threads: int) -> float:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_RUN_DIR"}  # metrics.jsonl in output_dir
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(
            [sys.executable, "-m", "dflash", *args], stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env
        )
    if p.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"dflash {args[0]} failed ({p.returncode}), {log}:\n{tail}")
    return time.perf_counter() - t0


def mean_ktok_s(metrics: Path) -> float:
    """The mean of the step lines' Ktok/s (records without a ``kind``: evals are records of their own)."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    vals = [float(r["ktok_s"]) for r in recs if "kind" not in r and "ktok_s" in r]
    return sum(vals) / len(vals) if vals else float("nan")


def figures(kind: str, weighting: str, steps: int, run: Path, train_s: float) -> dict[str, t.Any]:
    rep = json.loads((run / "eval.json").read_text())
    return {
        "kind": kind,
        "weighting": weighting,
        "steps": steps,
        "tau": float(rep["tau"]),
        "acceptance": [float(x) for x in rep["position_acceptance"]],
        "ktok_s": mean_ktok_s(run / "metrics.jsonl"),
        "train_s": train_s,
        "target_equal": rep.get("target_equal"),
        "num_prompts": rep.get("num_prompts"),
    }


def table(rows: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """One Markdown table: a row per run; acceptance at draft positions 1..7 (blank past the block)."""
    head = ["kind", "weighting", "steps", "tau", *(f"acc {i}" for i in range(1, POSITIONS + 1)), "train Ktok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i > 1 else "---" for i in range(len(head))) + "|"]
    for r in rows:
        acc = list(r["acceptance"])[:POSITIONS]
        cells = [
            str(r["kind"]),
            str(r["weighting"]),
            str(r["steps"]),
            f"{r['tau']:.2f}",
            *(f"{x:.2f}" for x in acc),
            *([""] * (POSITIONS - len(acc))),
            f"{r['ktok_s']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_prompts(a: argparse.Namespace, out: Path) -> Path:
    """Each held-out prompt after whole training conversations (the target's own answers, in order) until the
    prompt starts past ``--max-length``: a multi-turn chat longer than any sequence the drafters trained on."""
    history = [json.loads(line)["input_ids"] for line in a.data.read_text().splitlines() if line.strip()]
    prompts = [json.loads(line)["input_ids"] for line in a.prompts.read_text().splitlines() if line.strip()]
    lines, k = [], 0
    for prompt in prompts:
        ids: list[int] = []
        while len(ids) <= a.max_length:
            ids += history[k % len(history)]
            k += 1
        lines.append(json.dumps({"input_ids": ids + prompt}))
    out.write_text("\n".join(lines) + "\n")
    return out


def window_table(rows: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """The full-vs-sliding table: ``table``'s columns after the attention, and tau past the training length."""
    head = ["attention", "steps", "tau", *(f"acc {i}" for i in range(1, POSITIONS + 1)), "tau long", "train Ktok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    for r in rows:
        acc = list(r["acceptance"])[:POSITIONS]
        cells = [str(r["attention"]), str(r["steps"]), f"{r['tau']:.2f}", *(f"{x:.2f}" for x in acc)]
        cells += [""] * (POSITIONS - len(acc)) + [f"{r['tau_long']:.2f}", f"{r['ktok_s']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def window_runs(a: argparse.Namespace) -> None:
    """``--window``: the full and the sliding run, each evaluated on the held-out and the long prompts."""
    longer = long_prompts(a, a.out / "long-prompts.jsonl")
    rows = []
    for attention, extra in (("full", ()), (f"sliding {a.window}", (f"drafter.sliding_window={a.window}",))):
        run = a.out / attention.replace(" ", "-")
        if run.exists():
            import shutil

            shutil.rmtree(run)
        run.mkdir(parents=True)
        train_s = dflash(train_args(a, "dflash", "decay", run, *extra), run / "train.log", a.threads)
        dflash(eval_args(a, run), run / "eval.log", a.threads)
        dflash(eval_args(a, run, longer, "eval-long.json"), run / "eval-long.log", a.threads)
        row = {**figures("dflash", "decay", a.steps, run, train_s), "attention": attention}
        row["tau_long"] = float(json.loads((run / "eval-long.json").read_text())["tau"])
        (run / "figures.json").write_text(json.dumps(row))
        rows.append(row)
        print(f"{attention}: tau {row['tau']:.2f}, past the training length {row['tau_long']:.2f}", flush=True)
    text = window_table(rows)
    (a.out / "table.txt").write_text(text + "\n")
    (a.out / "figures.json").write_text(json.dumps(rows, indent=1))
    print(text, flush=True)


def main() -> None:
    a = parse_args()
    for need in (a.target, a.data, a.prompts):
        if not need.exists():
            raise SystemExit(f"drafter_kinds: {need} does not exist (dflash make-tiny --out {a.tiny}; scripts/demo)")
    a.out.mkdir(parents=True, exist_ok=True)
    print(
        f"data {a.data}, prompts {a.prompts}, {a.steps} steps, seed {a.seed}, max-new {a.max_new}, "
        f"{a.threads} thread(s) per process",
        flush=True,
    )
    if a.window is not None:
        return window_runs(a)
    rows = []
    for kind, weighting in COMBOS:
        run = a.out / f"{kind}-{weighting}"
        done = run / "figures.json"
        if a.reuse and done.is_file() and json.loads(done.read_text()).get("steps") == a.steps:
            rows.append(json.loads(done.read_text()))
            print(f"{kind}/{weighting}: reused {run}", flush=True)
            continue
        if run.exists():
            import shutil

            shutil.rmtree(run)  # a fresh run (resume is off; old checkpoints would be evaluated)
        run.mkdir(parents=True)
        train_s = dflash(train_args(a, kind, weighting, run), run / "train.log", a.threads)
        eval_s = dflash(eval_args(a, run), run / "eval.log", a.threads)
        row = figures(kind, weighting, a.steps, run, train_s)
        done.write_text(json.dumps(row))
        rows.append(row)
        print(
            f"{kind}/{weighting}: trained in {train_s:.0f}s ({row['ktok_s']:.2f} Ktok/s), eval {eval_s:.0f}s: "
            f"tau {row['tau']:.2f}, identical output {row['target_equal']}/{row['num_prompts']}",
            flush=True,
        )
    text = table(rows)
    (a.out / "table.txt").write_text(text + "\n")
    (a.out / "figures.json").write_text(json.dumps(rows, indent=1))
    print(text, flush=True)


if __name__ == "__main__":
    main()
