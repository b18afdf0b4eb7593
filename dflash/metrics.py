"""Progress: one human line per ``log_every`` steps on stdout, and the same facts in metrics.jsonl.

The line has exactly this form (dflashctl greps it; keep it stable)::

    step 120 | loss 2.314 | acc 0.61 | tau_tf 3.2 | 19.4 Ktok/s | queue 37/64 | drafters 3/3 | busy T 97 96 | D 99 54 98

The last field is every worker's busy percent over the interval, targets (T) then drafters (D) in index
order, ``-`` for a dead one: a starving drafter shows in ``tail``.
Ktok/s is honest: target tokens in the batches the drafters finished during the interval, all drafters
together, divided by the wall-clock length of the interval (the first interval starts when the pipeline
starts). loss, acc and tau_tf are means over the steps of the interval. Each metrics.jsonl record also
carries the learning rate, queue depth and capacity, live and total drafters and targets, and ``workers``:
per worker, the fractions of the interval it spent ``busy`` (forward / step), waiting on the queue (``wait``:
a target blocked on a full queue, a drafter starved on an empty one), at the ``barrier`` (averaging,
checkpoint snapshot) and the rest (``other``: the metrics themselves, the data, a dead worker's time), the
``batches`` it finished in the interval and ``batches_s``; ``items`` counts all its batches, ``clock`` says how
busy was measured (``host`` or ``cuda-events``). ``at`` is ISO 8601 UTC.

With ``tensorboard_dir`` the same scalars go to TensorBoard event files there (``global_step`` = the
training step, so the attempts of one run continue one curve under ``tensorboard --logdir <run dir>``).
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

import torch

from dflash.pipeline import Snapshot, StepStats, WorkerState

logger = logging.getLogger(__name__)


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


TENSORBOARD_HINT = "needs the tensorboard package: pip install 'dflash[tensorboard]'"


def format_step_line(
    *,
    step: int,
    loss: float,
    acc: float,
    tau_tf: float,
    ktok_s: float,
    queue_depth: int,
    queue_capacity: int,
    drafters_live: int,
    drafters_total: int,
    workers: t.Sequence[t.Mapping[str, t.Any]] = (),
) -> str:
    line = (
        f"step {step} | loss {loss:.3f} | acc {acc:.2f} | tau_tf {tau_tf:.1f} | {ktok_s:.1f} Ktok/s | "
        f"queue {queue_depth}/{queue_capacity} | drafters {drafters_live}/{drafters_total}"
    )
    if workers:  # appended last: parsers of the fields before it keep working
        line += " | " + busy_field(workers)
    return line


def busy_field(workers: t.Sequence[t.Mapping[str, t.Any]]) -> str:
    """``busy T 97 96 | D 99 54 98``: busy percent per worker, ``-`` for a dead one."""

    def group(role: str, tag: str) -> str:
        ws = sorted((w for w in workers if w.get("role") == role), key=lambda w: w.get("index", 0))
        return " ".join([tag, *("-" if w.get("dead") else f"{round(100 * (w.get('busy') or 0.0))}" for w in ws)])

    return f"busy {group('target', 'T')} | {group('drafter', 'D')}"


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401  # the optional [tensorboard] extra
    except ImportError:
        return False
    return True


def tensorboard_writer(log_dir: Path) -> t.Any:
    """A ``SummaryWriter`` on ``log_dir``; ImportError with the one line to fix it when tensorboard is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the optional [tensorboard] extra
    except ImportError:  # torch raises it when the tensorboard package is not installed
        raise ImportError(f"metrics.tensorboard {TENSORBOARD_HINT}") from None
    return SummaryWriter(log_dir=str(log_dir))


def worker_window(w: WorkerState, prev: tuple[float, float, float, int] | None, interval: float) -> dict[str, t.Any]:
    """One worker's figures over an interval of ``interval`` seconds since the counters ``prev``."""
    pb, pw, ps, pi = prev or (0.0, 0.0, 0.0, 0)

    def frac(x: float) -> float:
        return round(min(1.0, max(0.0, x / interval)), 4)

    busy, wait, barrier = frac(w.busy_s - pb), frac(w.wait_s - pw), frac(w.sync_s - ps)
    if busy + wait + barrier > 1.0:  # a phase closed a moment after the window's end: never more than all of it
        total = busy + wait + barrier
        busy, wait, barrier = (round(x / total, 4) for x in (busy, wait, barrier))
    batches = w.items - pi
    return {
        "name": w.name,
        "role": w.role,
        "index": w.index,
        "device": w.device,
        "alive": w.alive,
        "dead": w.dead,
        "busy": busy,
        "wait": wait,
        "barrier": barrier,
        "other": round(max(0.0, 1.0 - busy - wait - barrier), 4),
        "batches": batches,
        "batches_s": round(batches / interval, 4),
        "items": w.items,
        "clock": w.clock,
        "error": w.error,
    }


class Metrics:
    """Collects drafter steps (``record``, from any thread) and emits a line + record per interval."""

    def __init__(
        self,
        *,
        log_every: int,
        path: Path | None = None,
        stream: t.TextIO | None = None,
        snapshot: t.Callable[[], Snapshot] | None = None,
        tensorboard_dir: Path | None = None,
        step_stride: int = 1,
    ) -> None:
        self.log_every = log_every
        # a node of a group counts its updates in strides of the nodes: log when a multiple is reached or passed
        self.step_stride = step_stride
        self._seen = 0
        self.path = path
        self.stream = stream if stream is not None else sys.stdout
        self.snapshot = snapshot
        self.records: list[dict[str, t.Any]] = []  # what was emitted (the last few; tests read them)
        self._lock = threading.Lock()
        self._file: t.TextIO | None = None
        self._file_failed = False
        self._reset()
        self._t_last: float | None = None
        self._prev: dict[str, tuple[float, float, float, int]] = {}
        # created here, not at the first record: a missing package is an error at start, not mid-run
        self._tb = tensorboard_writer(tensorboard_dir) if tensorboard_dir is not None else None

    def start(self) -> None:
        """Start the clock of the first interval (call right before the pipeline runs)."""
        with self._lock:
            self._t_last = time.monotonic()
            if self.snapshot is not None:
                self._prev = {w.name: (w.busy_s, w.wait_s, w.sync_s, w.items) for w in self.snapshot().workers}

    def _reset(self) -> None:
        self._n = 0
        self._tokens = 0
        self._loss = self._acc = self._tau = 0.0
        self._lr = 0.0
        self._slots: list[float] = []
        self._pending: list[StepStats] = []  # this interval's steps, read at its end

    def record(self, step: int, stats: StepStats, tokens: int) -> None:
        with self._lock:
            self._n += 1
            self._tokens += tokens
            self._lr = stats.lr
            self._pending.append(stats)  # device figures are NOT read here: that would sync every step
            seen, self._seen = self._seen, max(self._seen, step)
            if step % self.log_every == 0 if self.step_stride == 1 else step // self.log_every > seen // self.log_every:
                self._emit(step)

    def _read_pending(self) -> None:
        """Sum the interval's figures: one host read per device (the only sync the metrics make)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        rows: list[list[float]] = []
        for s in self._pending:
            parts = (s.loss, s.acc, s.tau_tf, s.acc_per_slot)
            dev = next((p.device for p in parts if isinstance(p, torch.Tensor)), None)
            if dev is None:
                rows.append([float(s.loss), float(s.acc), float(s.tau_tf), *(float(a) for a in s.acc_per_slot)])
                continue
            flat = [
                p.detach().reshape(-1).double().to(dev)
                if isinstance(p, torch.Tensor)
                else torch.tensor(
                    [float(x) for x in (p if isinstance(p, tuple) else (p,))], dtype=torch.float64, device=dev
                )
                for p in parts
            ]
            by_device.setdefault(dev, []).append(torch.cat(flat))
        for vectors in by_device.values():
            width = max(v.numel() for v in vectors)
            stacked = torch.stack([torch.nn.functional.pad(v, (0, width - v.numel())) for v in vectors])
            rows.extend(stacked.tolist())
        self._pending = []
        for loss, acc, tau, *slots in rows:
            self._loss += loss
            self._acc += acc
            self._tau += tau
            if slots:
                if len(self._slots) != len(slots):
                    self._slots = [0.0] * len(slots)
                for k, a in enumerate(slots):
                    self._slots[k] += a

    def _emit(self, step: int) -> None:
        self._read_pending()
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
                workers.append(worker_window(w, self._prev.get(w.name), interval))
                self._prev[w.name] = (w.busy_s, w.wait_s, w.sync_s, w.items)
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
            step=step,
            loss=rec["loss"],
            acc=rec["acc"],
            tau_tf=rec["tau_tf"],
            ktok_s=ktok_s,
            queue_depth=rec["queue_depth"] or 0,
            queue_capacity=rec["queue_capacity"] or 0,
            drafters_live=rec["drafters_live"] or 0,
            drafters_total=rec["drafters_total"] or 0,
            workers=workers,
        )
        print(line, file=self.stream, flush=True)
        self._write(rec)
        self._write_tensorboard(rec)
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

    def _write_tensorboard(self, rec: dict[str, t.Any]) -> None:
        """The record's scalars as TensorBoard tags (``train/loss``, ``busy/drafter-1``, ...)."""
        if self._tb is None:
            return
        step = rec["step"]
        try:
            for key in ("loss", "acc", "tau_tf", "ktok_s", "lr", "queue_depth", "drafters_live", "targets_live"):
                if rec.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", rec[key], global_step=step)
            for k, a in enumerate(rec["acc_per_slot"]):
                self._tb.add_scalar(f"acc_per_slot/{k + 1}", a, global_step=step)
            for w in rec["workers"]:
                self._tb.add_scalar(f"busy/{w['name']}", w["busy"], global_step=step)
                self._tb.add_scalar(f"wait/{w['name']}", w["wait"], global_step=step)
            self._tb.flush()  # once per log interval: a live `tensorboard` sees it now
        except OSError as e:  # like metrics.jsonl: the run goes on without it
            logger.error("metrics: cannot write TensorBoard events (%s); not any more", e)
            self._tb = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None


__all__ = [
    "Metrics",
    "TENSORBOARD_HINT",
    "busy_field",
    "format_step_line",
    "tensorboard_available",
    "tensorboard_writer",
    "utc_now",
    "worker_window",
]
