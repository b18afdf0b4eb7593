"""The run's workers as `dflashctl status` shows them: each worker's figures of the last metrics.jsonl
record joined with nvidia-smi's for its GPU, and their table (docs/design.md section 14)."""

from __future__ import annotations

import dataclasses
import typing as t

from ops import wire


def as_int(v: t.Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def as_float(v: t.Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Worker:
    """One worker of the last metrics.jsonl record (fractions of its log interval) and its GPU's figures."""

    name: str | None
    role: str | None
    device: str | None
    busy: float | None
    wait: float | None
    barrier: float | None
    batches_s: float | None
    dead: bool
    step: int | None
    gpu_util_pct: float | None
    gpu_memory_used_mib: float | None
    gpu_memory_total_mib: float | None


def _text(v: t.Any) -> str | None:
    return v if isinstance(v, str) else None


def workers_of(rec: t.Mapping[str, t.Any] | None, gpus: t.Sequence[wire.Gpu] | None) -> list[Worker] | None:
    """The workers of the last metrics.jsonl record ``rec``, with the nvidia-smi figures of the GPU a worker
    runs on (``cuda:N`` = nvidia-smi index N) when the agent sampled them."""
    ws = rec.get("workers") if rec is not None else None
    if rec is None or not isinstance(ws, list) or not ws:
        return None
    by_index = {g.index: g for g in gpus or []}
    out = []
    for w in ws:
        if not isinstance(w, dict):
            continue
        device = _text(w.get("device"))
        gpu = by_index.get(as_int(device.split(":", 1)[1])) if device and device.startswith("cuda:") else None
        out.append(
            Worker(
                name=_text(w.get("name")),
                role=_text(w.get("role")),
                device=device,
                busy=as_float(w.get("busy")),
                wait=as_float(w.get("wait")),
                barrier=as_float(w.get("barrier")),
                batches_s=as_float(w.get("batches_s")),
                dead=bool(w.get("dead")),
                step=as_int(rec.get("step")),
                gpu_util_pct=as_float(gpu.utilization_pct) if gpu else None,
                gpu_memory_used_mib=as_float(gpu.memory_used_mib) if gpu else None,
                gpu_memory_total_mib=as_float(gpu.memory_total_mib) if gpu else None,
            )
        )
    return out or None


def worker_table(workers: t.Sequence[Worker] | None) -> list[str]:
    """The status lines of ``workers``: busy, and waiting on the queue (a drafter starved, a target blocked)."""
    if not workers:
        return []

    def pct(v: float | None) -> str:
        return f"{round(100 * v):3d}%" if v is not None else "   ?"

    step = workers[0].step
    out = [
        f"  workers:   at step {step}" if step is not None else "  workers:",
        f"    {'worker':<11} {'device':<8} {'busy':>4}  {'waiting':<12} {'batch/s':>7}  gpu",
    ]
    for w in workers:
        waits = "starved" if w.role == "drafter" else "blocked"
        gpu = ""
        if w.gpu_util_pct is not None or w.gpu_memory_used_mib is not None:
            gpu = (
                f"{pct((w.gpu_util_pct or 0) / 100).strip()} util, "
                f"{w.gpu_memory_used_mib or 0:.0f}/{w.gpu_memory_total_mib or 0:.0f} MiB"
            )
        bs = w.batches_s
        row = (
            f"    {w.name or '?':<11} {w.device or '?':<8} {pct(w.busy)}  "
            f"{pct(w.wait)} {waits:<7} {bs if bs is not None else 0:7.1f}  {gpu}"
        ).rstrip()
        out.append(row + ("  (dead)" if w.dead else ""))
    return out
