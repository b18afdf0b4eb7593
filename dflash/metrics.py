"""Progress: one human line per ``log_every`` steps on stdout, and the same facts in metrics.jsonl.

The line has exactly this form (dflashctl greps it; keep it stable)::

    step 120 | loss 2.314 | acc 0.61 | tau_tf 3.2 | 19.4 Ktok/s | queue 37/64 | drafters 3/3

Ktok/s is honest: target tokens in the batches the drafters finished during the interval, all drafters
together, divided by the wall-clock length of the interval (the first interval starts when the pipeline
starts). loss, acc and tau_tf are means over the steps of the interval. Each metrics.jsonl record also
carries the learning rate, queue depth and capacity, live and total drafters and targets, and per worker
its busy fraction and seconds spent waiting (on the queue, and for drafters at the barrier) during the
interval, with ``at`` in ISO 8601 UTC.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
import threading
import time
import typing as t
from pathlib import Path

from dflash.pipeline import Snapshot, StepStats

logger = logging.getLogger(__name__)


def utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_step_line(*, step: int, loss: float, acc: float, tau_tf: float, ktok_s: float, queue_depth: int,
                     queue_capacity: int, drafters_live: int, drafters_total: int) -> str:
    return (f"step {step} | loss {loss:.3f} | acc {acc:.2f} | tau_tf {tau_tf:.1f} | {ktok_s:.1f} Ktok/s | "
            f"queue {queue_depth}/{queue_capacity} | drafters {drafters_live}/{drafters_total}")


class Metrics:
    """Collects drafter steps (``record``, from any thread) and emits a line + record per interval."""

    def __init__(
        self,
        *,
        log_every: int,
        path: Path | None = None,
        stream: t.TextIO | None = None,
        snapshot: t.Callable[[], Snapshot] | None = None,
    ) -> None:
        self.log_every = log_every
        self.path = path
        self.stream = stream if stream is not None else sys.stdout
        self.snapshot = snapshot
        self.records: list[dict[str, t.Any]] = []  # what was emitted (the last few; tests read them)
        self._lock = threading.Lock()
        self._file: t.TextIO | None = None
        self._file_failed = False
        self._reset()
        self._t_last: float | None = None
        self._prev: dict[str, tuple[float, float, float]] = {}

    def start(self) -> None:
        """Start the clock of the first interval (call right before the pipeline runs)."""
        with self._lock:
            self._t_last = time.monotonic()
            if self.snapshot is not None:
                self._prev = {w.name: (w.busy_s, w.wait_s, w.sync_s) for w in self.snapshot().workers}

    def _reset(self) -> None:
        self._n = 0
        self._tokens = 0
        self._loss = self._acc = self._tau = 0.0
        self._lr = 0.0
        self._slots: list[float] = []

    def record(self, step: int, stats: StepStats, tokens: int) -> None:
        with self._lock:
            self._n += 1
            self._tokens += tokens
            self._loss += stats.loss
            self._acc += stats.acc
            self._tau += stats.tau_tf
            self._lr = stats.lr
            if stats.acc_per_slot:
                if len(self._slots) != len(stats.acc_per_slot):
                    self._slots = [0.0] * len(stats.acc_per_slot)
                for k, a in enumerate(stats.acc_per_slot):
                    self._slots[k] += a
            if step % self.log_every == 0:
                self._emit(step)

    def _emit(self, step: int) -> None:
        now = time.monotonic()
        if self._t_last is None:
            self._t_last = now
        interval = max(now - self._t_last, 1e-9)
        n = max(self._n, 1)
        ktok_s = self._tokens / interval / 1000.0
        snap = self.snapshot() if self.snapshot is not None else None
        workers = []
        if snap is not None:
            for w in snap.workers:
                pb, pw, ps = self._prev.get(w.name, (0.0, 0.0, 0.0))
                workers.append({
                    "name": w.name, "role": w.role, "device": w.device, "alive": w.alive, "dead": w.dead,
                    "busy": round(min(1.0, (w.busy_s - pb) / interval), 4),
                    "wait_s": round(w.wait_s - pw, 4), "sync_s": round(w.sync_s - ps, 4),
                    "items": w.items, "error": w.error,
                })
                self._prev[w.name] = (w.busy_s, w.wait_s, w.sync_s)
        rec: dict[str, t.Any] = {
            "step": step,
            "loss": round(self._loss / n, 6),
            "acc": round(self._acc / n, 6),
            "tau_tf": round(self._tau / n, 6),
            "ktok_s": round(ktok_s, 4),
            "tokens": self._tokens,
            "steps": self._n,
            "interval_s": round(interval, 4),
            "lr": self._lr,
            "queue_depth": snap.queue_depth if snap else None,
            "queue_capacity": snap.queue_capacity if snap else None,
            "drafters_live": snap.live("drafter") if snap else None,
            "drafters_total": snap.total("drafter") if snap else None,
            "targets_live": snap.live("target") if snap else None,
            "targets_total": snap.total("target") if snap else None,
            "acc_per_slot": [round(a / n, 4) for a in self._slots],
            "workers": workers,
            "at": utc_now(),
        }
        line = format_step_line(
            step=step, loss=rec["loss"], acc=rec["acc"], tau_tf=rec["tau_tf"], ktok_s=ktok_s,
            queue_depth=rec["queue_depth"] or 0, queue_capacity=rec["queue_capacity"] or 0,
            drafters_live=rec["drafters_live"] or 0, drafters_total=rec["drafters_total"] or 0,
        )
        print(line, file=self.stream, flush=True)
        self._write(rec)
        self.records.append(rec)
        del self.records[:-100]
        self._t_last = now
        self._reset()

    def _write(self, rec: dict[str, t.Any]) -> None:
        if self.path is None or self._file_failed:
            return
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._file.flush()
        except OSError as e:  # progress on stdout goes on; training must not die for its log
            self._file_failed = True
            logger.error("metrics: cannot write %s (%s); stdout only from now on", self.path, e)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


__all__ = ["Metrics", "format_step_line", "utc_now"]
