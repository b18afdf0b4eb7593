"""Progress: one human line per ``log_every`` steps on stdout, and the same facts in metrics.jsonl.

The line has exactly this form (dflashctl greps it; keep it stable)::

    step 120 | loss 2.314 | acc 0.61 | tau_tf 3.2 | 19.4 Ktok/s | queue 37/64 | drafters 3/3 | busy T 97 96 | D 99 54 98

The busy field is every worker's busy percent over the interval, targets (T) then drafters (D) in index
order, ``-`` for a dead one: a starving drafter shows in ``tail``. With ``[eval] every`` (``dflash.train.validation``),
once the first held-out eval has ended, one more field comes last: ``tau 3.21 @100 | best 3.40 @80``, the
latest held-out tau and its step, and the best so far (what ``checkpoints/best`` points to).
Ktok/s is honest: target tokens in the batches the drafters finished during the interval, all drafters
together, divided by the wall-clock length of the interval (the first interval starts when the pipeline
starts). loss, acc and tau_tf are means over the steps of the interval. Each metrics.jsonl record also
carries the learning rate, queue depth and capacity, live and total drafters and targets, and ``workers``:
per worker, the fractions of the interval it spent ``busy`` (forward / step), waiting on the queue (``wait``:
a target blocked on a full queue, a drafter starved on an empty one), at the ``barrier`` (averaging,
checkpoint snapshot) and the rest (``other``: the metrics themselves, the data, a dead worker's time), the
``batches`` it finished in the interval and ``batches_s``; ``items`` counts all its batches, ``clock`` says how
busy was measured (``host`` or ``cuda-events``). ``at`` is ISO 8601 UTC.

Held-out evals (``record_eval``, from the eval's thread) are records of their own in metrics.jsonl, with
``"kind": "eval"`` (step records have no ``kind``): the step, ``tau``, ``best_step``, ``best_tau``, ``is_best``
and what was decoded; and a line of their own: ``eval step 100 | tau 3.214 | best 3.214 @100 (new best) | ...``.

With ``tensorboard_dir`` the same scalars go to TensorBoard event files there (``global_step`` = the
training step, so the attempts of one run continue one curve under ``tensorboard --logdir <run dir>``);
the evals as ``eval/tau`` and ``eval/best_tau``. With ``wandb`` (``WandbRun``, the ``wandb`` extra) the same
tags go to one W&B run per attempt, grouped by the run id; every value carries ``global_step`` as its x
(``define_metric``), so an eval that ends after later steps were logged is not dropped as out of order.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import logging
import sys
import threading
import time
import typing as t
from pathlib import Path

import torch

from dflash.train.divergence import Diverged, LossSpike, NonfiniteGuard
from dflash.train.pipeline import Snapshot, StepStats, WorkerState

logger = logging.getLogger("dflash.metrics")  # the name train.log has always shown


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


TENSORBOARD_HINT = "needs the tensorboard package: pip install 'dflash[tensorboard]'"
WANDB_HINT = "needs the wandb package: pip install 'dflash[wandb]'"


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
    held_out: t.Mapping[str, t.Any] | None = None,
    selector: tuple[float, float] | None = None,
) -> str:
    line = (
        f"step {step} | loss {loss:.3f} | acc {acc:.2f} | tau_tf {tau_tf:.1f} | {ktok_s:.1f} Ktok/s | "
        f"queue {queue_depth}/{queue_capacity} | drafters {drafters_live}/{drafters_total}"
    )
    if workers:  # appended last: parsers of the fields before it keep working
        line += " | " + busy_field(workers)
    if held_out is not None:  # after the busy field: the fields before it stay where they were
        line += " | " + tau_field(held_out)
    if selector is not None:  # DFlash2, last of all for the same reason
        line += f" | sel {selector[0]:.2f} | top-k {selector[1]:.2f}"
    return line


def tau_field(rec: t.Mapping[str, t.Any]) -> str:
    """``tau 3.21 @100 | best 3.40 @80``: an eval record's held-out tau, and the best so far."""
    out = f"tau {rec['tau']:.2f} @{rec['step']}"
    if isinstance(rec.get("best_tau"), (int, float)):
        out += f" | best {rec['best_tau']:.2f} @{rec['best_step']}"
    return out


def eval_line(rec: t.Mapping[str, t.Any]) -> str:
    """The line an eval prints when it ends: ``eval step 100 | tau 3.214 | best 3.214 @100 (new best) | ...``."""
    best = ""
    if isinstance(rec.get("best_tau"), (int, float)):
        best = f" | best {rec['best_tau']:.3f} @{rec['best_step']}{' (new best)' if rec.get('is_best') else ''}"
    return (
        f"eval step {rec['step']} | tau {rec['tau']:.3f}{best} | {rec['prompts']} prompts, "
        f"{rec['new_tokens']} new tokens in {rec['seconds']:.1f} s"
    )


def scalars(rec: t.Mapping[str, t.Any]) -> dict[str, float]:
    """A metrics.jsonl record as tracker tags (TensorBoard and W&B show the same ones)."""
    out: dict[str, float] = {}
    if rec.get("kind") == "eval":
        out["eval/tau"] = rec["tau"]
        if rec.get("best_tau") is not None:
            out["eval/best_tau"] = rec["best_tau"]
        return out
    for key in (
        "loss",
        "acc",
        "tau_tf",
        "ktok_s",
        "lr",
        "queue_depth",
        "drafters_live",
        "targets_live",
        "sel_acc",
        "top_k_rate",
    ):
        if rec.get(key) is not None:
            out[f"train/{key}"] = rec[key]
    for k, a in enumerate(rec.get("acc_per_slot") or []):
        out[f"acc_per_slot/{k + 1}"] = a
    for w in rec.get("workers") or []:
        out[f"busy/{w['name']}"] = w["busy"]
        out[f"wait/{w['name']}"] = w["wait"]
    return out


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


@dataclasses.dataclass(frozen=True, slots=True)
class _Interval:
    """A closed log interval, waiting to be read and written (``Metrics._emit``)."""

    step: int
    interval: float
    steps: int
    tokens: int
    lr: float
    pending: list[StepStats]
    at: list[int]  # the step of each pending figure
    snapshot: Snapshot | None
    workers: list[dict[str, t.Any]]


_readers: dict[torch.device, t.Any] = {}
_readers_lock = threading.Lock()


def _reader_stream(dev: torch.device) -> t.Any:
    """The metrics' own CUDA stream on ``dev`` (one per device, shared by whichever thread emits)."""
    with _readers_lock:
        if dev not in _readers:
            _readers[dev] = torch.cuda.Stream(dev)
        return _readers[dev]


def _stacked(group: t.Sequence[tuple[t.Any, ...]], dev: torch.device) -> torch.Tensor:
    """Steps' figures ``(loss, acc, tau_tf, nonfinite, selector, acc_per_slot)`` as one float64 matrix on ``dev``, a row per step
    (zero-padded to the widest), built on the caller's current stream."""
    vectors = [
        torch.cat(
            [
                p.detach().reshape(-1).double().to(dev)
                if isinstance(p, torch.Tensor)
                else torch.tensor(
                    [float(x) for x in (p if isinstance(p, tuple) else (p,))], dtype=torch.float64, device=dev
                )
                for p in parts
                if not (isinstance(p, tuple) and not p)  # DFlash's empty selector figures: nothing to build
            ]
        )
        for parts in group
    ]
    width = max(v.numel() for v in vectors)
    return torch.stack([torch.nn.functional.pad(v, (0, width - v.numel())) for v in vectors])


def wandb_available() -> bool:
    try:
        import wandb  # noqa: F401  # the optional [wandb] extra
    except ImportError:
        return False
    return True


class WandbRun:
    """One W&B run for this attempt (``[metrics] wandb``): ``group`` = the run id, so the attempts of one
    training run sit together; files under ``<attempt dir>/wandb`` (offline: ``wandb sync`` them later)."""

    def __init__(
        self,
        *,
        project: str,
        mode: str,
        entity: str | None,
        run_dir: Path,
        group: str | None,
        name: str,
        config: t.Mapping[str, t.Any],
    ) -> None:
        try:
            import wandb  # the optional [wandb] extra: imported only by runs that ask for it
        except ImportError:
            raise ImportError(f"metrics.wandb {WANDB_HINT}") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            entity=entity,
            mode=t.cast(t.Literal["online", "offline"], mode),  # config.py checked it is one of them
            dir=str(run_dir),
            group=group,
            name=name,
            job_type="train",
            config=dict(config),
            reinit="create_new",
        )
        # Every tag's x is global_step: an eval that ends after later steps were logged still counts.
        self._run.define_metric("global_step")
        self._run.define_metric("*", step_metric="global_step")

    def log(self, step: int, values: t.Mapping[str, float]) -> None:
        self._run.log({**values, "global_step": step})

    def close(self) -> None:
        self._run.finish()


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
        wandb: WandbRun | None = None,
        guard: NonfiniteGuard | None = None,
        spike: LossSpike | None = None,
    ) -> None:
        self.log_every = log_every
        # a node of a group counts its updates in strides of the nodes: log when a multiple is reached or passed
        self.step_stride = step_stride
        self._seen = 0
        self.path = path
        self.stream = stream if stream is not None else sys.stdout
        self.snapshot = snapshot
        self.records: list[dict[str, t.Any]] = []  # what was emitted (the last few; tests read them)
        self._lock = threading.Lock()  # the counters and closing an interval (no device read under it)
        self._emit_lock = threading.Lock()  # reading, printing and writing closed intervals, one at a time
        self._outbox: collections.deque[_Interval] = collections.deque()  # closed, not yet emitted
        self._file: t.TextIO | None = None
        self._file_failed = False
        self._closed = False
        self._reset()
        self._t_last: float | None = None
        self._prev: dict[str, tuple[float, float, float, int]] = {}
        # created here, not at the first record: a missing package is an error at start, not mid-run
        self._tb = tensorboard_writer(tensorboard_dir) if tensorboard_dir is not None else None
        self._wandb = wandb
        self._held_out: dict[str, t.Any] | None = None  # the last eval record: its tau ends the step line
        self.guard = guard  # a step whose update was not finite: stop (Diverged) or count the skip
        self.spike = spike  # finite losses far above their running median: a warning and a record
        self.diverged: Diverged | None = None  # the first bad step that stopped the run (raised once)

    def start(self) -> None:
        """Start the clock of the first interval (call right before the pipeline runs)."""
        with self._lock:
            self._t_last = time.monotonic()
            if self.snapshot is not None:
                self._prev = {w.name: (w.busy_s, w.wait_s, w.sync_s, w.items) for w in self.snapshot().workers}

    def _reset(self) -> None:
        self._n = 0
        self._tokens = 0
        self._lr = 0.0
        self._pending: list[StepStats] = []  # this interval's steps, read at its end
        self._at: list[int] = []

    def record(self, step: int, stats: StepStats, tokens: int) -> None:
        """A drafter's finished step (any thread). Closing an interval happens under the lock (counters, the
        workers' snapshot: no device sync); reading its device figures and writing the line happen outside
        it, so the other drafters never wait for a device they do not use."""
        with self._lock:
            self._n += 1
            self._tokens += tokens
            self._lr = stats.lr
            self._pending.append(stats)  # device figures are NOT read here: that would sync every step
            self._at.append(step)
            seen, self._seen = self._seen, max(self._seen, step)
            if step % self.log_every == 0 if self.step_stride == 1 else step // self.log_every > seen // self.log_every:
                self._outbox.append(self._close(step))
        self._publish()

    def _close(self, step: int) -> _Interval:
        now = time.monotonic()
        if self._t_last is None:
            self._t_last = now
        snap = self.snapshot() if self.snapshot is not None else None
        workers = []
        interval = max(now - self._t_last, 1e-9)
        if snap is not None:
            for w in snap.workers:
                workers.append(worker_window(w, self._prev.get(w.name), interval))
                self._prev[w.name] = (w.busy_s, w.wait_s, w.sync_s, w.items)
        closed = _Interval(step, interval, self._n, self._tokens, self._lr, self._pending, self._at, snap, workers)
        self._t_last = now
        self._reset()
        return closed

    def _publish(self) -> None:
        """Emit every closed interval in order, by whichever thread gets the emit lock (never waiting for it:
        the holder emits what is queued, and looks again after it lets go)."""
        while self._outbox:
            if not self._emit_lock.acquire(blocking=False):
                return  # the holder emits it
            try:
                while self._outbox:
                    self._emit(self._outbox.popleft())
            finally:
                self._emit_lock.release()

    def nonfinite_pending(self) -> tuple[int, float] | None:
        """The first step not yet emitted whose update was not finite, and its code (``dflash.train.divergence``);
        read at a checkpoint barrier (no step in flight), before anything is written."""
        with self._lock:
            pending = [(n, s) for iv in self._outbox for n, s in zip(iv.at, iv.pending)]
            pending += zip(self._at, self._pending)
        if not pending:
            return None
        rows = self._read_pending([s for _, s in pending])
        return next(((n, row[3]) for (n, _), row in zip(pending, rows) if row[3]), None)

    @staticmethod
    def _read_pending(pending: t.Sequence[StepStats]) -> list[list[float]]:
        """The interval's figures as rows of numbers ``loss, acc, tau_tf, nonfinite, *selector, *acc_per_slot``, in the
        order of ``pending``: one read per device, on a reader stream of its own
        after the steps' ``ready`` events (only those steps' work is waited for, not the device's queue).

        Every op on a CUDA figure runs on the reader stream after its wait: one queued on the emitting
        thread's stream would come after ``ready`` with nothing ordering the reader's read after it."""
        by_device: dict[torch.device, list[tuple[t.Any, ...]]] = {}
        where: dict[torch.device, list[int]] = {}
        events: dict[torch.device, t.Any] = {}
        rows: list[list[float]] = [[] for _ in pending]
        for k, s in enumerate(pending):
            parts = (s.loss, s.acc, s.tau_tf, s.nonfinite, s.selector, s.acc_per_slot)
            dev = next((p.device for p in parts if isinstance(p, torch.Tensor)), None)
            if dev is None:
                rows[k] = [float(s.loss), float(s.acc), float(s.tau_tf), float(s.nonfinite)]
                rows[k] += [*(float(a) for a in s.selector), *(float(a) for a in s.acc_per_slot)]
                continue
            by_device.setdefault(dev, []).append(parts)
            where.setdefault(dev, []).append(k)
            if s.ready is not None:
                events[dev] = s.ready  # steps of one device finish in order: the last one covers them
        for dev, group in by_device.items():
            if dev.type == "cuda" and dev in events:
                reader = _reader_stream(dev)
                with torch.cuda.stream(reader):
                    reader.wait_event(events[dev])
                    read = _stacked(group, dev).tolist()  # syncs the reader stream only
            else:
                read = _stacked(group, dev).tolist()
            for k, row in zip(where[dev], read):
                rows[k] = row
        return rows

    def _checked(self, iv: _Interval, rows: list[list[float]]) -> list[list[float]]:
        """The rows of finite updates; a non-finite one goes to the guard (a skip recorded, or ``Diverged``
        raised after its record), a finite loss to the spike watch."""
        kept = []
        for step, row in zip(iv.at, rows):
            if row[3] and self.guard is not None:
                if self.diverged is not None:  # the run is ending with the first one: said once
                    continue
                try:
                    verdict = self.guard.bad(step, row[3])
                except Diverged as e:
                    self.diverged = e
                    self._write({"event": "diverged", "step": e.step, "figure": e.figure,
                                 "last_finite": e.last_finite, "at": utc_now()})  # fmt: skip
                    raise
                logger.warning("%s", verdict.line())
                self._write({**verdict.record(), "at": utc_now()})
                continue
            if self.guard is not None:
                self.guard.finite()
            spike = self.spike.observe(step, row[0]) if self.spike is not None else None
            if spike is not None:
                logger.warning("%s", spike.line())
                self._write({**spike.record(), "at": utc_now()})
            kept.append(row)
        return kept

    def _emit(self, iv: _Interval) -> None:
        rows = self._checked(iv, self._read_pending(iv.pending))
        if not rows:  # every update of the interval was skipped: their records say so, no step line
            return
        # DFlash2 steps carry two selector figures between nonfinite and the slots (every step of a run alike)
        has_sel = any(len(s.selector) for s in iv.pending)
        loss_sum = acc_sum = tau_sum = 0.0
        sel_sum = [0.0, 0.0]
        slots_sum: list[float] = []
        for loss, acc, tau, _bad, *slots in rows:
            loss_sum += loss
            acc_sum += acc
            tau_sum += tau
            if has_sel:
                sel_sum = [sel_sum[0] + slots[0], sel_sum[1] + slots[1]]
                slots = slots[2:]
            if slots:
                if len(slots_sum) != len(slots):
                    slots_sum = [0.0] * len(slots)
                for k, a in enumerate(slots):
                    slots_sum[k] += a
        n = max(len(rows), 1)
        ktok_s = iv.tokens / iv.interval / 1000.0
        snap, workers = iv.snapshot, iv.workers
        rec: dict[str, t.Any] = {
            "step": iv.step,
            "loss": round(loss_sum / n, 6),
            "acc": round(acc_sum / n, 6),
            "tau_tf": round(tau_sum / n, 6),
            "ktok_s": round(ktok_s, 4),
            "tokens": iv.tokens,
            "steps": iv.steps,
            "interval_s": round(iv.interval, 4),
            "lr": iv.lr,
            "queue_depth": snap.queue_depth if snap else None,
            "queue_capacity": snap.queue_capacity if snap else None,
            "drafters_live": snap.live("drafter") if snap else None,
            "drafters_total": snap.total("drafter") if snap else None,
            "targets_live": snap.live("target") if snap else None,
            "targets_total": snap.total("target") if snap else None,
            "acc_per_slot": [round(a / n, 4) for a in slots_sum],
            "workers": workers,
            "at": utc_now(),
        }
        if has_sel:
            rec["sel_acc"] = round(sel_sum[0] / n, 6)
            rec["top_k_rate"] = round(sel_sum[1] / n, 6)
        line = format_step_line(
            step=iv.step,
            loss=rec["loss"],
            acc=rec["acc"],
            tau_tf=rec["tau_tf"],
            ktok_s=ktok_s,
            queue_depth=rec["queue_depth"] or 0,
            queue_capacity=rec["queue_capacity"] or 0,
            drafters_live=rec["drafters_live"] or 0,
            drafters_total=rec["drafters_total"] or 0,
            workers=workers,
            held_out=self._held_out,
            selector=(rec["sel_acc"], rec["top_k_rate"]) if has_sel else None,
        )
        print(line, file=self.stream, flush=True)
        self._write(rec)
        self._write_tensorboard(rec)
        self._write_wandb(rec)
        self.records.append(rec)
        del self.records[:-100]

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

    def record_eval(self, rec: dict[str, t.Any]) -> None:
        """A held-out eval's record (``dflash.train.validation``; from its thread): its line, metrics.jsonl, trackers."""
        with self._lock:
            rec = {**rec, "at": utc_now()}
            self._held_out = rec
            print(eval_line(rec), file=self.stream, flush=True)
            self._write(rec)
            self._write_tensorboard(rec)
            self._write_wandb(rec)
            self.records.append(rec)
            del self.records[:-100]

    def record_event(self, rec: dict[str, t.Any]) -> None:
        """A record of its own in metrics.jsonl, ``{"event": "checkpoint-skipped" | "sync-failed" | ...}``: from
        any thread, also after ``close`` (a sync ends after the last step)."""
        with self._lock:
            rec = {**rec, "at": utc_now()}
            self._write(rec)
            if self._closed and self._file is not None:
                self._file.close()
                self._file = None
            self.records.append(rec)
            del self.records[:-100]

    def _write_tensorboard(self, rec: dict[str, t.Any]) -> None:
        """The record's scalars as TensorBoard tags (``train/loss``, ``busy/drafter-1``, ``eval/tau``, ...)."""
        if self._tb is None:
            return
        step = rec["step"]
        try:
            for tag, value in scalars(rec).items():
                self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()  # once per log interval: a live `tensorboard` sees it now
        except OSError as e:  # like metrics.jsonl: the run goes on without it
            logger.error("metrics: cannot write TensorBoard events (%s); not any more", e)
            self._tb = None

    def _write_wandb(self, rec: dict[str, t.Any]) -> None:
        if self._wandb is None:
            return
        try:
            self._wandb.log(rec["step"], scalars(rec))
        except Exception as e:  # wandb raises its own errors (a dead service, a full disk): the run goes on
            logger.error("metrics: cannot log to W&B (%s: %s); not any more", type(e).__name__, e)
            self._wandb = None

    def close(self) -> None:
        diverged: Diverged | None = None  # first seen here (one raised earlier is on its way out already)
        with self._emit_lock:  # every closed interval is out before the files close
            while self._outbox:
                try:
                    self._emit(self._outbox.popleft())
                except Diverged as e:  # the files still close; the run ends with it
                    diverged = diverged or e
        try:
            self._close_files()
        finally:
            if diverged is not None:
                raise diverged

    def _close_files(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._wandb is not None:
                wb, self._wandb = self._wandb, None
                try:
                    wb.close()
                except Exception as e:  # as in _write_wandb: the run's result does not hang on its tracker
                    logger.error("metrics: cannot finish the W&B run (%s: %s)", type(e).__name__, e)


__all__ = [
    "Metrics",
    "TENSORBOARD_HINT",
    "WANDB_HINT",
    "WandbRun",
    "busy_field",
    "eval_line",
    "format_step_line",
    "scalars",
    "tau_field",
    "tensorboard_available",
    "tensorboard_writer",
    "utc_now",
    "wandb_available",
    "worker_window",
]
