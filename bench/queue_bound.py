"""The feature queue's byte bound against what the drafters hold, with the real Pipeline and FeatureQueue.

    python -m bench.queue_bound [--steps 12]

The 5 + 3 box with a 27B-class target at full-length samples, 10x faster and 1024x smaller: 5 targets at
21 ms per item, 3 drafters at 40 ms per item accumulating 11, items of 256 KiB (a 256 MiB pinned block).
Prints the drafters' rate (items/s) against their own bound (3 / 40 ms = 75 items/s) for no byte bound,
the old fixed default (4 GiB, 4 MiB here) and the derived default (``feature_queue.default_max_bytes``).
"""

from __future__ import annotations

if not __package__:  # `python bench/queue_bound.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.queue_bound")

import argparse
import itertools
import threading
import time
import types
import typing as t

from dflash.train.feature_queue import default_max_bytes, format_bytes
from dflash.train.pipeline import Pipeline, PipelineOptions, StepStats

ITEM = 256 << 10
TARGETS, DRAFTERS, ACCUMULATE = 5, 3, 11
TARGET_S, DRAFTER_S = 0.021, 0.040


class Target:
    device = "cpu"

    def payload_bytes(self, batch: t.Any) -> int:
        return ITEM

    def produce(self, batch: t.Any) -> t.Any:
        time.sleep(TARGET_S)
        return types.SimpleNamespace(nbytes=ITEM)


class Drafter:
    device = "cpu"

    def __init__(self, counter: list[int], lock: threading.Lock) -> None:
        self.counter, self.lock = counter, lock

    def step(self, payload: t.Any, *, step: int, micro_batches: int = 1) -> StepStats:
        items = len(payload) if isinstance(payload, list) else 1
        time.sleep(DRAFTER_S * items)
        with self.lock:
            self.counter[0] += items
        return StepStats(loss=1.0, acc=0.5, tau_tf=2.0)

    def recover(self) -> None:
        pass


def source(shard: int) -> t.Iterator[t.Any]:
    for i in itertools.count():
        yield types.SimpleNamespace(index=i * TARGETS + shard, n_tokens=3072)


def rate(max_bytes: int | None, steps: int) -> tuple[float, int]:
    """Items the drafters consumed per second, and the peak bytes held."""
    counter, lock = [0], threading.Lock()
    pipe = Pipeline(
        targets=[Target() for _ in range(TARGETS)],
        sources=[source(i) for i in range(TARGETS)],
        drafters=[Drafter(counter, lock) for _ in range(DRAFTERS)],
        options=PipelineOptions(max_steps=steps, capacity=64, max_bytes=max_bytes, accumulate=ACCUMULATE),
    )
    t0 = time.perf_counter()
    pipe.run()
    return counter[0] / (time.perf_counter() - t0), sum(q.peak_bytes for q in pipe.queues)


def main(argv: t.Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/queue_bound.py", description=__doc__)
    ap.add_argument("--steps", type=int, default=12, help="global steps per run (default 12)")
    args = ap.parse_args(argv)
    bound = DRAFTERS / DRAFTER_S
    # the derived default at the real sizes (256 MiB items), scaled down as the items are
    derived = default_max_bytes(drafters=DRAFTERS, targets=TARGETS, accumulate=ACCUMULATE, item_bytes=ITEM << 10) >> 10
    for name, max_bytes in (
        ("no byte bound", None),
        ("old default (4 GiB, scaled)", 4 << 20),
        ("derived default (scaled)", derived),
    ):
        items_s, peak = rate(max_bytes, args.steps)
        shown = "none" if max_bytes is None else format_bytes(max_bytes)
        print(
            f"{name:<28} max_bytes {shown:>9}: {items_s:5.1f} items/s, {100 * items_s / bound:3.0f}% of the "
            f"drafters' {bound:.0f}/s; peak held {format_bytes(peak)}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
