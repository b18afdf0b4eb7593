"""Simulated workers for ``dflash bench pipeline``: the real pipeline, fake compute.

A simulated target "runs its forward" by sleeping its per-batch cost (a sleep releases the GIL the way a
CUDA kernel launch + sync does) and emits a real tensor payload of the given size; a simulated drafter
sleeps its cost times its slowdown. The queue, the threads, the barrier, the fault injection and the
metrics are the production ones, so the figures measure the pipeline itself against the ideal bound::

    bound = min(sum of target rates, sum of drafter rates) * tokens per batch

With ``kill_drafter_at`` the run is measured before and after the kill separately, each against its own
bound (the dead drafter's rate leaves the sum).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
import typing as t

import torch

from dflash.train.faults import FaultInjector, cuda_oom
from dflash.train.metrics import Metrics, busy_field, worker_window
from dflash.train.pipeline import Pipeline, PipelineOptions, StepStats, SyncEvent


@dataclasses.dataclass(frozen=True, slots=True)
class SimBatch:
    index: int
    n_tokens: int


class SimSource:
    def __init__(self, start: int, stride: int, tokens: int) -> None:
        self.next, self.stride, self.tokens = start, stride, tokens

    def __iter__(self) -> SimSource:
        return self

    def __next__(self) -> SimBatch:
        g = self.next
        self.next += self.stride
        return SimBatch(g, self.tokens)


class SimTarget:
    def __init__(self, device: str, cost_s: float, payload_bytes: int) -> None:
        self.device = device
        self.cost_s = cost_s
        self.numel = max(1, payload_bytes // 2)

    def produce(self, batch: SimBatch) -> torch.Tensor:
        time.sleep(self.cost_s)
        return torch.empty(self.numel, dtype=torch.bfloat16)  # bf16 features, as the real targets send


class SimDrafter:
    host_clock = True  # its "step" is a host sleep: CUDA events would time nothing

    def __init__(self, device: str, cost_s: float) -> None:
        self.device = device
        self.cost_s = cost_s

    def step(self, payload: torch.Tensor, *, step: int, micro_batches: int = 1) -> StepStats:
        if payload.numel() == 0:
            raise ValueError("empty payload")
        time.sleep(self.cost_s)
        loss = 6.0 / math.sqrt(step)
        return StepStats(loss=loss, acc=1.0 - loss / 6.0, tau_tf=1.0 + 3.0 * (1.0 - loss / 6.0))

    def recover(self) -> None:
        pass


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSpec:
    targets: int = 5
    drafters: int = 3
    target_ms: float = 80.0
    drafter_ms: float = 60.0
    slowdowns: t.Mapping[int, float] = dataclasses.field(default_factory=dict)
    mode: str = "shared"
    capacity: int = 64
    steps: int = 1500
    tokens_per_batch: int = 4096
    payload_mb: float = 1.0
    kill_drafter_at: int | None = None
    kill_drafter: int = 0
    average_every: int = 0
    average_ms: float = 0.0
    warmup_frac: float = 0.1  # steady state starts after this share of the steps
    accounting: bool = True  # per-worker time accounting (off: to measure what it costs)

    def target_rate(self) -> float:
        return 1000.0 / self.target_ms  # batches per second per target

    def drafter_rate(self, j: int) -> float:
        return 1000.0 / (self.drafter_ms * self.slowdowns.get(j, 1.0))

    def bound(self, live: t.Iterable[int]) -> float:
        """Ideal Ktok/s with these drafters alive: min(supply, demand)."""
        supply = self.targets * self.target_rate()
        demand = sum(self.drafter_rate(j) for j in live)
        return min(supply, demand) * self.tokens_per_batch / 1000.0

    def assignment(self) -> list[int]:
        """Targets per drafter queue (per-drafter mode): 5 on 3 = [2, 2, 1]."""
        return [sum(1 for i in range(self.targets) if i % self.drafters == j) for j in range(self.drafters)]

    def per_drafter_bound(self, live: t.Iterable[int]) -> float:
        """What round-robin queues can reach at best: each drafter capped by its own targets' supply."""
        counts = self.assignment()
        return (
            sum(min(counts[j] * self.target_rate(), self.drafter_rate(j)) for j in live)
            * self.tokens_per_batch
            / 1000.0
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    first: int
    last: int
    ktok_s: float
    bound: float  # the ideal: min(supply, demand)
    round_robin_bound: float  # the best round-robin queues can do (each drafter capped by its own targets)

    @property
    def ratio(self) -> float:
        return self.ktok_s / self.bound if self.bound else float("nan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchResult:
    spec: BenchSpec
    windows: dict[str, Window]
    workers: list[dict[str, t.Any]]
    per_drafter_items: list[int]
    wall_s: float
    steps: int

    def to_dict(self) -> dict[str, t.Any]:
        d = {
            "spec": {**dataclasses.asdict(self.spec), "slowdowns": {str(k): v for k, v in self.spec.slowdowns.items()}},
            "windows": {k: {**dataclasses.asdict(w), "ratio": w.ratio} for k, w in self.windows.items()},
            "workers": self.workers,
            "per_drafter_items": self.per_drafter_items,
            "wall_s": self.wall_s,
            "steps": self.steps,
        }
        if self.spec.mode == "per-drafter":
            d["assignment"] = self.spec.assignment()
        return d


def run_bench(spec: BenchSpec, *, log: t.TextIO | None = None) -> BenchResult:
    T, D = spec.targets, spec.drafters
    payload = int(spec.payload_mb * 1024 * 1024)
    targets = [SimTarget(f"cuda:{i}", spec.target_ms / 1000.0, payload) for i in range(T)]
    drafters = [SimDrafter(f"cuda:{T + j}", spec.drafter_ms * spec.slowdowns.get(j, 1.0) / 1000.0) for j in range(D)]
    sources = [SimSource(i, T, spec.tokens_per_batch) for i in range(T)]
    injector = FaultInjector()
    if spec.kill_drafter_at is not None:
        injector.fail_at("drafter", spec.kill_drafter, spec.kill_drafter_at, cuda_oom, times=2)
    done_at: list[float] = [0.0] * (spec.steps + 1)
    kill_step: list[int] = []

    metrics = Metrics(log_every=max(1, spec.steps // 10), stream=log if log is not None else io.StringIO())

    def on_step(n: int, stats: StepStats, tokens: int) -> None:
        done_at[n] = time.monotonic()
        metrics.record(n, stats, tokens)
        if spec.kill_drafter_at is not None and not kill_step and pipe.workers[("drafter", spec.kill_drafter)].dead:
            kill_step.append(n)

    def on_sync(ev: SyncEvent) -> None:
        if ev.average and not ev.final and spec.average_ms:
            time.sleep(spec.average_ms / 1000.0)

    pipe = Pipeline(
        targets=targets,
        sources=sources,
        drafters=drafters,
        injector=injector,
        on_step=on_step,
        on_sync=on_sync,
        options=PipelineOptions(
            max_steps=spec.steps,
            capacity=spec.capacity,
            mode=spec.mode,
            average_every=spec.average_every,
            barrier_timeout=60.0,
            accounting=spec.accounting,
        ),
    )
    metrics.snapshot = pipe.snapshot
    t0 = time.monotonic()
    metrics.start()
    result = pipe.run()
    wall = time.monotonic() - t0
    done_at[0] = t0

    def window(first: int, last: int, live: list[int]) -> Window:
        first = max(first, 0)
        span = done_at[last] - done_at[first]
        tokens = (last - first) * spec.tokens_per_batch
        return Window(
            first=first,
            last=last,
            ktok_s=tokens / span / 1000.0 if span > 0 else 0.0,
            bound=spec.bound(live),
            round_robin_bound=spec.per_drafter_bound(live),
        )

    warm = int(spec.steps * spec.warmup_frac)
    everyone = list(range(D))
    windows: dict[str, Window] = {}
    if spec.kill_drafter_at is None:
        windows["steady"] = window(warm, result.steps, everyone)
    else:
        k = kill_step[0] if kill_step else spec.kill_drafter_at
        settle = max(2 * D, spec.capacity // 4)  # the queue refills and the survivors take over
        survivors = [j for j in everyone if j != spec.kill_drafter]
        windows["before-kill"] = window(warm, min(k, result.steps), everyone)
        windows["after-kill"] = window(min(k + settle, result.steps - 1), result.steps, survivors)
    snap = pipe.snapshot()
    # the figures metrics.jsonl has per log interval, here over the whole run
    workers = [worker_window(w, None, wall) for w in snap.workers] if spec.accounting else []
    return BenchResult(
        spec=spec,
        windows=windows,
        workers=workers,
        per_drafter_items=[w.items for w in snap.workers if w.role == "drafter"],
        wall_s=wall,
        steps=result.steps,
    )


def format_result(res: BenchResult) -> str:
    s = res.spec
    slow = ", ".join(f"drafter-{j} x{f:g}" for j, f in sorted(s.slowdowns.items())) or "none"
    lines = [
        f"pipeline bench: {s.targets} targets x {s.target_ms:g} ms, {s.drafters} drafters x {s.drafter_ms:g} ms "
        f"(slowdown: {slow}), queue {s.mode} (capacity {s.capacity}), {s.tokens_per_batch} tokens/batch, "
        f"payload {s.payload_mb:g} MB, {res.steps} steps in {res.wall_s:.1f} s",
    ]
    if s.mode == "per-drafter":
        lines.append(f"  round-robin assignment (targets per drafter): {s.assignment()}")
    if s.kill_drafter_at is not None:
        lines.append(f"  drafter-{s.kill_drafter} killed (CUDA OOM, retried once) at step {s.kill_drafter_at}")
    for name, w in res.windows.items():
        rr = f"   (round-robin best {w.round_robin_bound:.1f})" if s.mode == "per-drafter" else ""
        lines.append(
            f"  {name:<12} steps {w.first:>5}-{w.last:<5} {w.ktok_s:8.1f} Ktok/s   bound {w.bound:8.1f} Ktok/s   "
            f"ratio {w.ratio:.3f}{rr}"
        )
    if not res.workers:
        lines.append("  per-worker accounting off (--no-accounting)")
        return "\n".join(lines)
    lines.append(f"  {busy_field(res.workers)}")
    lines.append(
        f"  {'worker':<10} {'device':<7} {'busy':>5} {'wait':>5} {'barrier':>7} {'other':>5} {'batches':>7} "
        f"{'batch/s':>7}   (wait: a target blocked on a full queue, a drafter starved on an empty one)"
    )
    for wk in res.workers:
        state = "  (dead)" if wk["dead"] else ""
        lines.append(
            f"  {wk['name']:<10} {wk['device']:<7} {wk['busy']:5.2f} {wk['wait']:5.2f} {wk['barrier']:7.2f} "
            f"{wk['other']:5.2f} {wk['items']:7d} {wk['batches_s']:7.1f}{state}"
        )
    return "\n".join(lines)


def dump_json(res: BenchResult) -> str:
    return json.dumps(res.to_dict(), indent=2)


__all__ = ["BenchResult", "BenchSpec", "SimDrafter", "SimSource", "SimTarget", "Window", "format_result", "run_bench"]
