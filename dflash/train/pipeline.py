"""The threaded pipeline: T target threads -> ONE bounded queue -> D drafter threads.

Each target thread reads its shard of batches, runs its target's forward (under no_grad, on its device)
and puts the features into the queue; each drafter thread takes whatever item comes next and trains
its own replica with its own optimizer. The queue is bounded (backpressure: targets wait when drafters
are behind) and consume-once (every batch is trained exactly once). Because every drafter pulls from
the same queue, a slow or dead drafter only lowers the total: the others take its share by themselves.
``mode="per-drafter"`` (target i feeds only drafter i mod D, each queue 1/D of the capacity) is the
old round-robin assignment, kept to measure against (5 targets on 3 drafters = [2, 2, 1]).
The queue is bounded in items (``capacity``) AND in bytes (``max_bytes``, the payloads' ``nbytes``):
features in flight sit in pinned host memory or on a drafter GPU, and neither is unlimited.

Rules that keep it from hanging:

- every blocking ``get``/``put`` waits at most ``poll`` seconds at a time and then checks the stop state;
- a worker that raises (e.g. ``torch.OutOfMemoryError`` on its GPU) is logged with its role, device and
  traceback, kept in the error list, and the others go on; with no drafter left, or no target left
  (once the queue is drained), the run ends and ``run()`` raises ``PipelineError``, after joining
  every thread;
- an OOM in a drafter step is retried ONCE with ``micro_batches=2`` after the drafter's ``recover()``
  (the trainer halves the batch, or the anchors of a single sequence); a second OOM kills that drafter,
  and the batch it held is not trained. A target OOM is not retried: that GPU is full with the model's
  forward itself, and the other targets carry on;
- a fatal error (an injected ``raise``, a failing averaging or checkpoint) stops everything and is
  re-raised by ``run()`` with its own traceback.

Steps are GLOBAL: one step is one optimizer update by any drafter (``accumulate`` batches); the counter, the learning-rate schedule,
``max_steps``, averaging and checkpoint intervals all count them. Every ``average_every`` (and every
checkpoint) steps the drafters meet at a barrier: each finishes its step in flight, the last to arrive
runs ``on_sync`` (averaging, checkpoint) while no step is in flight, then all go on; the event carries
the step count reached by then (the interval's step plus the steps that were in flight, e.g. a
checkpoint requested at step 50 may be step 51). The barrier's
parties are the drafters still running, so a drafter that dies never blocks it; one that does not
arrive within ``barrier_timeout`` is left out of that round (and logged). At the end (``max_steps``, or
a stop request such as SIGTERM) the drafters finish their step in flight and ``on_sync`` runs once more
with ``final=True`` on the main thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
import traceback
import typing as t

import torch

from dflash.errors import DflashError
from dflash.train.feature_queue import FeatureQueue, Item, format_bytes, payload_bytes, pinned_host_bytes

logger = logging.getLogger("dflash.pipeline")  # the name train.log has always shown

Role = t.Literal["target", "drafter"]


class PipelineError(DflashError, RuntimeError):
    """The run cannot go on: no drafter or no target is left, or threads would not stop."""

    def __init__(self, message: str, failures: t.Sequence[WorkerFailure] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


class InjectedFault(DflashError, RuntimeError):
    """Raised for an injected fault that names no exception of its own (here, not in dflash.train.faults: its
    name ``dflash.train.pipeline.InjectedFault`` is in crash reports and fingerprints; dflash.train.faults imports it)."""


class Fault(t.Protocol):
    """An injected fault as the pipeline acts on it (``dflash.train.faults.Fault``)."""

    kind: str  # "raise", or "hang": stop making progress until the run stops
    exc: t.Callable[[str], BaseException] | None  # from the worker's device; None: InjectedFault
    fatal: bool  # stop the whole run instead of one worker


class Injector(t.Protocol):
    """Asked before every unit of work (``dflash.train.faults.FaultInjector``): the fault to act on, or None."""

    def check(self, role: str, index: int, step: int) -> Fault | None: ...


# --------------------------------------------------------------------------------------------
# What flows and what workers do


@dataclasses.dataclass(frozen=True, slots=True)
class StepStats:
    """What one drafter step reports. The figures may be device tensors (0-dim; ``acc_per_slot`` 1-dim):
    reading them is a host sync, so the metrics read them once per log interval, not per step."""

    loss: float | torch.Tensor
    acc: float | torch.Tensor  # mean accuracy over the scored slots
    tau_tf: float | torch.Tensor  # teacher-forced accept length
    blocks: int = 0
    lr: float = 0.0
    acc_per_slot: tuple[float, ...] | torch.Tensor = ()
    # what went bad in the update (dflash.train.divergence: 0 finite, 1 the loss, 2 the gradient norm); skipped if not 0
    nonfinite: float | torch.Tensor = 0.0
    # DFlash2: (selector accuracy where the label is in the top-k, how often it is); () for DFlash
    selector: tuple[float, ...] | torch.Tensor = ()
    ready: t.Any = (
        None  # CUDA: an event after the step's figures on its stream (the metrics wait on it, not the device)
    )


class TargetWork(t.Protocol):
    """A target replica: features for one batch, on the device the consumer wants (or pinned CPU)."""

    device: str

    def produce(self, batch: t.Any) -> t.Any: ...


class DrafterWork(t.Protocol):
    """A drafter replica with its optimizer."""

    device: str

    def step(self, payload: t.Any, *, step: int, micro_batches: int = 1) -> StepStats: ...

    def recover(self) -> None:
        """After an out-of-memory error: drop gradients and cached blocks before the retry."""
        ...


class Source(t.Protocol):
    """A shard: an iterator of batches that carry ``index`` (global batch index) and ``n_tokens``."""

    def __next__(self) -> t.Any: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    max_steps: int
    start_step: int = 0  # resumed runs continue the global step count
    capacity: int = 64  # items in flight at most
    max_bytes: int | None = None  # and bytes of payloads (``payload.nbytes``) in flight at most; None: no bound
    mode: str = "shared"  # or "per-drafter"
    average_every: int = 0  # 0: no periodic averaging barrier
    checkpoint_every: int = 0  # 0: only the final checkpoint
    evaluate_every: int = 0  # held-out evals ([eval] every); each is a checkpoint too. 0: none
    barrier_timeout: float = 600.0
    oom_retry: bool = True
    # queue items one drafter step takes (gradient accumulation): the step gets them as a list when > 1,
    # and one global step is one optimizer update. A source that runs dry mid-update trains what it got.
    accumulate: int = 1
    poll: float = 0.05  # seconds any blocking wait lasts before it looks at the stop state again
    accounting: bool = True  # per-worker busy/wait time (off only to measure what it costs: the bench)
    join_timeout: float = 8.0  # after the stop, how long all threads together get to exit
    # A node of a group (dflash.train.distributed): each local update counts ``step_stride`` (the nodes) global
    # steps, every node at the same numbers, so all nodes meet the same barriers; ``shard_stride`` is the
    # shards of every node (batch g belongs to shard g mod it). 0: this pipeline's targets.
    step_stride: int = 1
    shard_stride: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class SyncEvent:
    """A moment with no drafter step in flight among ``replicas``: average them, checkpoint."""

    step: int
    average: bool
    checkpoint: bool
    replicas: tuple[int, ...]  # drafters taking part
    missing: tuple[int, ...]  # running drafters that did not reach the barrier in time
    position: tuple[int, ...]  # next global batch index of every shard (the data position)
    final: bool = False
    evaluate: bool = False  # an eval step: its checkpoint is evaluated (dflash.train.validation)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerFailure:
    role: Role
    index: int
    device: str
    step: int | None  # drafters: the global step; targets: their own batch count
    exc: BaseException
    traceback: str
    fatal: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def error_line(self) -> str:
        return traceback.format_exception_only(type(self.exc), self.exc)[-1].strip()

    def summary(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"{self.name} ({self.device}) died{at}: {self.error_line}"


@dataclasses.dataclass(slots=True)
class WorkerState:
    """Live counters of one worker thread (written by it, read by the metrics)."""

    role: Role
    index: int
    device: str
    alive: bool = True
    dead: bool = False
    busy_s: float = 0.0  # in forward (targets) or in the training step (drafters)
    wait_s: float = 0.0  # blocked on the queue (targets: full; drafters: empty)
    sync_s: float = 0.0  # drafters: at the averaging/checkpoint barrier
    longest_s: float = 0.0  # the longest busy stretch: a stop waits that long for one in flight (65K-token forwards)
    items: int = 0
    error: str | None = None
    # how busy_s is measured: "host" (monotonic clock around the work; a CPU worker, or a CUDA target,
    # whose produce() ends in a sync) or "cuda-events" (a CUDA drafter: events around each step on its
    # stream, folded in by ``Pipeline.snapshot`` once they completed, so no sync is added)
    clock: str = "host"
    # the phase running now ("busy", "wait", "barrier"; "" = other) and since when: a snapshot counts the
    # open part too, so a long wait is spread over the log windows it spans, not credited at its end
    phase: str = ""
    since: float = 0.0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def enter(self, phase: str, now: float) -> None:
        """Close the running phase (its seconds go to its counter) and start ``phase`` at ``now``."""
        with self._lock:
            self._close(now)
            self.phase, self.since = phase, now

    def _close(self, now: float) -> None:
        if self.phase == "busy":
            self.busy_s += now - self.since
            self.longest_s = max(self.longest_s, now - self.since)
        elif self.phase == "wait":
            self.wait_s += now - self.since
        elif self.phase == "barrier":
            self.sync_s += now - self.since

    def settled(self, now: float) -> WorkerState:
        """A copy with the running phase counted up to ``now``."""
        with self._lock:
            copy = dataclasses.replace(self)
        copy._close(max(now, copy.since))  # a phase opened after ``now`` has nothing before it to count
        copy.since = now
        return copy


@dataclasses.dataclass(frozen=True, slots=True)
class Snapshot:
    at: float  # time.monotonic()
    step: int
    queue_depth: int
    queue_capacity: int
    workers: tuple[WorkerState, ...]  # copies

    def live(self, role: Role) -> int:
        """Workers of ``role`` that have not died (one that finished its work still counts)."""
        return sum(1 for w in self.workers if w.role == role and not w.dead)

    def total(self, role: Role) -> int:
        return sum(1 for w in self.workers if w.role == role)


@dataclasses.dataclass(frozen=True, slots=True)
class RunResult:
    steps: int  # the global step count at the end (resumed runs include earlier steps)
    reason: str  # "max-steps" or "stopped"
    failures: tuple[WorkerFailure, ...]
    position: tuple[int, ...]


def _drop_frames(exc: BaseException) -> str:
    """Detach ``exc`` (and its causes) from the frames it was raised through; return its one-line text.

    A traceback keeps every frame's locals alive (activations, gradients of a failed step) for as long
    as the exception lives; the text (``traceback.format_exc()``) is what we keep.
    """
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return line


# --------------------------------------------------------------------------------------------
# Step counting and the barrier


@dataclasses.dataclass(slots=True)
class _Sync:
    step: int
    kinds: set[str]
    deadline: float
    arrived: set[int] = dataclasses.field(default_factory=set)
    running: bool = False
    done: bool = False


class _Coordinator:
    """The global step counter, the data position and the live-party barrier (one lock)."""

    def __init__(
        self,
        *,
        drafters: int,
        shard_starts: t.Sequence[int],
        stride: int,
        options: PipelineOptions,
        action: t.Callable[[SyncEvent], None] | None,
    ) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.opts = options
        self.completed = options.start_step
        self.claimed = options.start_step
        self.claims = 0  # local updates claimed (the global step is _nth of it)
        self.parties: set[int] = set(range(drafters))
        self.draining = False
        self.sync: _Sync | None = None
        self.deferred: set[str] = set()
        self.position = list(shard_starts)
        self.stride = stride
        self.action = action

    # drafters ---------------------------------------------------------------------------

    def next_step(self, j: int, state: WorkerState) -> int | None:
        """Pass any pending barrier, then claim the next global step; None: this drafter is done."""
        with self.cond:
            while True:
                if self.draining:
                    return None
                s = self.sync
                if s is not None and not s.done:
                    if self.opts.accounting:
                        state.enter("barrier", time.monotonic())
                    try:
                        self._barrier(j, s)
                    finally:
                        if self.opts.accounting:
                            state.enter("", time.monotonic())
                    continue
                if self.claimed >= self.opts.max_steps:
                    return None
                self.claims += 1
                self.claimed = self._nth(self.claims)
                return self.claimed

    def unclaim(self) -> None:
        with self.cond:
            self.claims -= 1
            self.claimed = self._nth(self.claims)

    def _nth(self, k: int) -> int:
        # the global step after k local updates (the last one may be short of a whole stride)
        return min(self.opts.max_steps, self.opts.start_step + k * self.opts.step_stride) if k else self.opts.start_step

    def took(self, item: Item) -> None:
        with self.cond:
            nxt = item.position + self.stride
            if nxt > self.position[item.shard]:
                self.position[item.shard] = nxt

    def complete(self) -> int:
        with self.cond:
            before = self.completed
            self.completed = n = min(self.opts.max_steps, before + self.opts.step_stride)
            kinds: set[str] = set()
            # an interval's multiple reached or passed (steps go by step_stride on a node of a group)
            if self.opts.average_every and n // self.opts.average_every > before // self.opts.average_every:
                kinds.add("average")
            if self.opts.checkpoint_every and n // self.opts.checkpoint_every > before // self.opts.checkpoint_every:
                kinds.add("checkpoint")
            if self.opts.evaluate_every and n // self.opts.evaluate_every > before // self.opts.evaluate_every:
                kinds |= {"checkpoint", "evaluate"}  # what is evaluated is a checkpoint (checkpoints/best)
            if kinds and n < self.opts.max_steps:  # the final sync covers the last step
                self._request(kinds, n)
            return n

    def retire(self, j: int) -> None:
        with self.cond:
            self.parties.discard(j)
            self.cond.notify_all()

    def drain(self) -> None:
        with self.cond:
            self.draining = True
            self.cond.notify_all()

    # internals --------------------------------------------------------------------------

    def _request(self, kinds: set[str], n: int) -> None:
        if self.sync is None:
            self.sync = _Sync(n, set(kinds), time.monotonic() + self.opts.barrier_timeout)
        elif not self.sync.running:
            self.sync.kinds |= kinds
        else:
            self.deferred |= kinds

    def _barrier(self, j: int, s: _Sync) -> None:
        s.arrived.add(j)
        self.cond.notify_all()
        while not s.done:
            if self.draining and not s.running:  # the final sync replaces it
                self._finish(s)
                return
            if not s.running and (self.parties <= s.arrived or time.monotonic() >= s.deadline):
                s.running = True
                replicas = tuple(sorted(s.arrived & self.parties))
                missing = tuple(sorted(self.parties - s.arrived))
                if missing:
                    logger.warning(
                        "barrier at step %d: %s did not arrive within %.0fs; going on without %s",
                        s.step,
                        ", ".join(f"drafter-{m}" for m in missing),
                        self.opts.barrier_timeout,
                        "it" if len(missing) == 1 else "them",
                    )
                event = SyncEvent(
                    step=self.completed,
                    average="average" in s.kinds,
                    checkpoint="checkpoint" in s.kinds,
                    replicas=replicas,
                    missing=missing,
                    position=tuple(self.position),
                    evaluate="evaluate" in s.kinds,
                )
                self.cond.release()
                try:
                    if self.action is not None:
                        self.action(event)
                finally:
                    self.cond.acquire()
                    self._finish(s)
                return
            self.cond.wait(self.opts.poll)

    def _finish(self, s: _Sync) -> None:
        s.done = True
        self.sync = None
        if self.deferred:
            kinds, self.deferred = self.deferred, set()
            self._request(kinds, self.completed)
        self.cond.notify_all()


class _DeviceTimer:
    """Busy time of a CUDA drafter: timing events around each step on the drafter's stream.

    A drafter step returns before its kernels ran (it makes no host sync), so the host clock would
    count launch time as busy and the GPU's work as waiting. The events are only queried (never waited
    for) when the metrics take a snapshot: a step whose kernels have not finished counts in the next window.
    """

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.pending: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event]] = collections.deque()
        self.lock = threading.Lock()

    def mark(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def done(self, start: torch.cuda.Event) -> None:
        end = self.mark()
        with self.lock:
            self.pending.append((start, end))

    def collect(self) -> float:
        """Seconds of GPU time of the steps that have finished since the last call (no wait)."""
        total = 0.0
        with self.lock:
            while self.pending and self.pending[0][1].query():
                start, end = self.pending.popleft()
                total += start.elapsed_time(end) / 1000.0
        return total


# --------------------------------------------------------------------------------------------
# The pipeline


class Pipeline:
    """Build with workers and their sources, then ``run()`` on the main thread (it blocks)."""

    def __init__(
        self,
        *,
        targets: t.Sequence[TargetWork],
        sources: t.Sequence[Source],
        drafters: t.Sequence[DrafterWork],
        options: PipelineOptions,
        shard_starts: t.Sequence[int] | None = None,
        on_sync: t.Callable[[SyncEvent], None] | None = None,
        on_step: t.Callable[[int, StepStats, int], None] | None = None,
        injector: Injector | None = None,
    ) -> None:
        if not targets or not drafters:
            raise ValueError("a pipeline needs at least one target and one drafter")
        if len(sources) != len(targets):
            raise ValueError(f"{len(targets)} targets need {len(targets)} sources, got {len(sources)}")
        if options.mode not in ("shared", "per-drafter"):
            raise ValueError(f'queue mode: expected "shared" or "per-drafter", got {options.mode!r}')
        self.targets = list(targets)
        self.sources = list(sources)
        self.drafters = list(drafters)
        self.options = options
        self.on_step = on_step
        self.on_sync = on_sync
        self.injector = injector  # None: no fault is ever injected
        T, D = len(targets), len(drafters)
        if options.mode == "shared":
            self.queues = [FeatureQueue(options.capacity, options.max_bytes)]
            self.feeds = [0] * T  # target i -> queue index
            self.takes = [0] * D  # drafter j -> queue index
        else:
            per = max(1, options.capacity // D)
            per_bytes = None if options.max_bytes is None else max(1, options.max_bytes // D)
            self.queues = [FeatureQueue(per, per_bytes) for _ in range(D)]
            self.feeds = [i % D for i in range(T)]
            self.takes = list(range(D))
        self.workers: dict[tuple[str, int], WorkerState] = {}
        for i, tw in enumerate(self.targets):
            self.workers[("target", i)] = WorkerState("target", i, tw.device)
        self._timers: dict[int, _DeviceTimer] = {}
        for j, w in enumerate(self.drafters):
            self.workers[("drafter", j)] = WorkerState("drafter", j, w.device)
            # a worker whose "compute" happens on the host (the bench's sleeps) says so with host_clock
            if (
                options.accounting
                and torch.device(w.device).type == "cuda"
                and torch.cuda.is_available()
                and not getattr(w, "host_clock", False)
            ):
                self._timers[j] = _DeviceTimer(w.device)
                self.workers[("drafter", j)].clock = "cuda-events"
        self._timer_lock = threading.Lock()
        starts = list(shard_starts) if shard_starts is not None else list(range(T))
        self.coord = _Coordinator(
            drafters=D,
            shard_starts=starts,
            stride=options.shard_stride or T,
            options=options,
            action=self._sync_action if on_sync is not None else None,
        )
        self.failures: list[WorkerFailure] = []
        self.threads: list[threading.Thread] = []
        self._thread_workers: dict[threading.Thread, WorkerState] = {}
        self._lock = threading.Lock()  # failures, liveness
        self._stop = threading.Event()  # everyone: leave now
        self._draining = threading.Event()  # drafters: finish the step in flight, claim no more
        self._done = threading.Event()  # the last drafter has left
        self._stop_requested = False  # set by signal handlers: a plain flag, no locks
        self._fatal: WorkerFailure | None = None
        self._fatal_ids: set[int] = set()
        self._ran = False

    # public -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Finish the steps in flight, run the final sync, return from ``run()`` with reason "stopped".

        Safe to call from a signal handler: on the main thread (where handlers run, while ``run()``
        waits) it only sets a flag that ``run()`` picks up within ``poll`` seconds; from another thread
        it also tells the workers at once.
        """
        self._stop_requested = True
        if threading.current_thread() is not threading.main_thread():
            self._draining.set()
            self.coord.drain()

    @property
    def step(self) -> int:
        return self.coord.completed

    def snapshot(self) -> Snapshot:
        with self._timer_lock:  # CUDA drafters: fold in the GPU time of their finished steps
            for j, timer in self._timers.items():
                self.workers[("drafter", j)].busy_s += timer.collect()
        # ONE clock reading for the window's end and every worker's open phase: settling each worker at
        # its own later reading let a loaded machine count 1.01 of a window (CI saw busy+wait+... = 1.0104)
        now = time.monotonic()
        return Snapshot(
            at=now,
            step=self.coord.completed,
            queue_depth=sum(q.qsize() for q in self.queues),
            queue_capacity=sum(q.maxsize for q in self.queues),
            workers=tuple(w.settled(now) for w in self.workers.values()),
        )

    def run(self) -> RunResult:
        if self._ran:
            raise RuntimeError("a Pipeline runs once")
        self._ran = True
        o = self.options
        logger.info(
            "queue: at most %d batches and %s of features in flight (%s)",
            o.capacity,
            "no byte bound" if o.max_bytes is None else format_bytes(o.max_bytes),
            "one shared queue" if o.mode == "shared" else f"{len(self.queues)} per-drafter queues",
        )
        for (role, i), ws in self.workers.items():
            main = self._target_main if role == "target" else self._drafter_main
            th = threading.Thread(target=main, args=(i,), name=ws.name, daemon=True)
            self._thread_workers[th] = ws
            self.threads.append(th)
        for th in self.threads:
            th.start()
        try:
            while not self._done.wait(self.options.poll):
                if self._stop_requested and not self._draining.is_set():
                    logger.warning("stop requested: finishing the steps in flight")
                    self._draining.set()
                    self.coord.drain()
        finally:
            self._stop.set()
            self._draining.set()
            self.coord.drain()
            hung = self._join()
            # what the targets made ahead was never trained on (the data position counts taken items only):
            # freed now, not when the Pipeline is collected
            left = sum(q.discard() for q in self.queues)
            if left:
                logger.debug("queue: %d item%s made ahead and not trained on, freed", left, "" if left == 1 else "s")
            pinned = pinned_host_bytes(peak=True)
            logger.info(
                "queue: peak %s of features held (queued or in a drafter step)%s",
                format_bytes(sum(q.peak_bytes for q in self.queues)),
                f"; pinned host memory peak {format_bytes(pinned)} (torch's caching host allocator)" if pinned else "",
            )
        if self._fatal is not None:
            raise self._fatal.exc
        if hung:
            raise PipelineError(
                f"threads still running {self.options.join_timeout:g}s (plus twice the longest step) after the stop: "
                f"{', '.join(hung)}",
                self.failures,
            )
        steps = self.coord.completed
        stopped = self._stop_requested
        if steps < self.options.max_steps and not stopped:
            raise PipelineError(self._why_short(), self.failures)
        alive = tuple(j for j in range(len(self.drafters)) if not self.workers[("drafter", j)].dead)
        if self.on_sync is not None and alive:
            self.on_sync(
                SyncEvent(
                    step=steps,
                    average=True,
                    checkpoint=True,
                    replicas=alive,
                    missing=(),
                    position=tuple(self.coord.position),
                    final=True,
                    # the last checkpoint is measured too, unless a stop cut the run short (it must exit soon)
                    evaluate=bool(self.options.evaluate_every) and steps >= self.options.max_steps,
                )
            )
        return RunResult(
            steps,
            "stopped" if stopped and steps < self.options.max_steps else "max-steps",
            tuple(self.failures),
            tuple(self.coord.position),
        )

    # threads ----------------------------------------------------------------------------

    def _sync_action(self, event: SyncEvent) -> None:
        # A failed averaging or checkpoint is the run's failure, not one drafter's.
        assert self.on_sync is not None
        try:
            self.on_sync(event)
        except BaseException as e:
            self._fatal_ids.add(id(e))
            raise

    def _target_main(self, i: int) -> None:
        ws = self.workers[("target", i)]
        work, source, q = self.targets[i], self.sources[i], self.queues[self.feeds[i]]
        local = 0
        # Host clock: produce() ends in the sync that makes its features safe to read (CUDA too), so
        # the time up to its return is the forward's; the put after it is the time blocked on a full queue.
        acct = self.options.accounting
        try:
            while not self._stop.is_set() and not self._draining.is_set():
                local += 1
                self._inject("target", i, local, work.device)
                if acct:
                    ws.enter("busy", time.monotonic())
                try:
                    batch = next(source)
                except StopIteration:  # a finite source (tests, the bench): this target is done
                    break
                # the bytes this item will hold, held BEFORE the forward allocates them (TargetReplica knows)
                estimate = getattr(work, "payload_bytes", None)
                reserved = int(estimate(batch)) if estimate is not None else None
                if reserved is not None:
                    if acct:
                        ws.enter("wait", time.monotonic())
                    if not self._reserve(q, reserved):
                        break
                    if acct:
                        ws.enter("busy", time.monotonic())
                try:
                    payload = work.produce(batch)
                except BaseException:
                    if reserved is not None:
                        q.unreserve(reserved)
                    raise
                nbytes = payload_bytes(payload)
                if reserved is not None and nbytes != reserved:
                    q.adjust(nbytes - reserved)  # count what it really holds
                if acct:
                    ws.enter("wait", time.monotonic())
                item = Item(payload, int(batch.n_tokens), int(batch.index), i, i, nbytes)
                ok = self._put(q, item, reserved=reserved is not None)
                if not ok:
                    if reserved is not None:
                        q.unreserve(nbytes)
                    break
                ws.items += 1
        except BaseException as e:
            self._fail("target", i, local, e)
        finally:
            if acct:
                ws.enter("", time.monotonic())
            self._retire("target", i)

    def _drafter_main(self, j: int) -> None:
        ws = self.workers[("drafter", j)]
        work, k = self.drafters[j], self.takes[j]
        acct = self.options.accounting
        timer = self._timers.get(j)  # CUDA: busy time from events (see _DeviceTimer), not the host clock
        step: int | None = None
        q = self.queues[k]
        items: list[Item] = []
        try:
            while True:
                step = self.coord.next_step(j, ws)
                if step is None:
                    break
                if acct:
                    ws.enter("wait", time.monotonic())
                while len(items) < self.options.accumulate:
                    got = self._get(k)
                    if got is None:
                        break
                    self.coord.took(got)
                    items.append(got)
                got = None  # the items list holds them (released after the step)
                if acct:  # on CUDA the host's part of the step is "other": the events say how busy the GPU was
                    ws.enter("busy" if timer is None else "", time.monotonic())
                if not items:
                    self.coord.unclaim()
                    step = None
                    break
                start = timer.mark() if timer is not None else None
                payload = items[0].payload if self.options.accumulate == 1 else [it.payload for it in items]
                stats = self._train(j, work, payload, step)
                del payload
                if timer is not None and start is not None:
                    timer.done(start)
                if acct:
                    ws.enter("", time.monotonic())
                ws.items += len(items)
                tokens = sum(it.tokens for it in items)
                self._release(q, items)  # the step is launched: its features' memory is the allocator's again
                n = self.coord.complete()
                step = None
                if self.on_step is not None:
                    self.on_step(n, stats, tokens)
        except BaseException as e:
            if step is not None:
                self.coord.unclaim()
            self._release(q, items)
            self._fail("drafter", j, step, e)
        finally:
            if acct:
                ws.enter("", time.monotonic())
            self._retire("drafter", j)

    def _train(self, j: int, work: DrafterWork, payload: t.Any, step: int) -> StepStats:
        attempts = 2 if self.options.oom_retry else 1
        for attempt in range(attempts):
            try:
                self._inject("drafter", j, step, work.device)
                return work.step(payload, step=step, micro_batches=2 if attempt else 1)
            except torch.OutOfMemoryError as e:
                if attempt + 1 >= attempts or id(e) in self._fatal_ids:
                    raise
                # The traceback's frames hold the failed attempt's tensors: drop them before the retry.
                error = _drop_frames(e)
            # Outside the ``except``: the exception, and with it the failed attempt, is gone.
            logger.warning(
                "drafter-%d (%s): %s at step %d; retrying once with the batch halved", j, work.device, error, step
            )
            work.recover()
        raise AssertionError("unreachable")

    def _inject(self, role: Role, index: int, step: int, device: str) -> None:
        fault = self.injector.check(role, index, step) if self.injector is not None else None
        if fault is None:
            return
        if fault.kind == "hang":
            logger.warning("%s-%d (%s): injected hang at step %d", role, index, device, step)
            while not self._stop.is_set() and not self._draining.is_set() and not self._stop_requested:
                self._stop.wait(self.options.poll)
            return
        exc = (
            fault.exc(device)
            if fault.exc is not None
            else InjectedFault(f"injected failure: {role}-{index} at step {step}")
        )
        if fault.fatal:
            self._fatal_ids.add(id(exc))
        raise exc

    def _get(self, k: int) -> Item | None:
        q = self.queues[k]
        while not self._stop.is_set() and not self._draining.is_set():
            try:
                return q.get(timeout=self.options.poll)
            except queue.Empty:
                if not self._feeding(k):
                    return None  # drained, and nothing can refill it
        return None

    def _put(self, q: FeatureQueue, item: Item, *, reserved: bool = False) -> bool:
        while not self._stop.is_set() and not self._draining.is_set():
            try:
                q.put(item, timeout=self.options.poll, reserved=reserved)
                return True
            except queue.Full:
                continue
        return False

    def _reserve(self, q: FeatureQueue, nbytes: int) -> bool:
        while not self._stop.is_set() and not self._draining.is_set():
            try:
                q.reserve(nbytes, timeout=self.options.poll)
                return True
            except queue.Full:
                continue
        return False

    @staticmethod
    def _release(q: FeatureQueue, items: list[Item]) -> None:
        """Drop the drafter's references to its items, then free their bytes in the queue's count."""
        held = sum(it.nbytes for it in items)
        items.clear()
        q.release(held)

    def _feeding(self, k: int) -> bool:
        with self._lock:
            return any(self.workers[("target", i)].alive for i, f in enumerate(self.feeds) if f == k)

    # bookkeeping ------------------------------------------------------------------------

    def _fail(self, role: Role, index: int, step: int | None, exc: BaseException) -> None:
        ws = self.workers[(role, index)]
        # a diverged update (dflash.train.divergence.Diverged) is the run's end, not one worker's
        fatal = id(exc) in self._fatal_ids or isinstance(exc, (KeyboardInterrupt, SystemExit))
        fatal = fatal or getattr(exc, "fatal", False) is True
        failure = WorkerFailure(role, index, ws.device, step, exc, traceback.format_exc(), fatal)
        if not fatal:  # the run goes on: a kept traceback would pin the dead worker's tensors until the end
            _drop_frames(exc)
        with self._lock:
            self.failures.append(failure)
            ws.dead = True
            ws.error = failure.error_line
            left = sum(1 for w in self.workers.values() if w.role == role and w.alive and w is not ws)
        if fatal:
            if getattr(exc, "traceback", True) is False:  # its one line says it all (printed at exit)
                logger.error("%s", failure.summary())
            else:
                logger.error("%s\n%s", failure.summary(), failure.traceback.rstrip())
            if self._fatal is None:
                self._fatal = failure
            self._stop.set()
            self._draining.set()
            self.coord.drain()
        else:
            logger.error(
                "%s; %d %s%s left\n%s",
                failure.summary(),
                left,
                role,
                "" if left == 1 else "s",
                failure.traceback.rstrip(),
            )

    def _retire(self, role: Role, index: int) -> None:
        with self._lock:
            self.workers[(role, index)].alive = False
            drafters_left = any(w.alive for w in self.workers.values() if w.role == "drafter")
        if role == "drafter":
            self.coord.retire(index)
            if not drafters_left:
                self._done.set()

    def _join(self) -> list[str]:
        deadline = time.monotonic() + self.options.join_timeout + 2 * max(w.longest_s for w in self.workers.values())
        hung = []
        for th in self.threads:
            th.join(max(0.0, deadline - time.monotonic()))
            if th.is_alive():
                hung.append(f"{th.name} ({self._thread_workers[th].device})")
        if hung:
            logger.error("threads still running after the stop: %s", ", ".join(hung))
        return hung

    def _why_short(self) -> str:
        dead = [f for f in self.failures if not f.fatal]
        drafters = [f for f in dead if f.role == "drafter"]
        targets = [f for f in dead if f.role == "target"]
        step = self.coord.completed
        if drafters and all(self.workers[("drafter", j)].dead for j in range(len(self.drafters))):
            return f"no drafter left at step {step}: {'; '.join(f.summary() for f in drafters)}"
        if targets:
            return f"no target left to feed the drafters at step {step}: {'; '.join(f.summary() for f in targets)}"
        return f"the drafters stopped at step {step} of {self.options.max_steps}"


__all__ = [
    "DrafterWork",
    "InjectedFault",
    "Item",
    "Pipeline",
    "PipelineError",
    "PipelineOptions",
    "RunResult",
    "Snapshot",
    "Source",
    "StepStats",
    "SyncEvent",
    "TargetWork",
    "WorkerFailure",
    "WorkerState",
]
