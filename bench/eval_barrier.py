"""What ``[eval] every`` adds to the barrier: a tiny real training run timed at every barrier, with the
held-out eval and without it (the same checkpoints: ``checkpoint.interval`` = ``eval.every``).

    .venv/bin/python -m bench.eval_barrier [--steps 24] [--every 4] [--max-new 8] [--prompts 2] [--set KEY=VALUE ...]

Runs configs/tiny-random.toml (2 target + 2 drafter threads on CPU) twice in a temp dir; times
``Run.on_sync`` (averaging, snapshot, handing the snapshot to the eval) at every barrier, and the run's
wall time. An eval barrier that must wait for the eval before it (the eval is slower than ``every`` steps)
says so in the log: the figure then includes that wait. Prints seconds per barrier (median, max) and the
run's wall time for both.
"""

from __future__ import annotations

if not __package__:  # `python bench/eval_barrier.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.eval_barrier")

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

from dflash.config import load_config
from dflash.train.pipeline import SyncEvent
from dflash.train.run import Run

REPO = Path(__file__).resolve().parents[1]


class TimedRun(Run):
    """A Run whose barriers are timed (what the drafters wait for, all of it)."""

    barriers: list[float]

    def on_sync(self, ev: SyncEvent) -> None:
        t0 = time.perf_counter()
        super().on_sync(ev)
        if not ev.final:  # the final one waits for the last write: not a stall of training
            self.barriers.append(time.perf_counter() - t0)


def one(root: Path, overrides: list[str]) -> tuple[list[float], list[float], float]:
    cfg = load_config(
        REPO / "configs" / "tiny-random.toml",
        [f"output_dir={root / 'run'}", f"checkpoint.dir={root / 'ckpt'}", "log_every=1000", *overrides],
    )
    run = TimedRun(cfg, environ={}, stream=io.StringIO())
    run.barriers = []
    t0 = time.perf_counter()
    assert run.train() == 0
    waits = run.validator.waits[: len(run.barriers)] if run.validator is not None else []
    return run.barriers, waits, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="eval-barrier-") as tmp:
        root = Path(tmp)
        prompts = root / "eval.jsonl"
        lines = (REPO / "configs" / "tiny-data.jsonl").read_text().splitlines()[: args.prompts]
        prompts.write_text("\n".join(lines) + "\n")
        common = [
            f"max_steps={args.steps}",
            f"checkpoint.interval={args.every}",
            f"average_every={args.every}",
            *args.overrides,
        ]
        without, _, wall_without = one(root / "without", common)
        evals = [f"eval.every={args.every}", f"eval.prompts={prompts}", f"eval.max_new={args.max_new}"]
        with_eval, waits, wall_with = one(root / "with", [*common, *evals])
    own = [b - w for b, w in zip(with_eval, waits)]  # the barrier less its wait for the eval before it
    for name, b, wall in (("without [eval]", without, wall_without), ("with [eval]   ", with_eval, wall_with)):
        print(
            f"{name}: {len(b)} barriers, median {statistics.median(b) * 1000:.1f} ms, max {max(b) * 1000:.1f} ms; "
            f"run {wall:.1f} s"
        )
    print(
        f"with [eval], less the wait for the eval before: median {statistics.median(own) * 1000:.1f} ms, "
        f"max {max(own) * 1000:.1f} ms; waited for the eval before at {sum(1 for w in waits if w > 0)} of "
        f"{len(waits)} barriers, {sum(waits):.2f} s in all"
    )


if __name__ == "__main__":
    main()
