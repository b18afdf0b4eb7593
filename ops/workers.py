"""The run's workers as `dflashctl status` shows them: each worker's figures of the last metrics.jsonl
record joined with nvidia-smi's for its GPU, and their table (docs/design.md section 14)."""

from __future__ import annotations

import typing as t


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


def workers_of(rec: t.Mapping[str, t.Any] | None, gpus: list[dict[str, t.Any]] | None) -> list[dict[str, t.Any]] | None:
    """The workers of the last metrics.jsonl record ``rec`` (fractions of its log interval), with the nvidia-smi
    figures of the GPU a worker runs on (``cuda:N`` = nvidia-smi index N) when the agent sampled them."""
    ws = rec.get("workers") if isinstance(rec, dict) else None
    if not isinstance(ws, list) or not ws:
        return None
    by_index = {g.get("index"): g for g in gpus or [] if isinstance(g, dict)}
    out = []
    for w in ws:
        if not isinstance(w, dict):
            continue
        device = w.get("device") if isinstance(w.get("device"), str) else None
        gpu = by_index.get(as_int(device.split(":", 1)[1])) if device and device.startswith("cuda:") else None
        out.append(
            {
                "name": w.get("name"),
                "role": w.get("role"),
                "device": device,
                "busy": as_float(w.get("busy")),
                "wait": as_float(w.get("wait")),
                "barrier": as_float(w.get("barrier")),
                "batches_s": as_float(w.get("batches_s")),
                "dead": bool(w.get("dead")),
                "step": as_int(rec.get("step")) if isinstance(rec, dict) else None,
                "gpu_util_pct": as_float(gpu.get("utilization_pct")) if gpu else None,
                "gpu_memory_used_mib": as_float(gpu.get("memory_used_mib")) if gpu else None,
                "gpu_memory_total_mib": as_float(gpu.get("memory_total_mib")) if gpu else None,
            }
        )
    return out or None


def worker_table(workers: list[dict[str, t.Any]] | None) -> list[str]:
    """The status lines of ``workers``: busy, and waiting on the queue (a drafter starved, a target blocked)."""
    if not workers:
        return []

    def pct(v: float | None) -> str:
        return f"{round(100 * v):3d}%" if v is not None else "   ?"

    step = workers[0].get("step")
    out = [
        f"  workers:   at step {step}" if step is not None else "  workers:",
        f"    {'worker':<11} {'device':<8} {'busy':>4}  {'waiting':<12} {'batch/s':>7}  gpu",
    ]
    for w in workers:
        waits = "starved" if w.get("role") == "drafter" else "blocked"
        gpu = ""
        if w.get("gpu_util_pct") is not None or w.get("gpu_memory_used_mib") is not None:
            gpu = (
                f"{pct((w['gpu_util_pct'] or 0) / 100).strip()} util, "
                f"{w.get('gpu_memory_used_mib') or 0:.0f}/{w.get('gpu_memory_total_mib') or 0:.0f} MiB"
            )
        bs = w.get("batches_s")
        row = (
            f"    {w.get('name') or '?':<11} {w.get('device') or '?':<8} {pct(w.get('busy'))}  "
            f"{pct(w.get('wait'))} {waits:<7} {bs if bs is not None else 0:7.1f}  {gpu}"
        ).rstrip()
        out.append(row + ("  (dead)" if w.get("dead") else ""))
    return out
