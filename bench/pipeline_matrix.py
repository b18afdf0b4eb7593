"""The pipeline figures, one run after the other on this machine (same costs, same steps).

    .venv/bin/python -m bench.pipeline_matrix [--steps 1500] [--target-ms 80] [--drafter-ms 60] [--json out.json]

5 targets / 3 drafters with drafter-bound costs (5 x 12.5 = 62.5 batches/s supplied, 3 x 16.7 = 50 demanded):

1. shared queue vs per-drafter (round-robin [2, 2, 1]: drafter 2 has one target and starves);
2. one drafter killed midway (CUDA OOM, retried once, then dead): Ktok/s after the kill vs the new bound;
3. heterogeneous drafters (drafter 0 1.5x slower; it is one of the two-target queues in per-drafter mode).

Each line: measured Ktok/s over the steady window, the ideal bound min(sum of target rates, sum of drafter
rates) x tokens per batch, their ratio, and for per-drafter mode the best round-robin queues can do.
"""

from __future__ import annotations

if not __package__:  # `python bench/pipeline_matrix.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.pipeline_matrix")

import argparse
import json
import logging
import sys
from pathlib import Path

from dflash.train.simulate import BenchResult, BenchSpec, format_result, run_bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--target-ms", type=float, default=80.0)
    ap.add_argument("--drafter-ms", type=float, default=60.0)
    ap.add_argument("--payload-mb", type=float, default=1.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--verbose", action="store_true", help="print every run's per-worker table")
    args = ap.parse_args()
    logging.getLogger("dflash.pipeline").setLevel(logging.CRITICAL)  # the injected kill is expected

    base = dict(
        targets=5,
        drafters=3,
        target_ms=args.target_ms,
        drafter_ms=args.drafter_ms,
        steps=args.steps,
        payload_mb=args.payload_mb,
    )
    cases = [
        ("shared", BenchSpec(**base, mode="shared")),
        ("per-drafter", BenchSpec(**base, mode="per-drafter")),
        (
            "shared, drafter killed midway",
            BenchSpec(**base, mode="shared", kill_drafter_at=args.steps // 2, kill_drafter=0),
        ),
        (
            "per-drafter, drafter killed midway",
            BenchSpec(**base, mode="per-drafter", kill_drafter_at=args.steps // 2, kill_drafter=0),
        ),
        ("shared, drafter-0 x1.5", BenchSpec(**base, mode="shared", slowdowns={0: 1.5})),
        ("per-drafter, drafter-0 x1.5", BenchSpec(**base, mode="per-drafter", slowdowns={0: 1.5})),
        (
            "shared, drafter-0 x1.5, averaging every 50",
            BenchSpec(**base, mode="shared", slowdowns={0: 1.5}, average_every=50, average_ms=20.0),
        ),
    ]
    results: list[tuple[str, BenchResult]] = []
    print(f"{'case':<44} {'window':<12} {'Ktok/s':>8} {'bound':>8} {'ratio':>6}  {'items per drafter':<18} note")
    for name, spec in cases:
        res = run_bench(spec)
        results.append((name, res))
        for wname, w in res.windows.items():
            note = (
                f"round-robin best {w.round_robin_bound:.1f} ({w.round_robin_bound / w.bound:.3f} of bound)"
                if spec.mode == "per-drafter"
                else ""
            )
            print(
                f"{name:<44} {wname:<12} {w.ktok_s:8.1f} {w.bound:8.1f} {w.ratio:6.3f}  "
                f"{str(res.per_drafter_items):<18} {note}",
                flush=True,
            )
        if args.verbose:
            print(format_result(res), flush=True)
    if args.json:
        args.json.write_text(json.dumps({name: r.to_dict() for name, r in results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
