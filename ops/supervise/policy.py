"""restart-on-crash's policy: a pure state machine over (Status, time) -> Decision. Backoff, the
crash-loop guard and every "never restart this" rule live here (no I/O, no clock of its own)."""

from __future__ import annotations

import dataclasses
import random
import typing as t

from ops import errors
from ops.diagnosis import bus_id, last_finite_checkpoint, no_devices_left
from ops.probe import Status
from ops.states import RECOVERY, Action, Cause, State
from ops.times import duration, parse_iso

# Actions a Decision can carry (short names for the policy's rules).
RESTART = Action.RESTART
STOP_THEN_RESTART = Action.STOP_THEN_RESTART
START_CONTAINER = Action.START_CONTAINER
WAIT = Action.WAIT
GIVE_UP = Action.GIVE_UP
DONE = Action.DONE

JITTER = 0.25  # a delay is stretched by up to 25%: supervisors of many runs do not act in lockstep
RECONNECT_FIRST = 1.0  # first reconnect delay (seconds), doubled per failure up to max(interval, RECONNECT_CAP)
RECONNECT_CAP = 60.0
ON_DIVERGED = ("give-up", "resume-from-last-finite")  # --on-diverged
ON_GPU_FAULT = ("give-up", "exclude")  # --on-gpu-fault


# --------------------------------------------------------------------------------------------
# Options


@dataclasses.dataclass(frozen=True)
class Options:
    """The command-line options of restart-on-crash (defaults: docs/design.md section 11)."""

    interval: float = 30.0
    backoff: float = 10.0
    max_backoff: float = 900.0
    min_uptime: float = 600.0
    max_restarts: int = 5
    window: float = 3600.0
    once: bool = False
    restart_stalled: bool = False
    start_container: bool = False
    retry_oom: bool = False
    on_diverged: str = "give-up"  # or "resume-from-last-finite": once, from the checkpoint before it diverged
    on_gpu_fault: str = "give-up"  # or "exclude": restart without the failed GPU (ops/supervise/exclusions.py)

    def __post_init__(self) -> None:
        for name in ("interval", "backoff", "max_backoff", "min_uptime", "window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or value < 0:
                raise errors.ConfigError(
                    f"--{name.replace('_', '-')}", f"expected a number of seconds >= 0, got {value!r}"
                )
        if self.interval <= 0:
            raise errors.ConfigError("--interval", f"must be more than 0 seconds, got {self.interval:g}")
        if self.window <= 0:
            raise errors.ConfigError("--window", f"must be more than 0 seconds, got {self.window:g}")
        if self.max_backoff < self.backoff:
            raise errors.ConfigError(
                "--max-backoff", f"must be >= --backoff ({self.backoff:g}), got {self.max_backoff:g}"
            )
        if self.on_diverged not in ON_DIVERGED:
            raise errors.ConfigError(
                "--on-diverged", f"expected one of {', '.join(ON_DIVERGED)}, got {self.on_diverged!r}"
            )
        if self.on_gpu_fault not in ON_GPU_FAULT:
            raise errors.ConfigError(
                "--on-gpu-fault", f"expected one of {', '.join(ON_GPU_FAULT)}, got {self.on_gpu_fault!r}"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise errors.ConfigError("--max-restarts", f"expected a whole number >= 0, got {self.max_restarts!r}")


def _when(delay: float, opts: Options) -> str:
    return ("now (--once)" if opts.once else "now") if delay <= 0 else f"in {duration(delay)}"


def backoff_delay(streak: int, backoff: float, max_backoff: float, rng: random.Random) -> float:
    """The wait before recovery number ``streak`` (0-based) since the last reset: ``backoff * 2**streak``
    stretched by a random 0..25%, never below ``backoff`` nor above ``max_backoff``."""
    base = backoff * (2.0 ** min(streak, 60))
    return min(max_backoff, max(backoff, base * (1.0 + JITTER * rng.random())))


def reconnect_delay(failures: int, interval: float, rng: random.Random) -> float:
    """The wait before reconnect try ``failures`` (1-based) of an outage: from ``min(interval, 1s)``,
    doubling, up to ``max(interval, 60s)``; "equal jitter" (half fixed, half random) so it never
    hammers the host and many supervisors spread out."""
    first = min(interval, RECONNECT_FIRST)
    cap = max(interval, RECONNECT_CAP)
    d = min(cap, first * (2.0 ** min(max(failures - 1, 0), 60)))
    return d / 2 + rng.random() * d / 2


# --------------------------------------------------------------------------------------------
# The policy: pure


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one Status.

    ``delay``: seconds until a recovery action is due (0: now). ``new``: this Status starts a new
    incident (announce it; write it down). ``cancelled``: a planned recovery that no longer applies,
    and why. ``recovered_after``: the outage that just ended lasted this long."""

    action: Action
    reason: str
    delay: float = 0.0
    new: bool = False
    cancelled: str | None = None
    recovered_after: float | None = None
    note: str | None = None
    kind: str | None = None  # a GIVE_UP's kind: "diverged", "gpu-fault" (their own exit codes), else a crash loop


@dataclasses.dataclass
class Pending:
    """A recovery decided but not done yet (waiting out its backoff, or a try that failed)."""

    key: tuple[t.Any, ...]
    action: Action
    due: float
    reason: str
    error: str | None = None  # why the last try failed


def describe(st: Status) -> str:
    """One phrase for the failure, for messages: `CUDA out of memory on GPU 5 (attempt 3)`."""
    head = st.headline()
    return head if st.attempt is None or f"attempt {st.attempt}" in head else f"{head} (attempt {st.attempt})"


class Policy:
    """The restart policy as a state machine over (Status, time). No I/O, no clock of its own.

    ``observe(status, now)`` returns the Decision; after the loop carried out a recovery it calls
    ``recovered(now, action, attempt=, ok=)``. ``memory()``/``load()`` carry what must survive the
    supervisor itself (for ``--once`` from cron and supervisors restarted by systemd).
    """

    def __init__(self, opts: Options, *, rng: random.Random | None = None, keep_watching: bool = False) -> None:
        self.opts = opts
        self.rng = rng or random.Random()
        # A supervisor that never ends (installed on the host, restarted by systemd): after a give-up it
        # watches the crashed attempt without acting, until a run started by hand.
        self.keep_watching = keep_watching
        self.gave_up: int | None = None  # the attempt the last give-up was about (memory)
        # crash-loop memory
        self.restarts: list[float] = []  # when recoveries of the run happened (window guard)
        self.streak = 0  # recoveries since a run last survived min_uptime (the backoff exponent)
        self.last_fingerprint: str | None = None  # the previous EARLY failure's fingerprint ("twice in a row")
        self.last_failure_attempt: int | None = None  # the attempt that failure belongs to
        self.last_started: int | None = None  # the attempt this supervisor (or its predecessor) started last
        self.resumed_diverged: int | None = None  # the diverged attempt --on-diverged resumed (once per run)
        self.spike_told: tuple[int, int] | None = None  # (attempt, step) of the last loss spike told
        # the GPUs the run leaves out: {bus id: the attempt whose fault excluded it (None: not a fault's)};
        # the loop sets it from the session's file (ops/supervise/exclusions.py) before each observe
        self.excluded: dict[str, int | None] = {}
        # this process only
        self.container_failures = 0
        self.pending: Pending | None = None
        self.seen: tuple[t.Any, ...] | None = None  # (state, cause, attempt) last announced
        self.max_attempt: int | None = None
        self.alive: dict[int, list[float]] = {}  # attempt -> [first, last] time seen alive
        self.outage_since: float | None = None
        self.decided: set[tuple[t.Any, ...]] = set()  # failures already judged (fingerprint, guard)

    # ---------------------------------------------------------------- memory

    def memory(self) -> dict[str, t.Any]:
        # `seen`: so a --once from cron does not announce the same stopped/OOM run every few minutes
        return {
            "restarts": list(self.restarts),
            "streak": self.streak,
            "last_fingerprint": self.last_fingerprint,
            "last_failure_attempt": self.last_failure_attempt,
            "last_started": self.last_started,
            "seen": list(self.seen) if self.seen else None,
            "gave_up": self.gave_up,
            "resumed_diverged": self.resumed_diverged,
            "spike_told": list(self.spike_told) if self.spike_told else None,
        }

    def load(self, mem: t.Mapping[str, t.Any]) -> None:
        """Take a saved memory; a damaged one is ignored field by field (a fresh start is safe)."""
        restarts = mem.get("restarts")
        if isinstance(restarts, list):
            self.restarts = [float(x) for x in restarts if isinstance(x, (int, float))]
        if isinstance(mem.get("streak"), int) and mem["streak"] >= 0:
            self.streak = mem["streak"]
        if isinstance(mem.get("last_fingerprint"), str):
            self.last_fingerprint = mem["last_fingerprint"]
        if isinstance(mem.get("last_failure_attempt"), int):
            self.last_failure_attempt = mem["last_failure_attempt"]
        if isinstance(mem.get("last_started"), int):
            self.last_started = mem["last_started"]
        if isinstance(mem.get("gave_up"), int):
            self.gave_up = mem["gave_up"]
        if isinstance(mem.get("resumed_diverged"), int):
            self.resumed_diverged = mem["resumed_diverged"]
        told = mem.get("spike_told")
        if isinstance(told, list) and len(told) == 2 and all(isinstance(x, int) for x in told):
            self.spike_told = (told[0], told[1])
        seen = mem.get("seen")
        if isinstance(seen, list) and len(seen) == 3 and all(x is None or isinstance(x, (str, int)) for x in seen):
            self.seen = tuple(seen)

    def reset(self) -> None:
        self.gave_up = None
        self.resumed_diverged = None
        self.restarts.clear()
        self.streak = 0
        self.last_fingerprint = None
        self.last_failure_attempt = None

    def spike_news(self, attempt: int | None, step: int) -> bool:
        """A loss spike of the log not told yet (a --once from cron sees the same tail again): True once."""
        key = (attempt if attempt is not None else -1, step)
        if self.spike_told is not None and key <= self.spike_told:
            return False
        self.spike_told = key
        return True

    def restarts_in_window(self, now: float) -> int:
        self.restarts = [x for x in self.restarts if x > now - self.opts.window]
        return len(self.restarts)

    # ---------------------------------------------------------------- observe

    def observe(self, st: Status, now: float) -> Decision:
        if st.state == State.UNREACHABLE:
            first = self.outage_since is None
            if first:
                self.outage_since = now
            # Nothing about the run is known: the pending recovery (if any) waits for a real probe.
            return Decision(
                WAIT,
                f"unreachable ({st.cause}): not a crash; blind (nothing of the run can be seen) until a probe answers: "
                "reconnecting with backoff and re-probing before any restart",
                new=first,
            )
        recovered = None
        if self.outage_since is not None:
            recovered, self.outage_since = now - self.outage_since, None

        note = self._track_attempt(st)
        cancelled = self._cancel_stale(st)
        d = self._decide(st, now)
        if d.action == GIVE_UP:
            self.gave_up = st.attempt
        key = (st.state, st.cause, st.attempt)
        new = d.new or (key != self.seen and d.action in (WAIT, DONE, GIVE_UP))
        if d.action not in RECOVERY or d.new:
            self.seen = key
        return dataclasses.replace(d, new=new, cancelled=cancelled, recovered_after=recovered, note=note)

    def _track_attempt(self, st: Status) -> str | None:
        """An attempt newer than any we know, that we did not start: a human started it. Their
        judgement replaces our crash-loop memory."""
        if st.attempt is None:
            return None
        known = max((x for x in (self.max_attempt, self.last_started) if x is not None), default=None)
        if known is not None and st.attempt < known:
            # Attempt numbers went back: the run dir was cleared or moved, this is a new run history.
            had = bool(self.restarts or self.streak or self.last_fingerprint)
            self.reset()
            self.max_attempt, self.last_started, self.alive = st.attempt, None, {}
            return (
                f"attempt {st.attempt} is a new run (attempts went back from {known}): crash-loop memory reset"
                if had
                else None
            )
        self.max_attempt = st.attempt if self.max_attempt is None else max(self.max_attempt, st.attempt)
        if known is not None and st.attempt > known and st.attempt != self.last_started:
            had = bool(self.restarts or self.streak or self.last_fingerprint)
            self.reset()
            if had:
                return f"attempt {st.attempt} was started outside this supervisor: crash-loop memory reset"
        return None

    def _cancel_stale(self, st: Status) -> str | None:
        p = self.pending
        if p is None:
            return None
        if p.key[0] == "container":
            if st.state != State.CONTAINER_DOWN:
                self.pending = None
                return f"the container is back ({st.state}): {p.action} not needed"
            return None
        attempt = p.key[1]
        if st.attempt is not None and st.attempt != attempt and st.state != State.CONTAINER_DOWN:
            self.pending = None
            return f"attempt {st.attempt} appeared (started outside this supervisor): the {p.action} of attempt {attempt} is cancelled"
        if st.attempt == attempt and st.state in (State.RUNNING, State.SUCCEEDED, State.STOPPED):
            self.pending = None
            return f"attempt {attempt} is {st.state} now: the {p.action} is cancelled"
        return None

    def _decide(self, st: Status, now: float) -> Decision:
        o = self.opts
        s = st.state
        if s in (State.RUNNING, State.STALLED) and st.attempt is not None:
            span = self.alive.setdefault(st.attempt, [now, now])
            span[1] = now
            if span[1] - span[0] >= o.min_uptime:
                self.streak = 0  # it survived min_uptime: the next crash starts the backoff over
                self.container_failures = 0
        if s == State.RUNNING:
            return Decision(WAIT, "running")
        if s == State.STALLED:
            if not o.restart_stalled:
                return Decision(
                    WAIT, "stalled, and not restarted: pass --restart-stalled to stop and restart a hung run"
                )
            return self._failure(st, now, STOP_THEN_RESTART)
        if s == State.SUCCEEDED:
            return Decision(DONE, "the run succeeded: nothing left to supervise", new=True)
        if s == State.STOPPED:
            return Decision(
                WAIT,
                "stopped on purpose (dflashctl stop): not restarted; still watching, a new "
                "`dflashctl start` is supervised again",
            )
        if s == State.NOT_STARTED:
            return Decision(
                WAIT,
                "nothing runs under this session yet: waiting for `dflashctl start` "
                "(restart-on-crash only restarts runs that crashed)",
            )
        if s == State.CONTAINER_DOWN:
            if not o.start_container:
                return Decision(
                    WAIT,
                    f"the container is {st.cause}: not starting it (pass --start-container); "
                    "waiting for it to come back",
                )
            if st.cause == Cause.MISSING:
                return Decision(WAIT, "the container does not exist: nothing to start; waiting")
            return self._container(now)
        if s == State.CRASHED and st.cause == Cause.GPU_FAULT:
            return self._gpu_fault(st, now)
        if s in (State.CRASHED, State.LOST) and self.keep_watching and st.attempt is not None:
            if st.attempt == self.gave_up:
                return Decision(
                    WAIT,
                    f"gave up on attempt {st.attempt} (crash loop): not restarted; still watching, a new "
                    "`dflashctl start` is supervised afresh",
                )
        if s == State.CRASHED and no_devices_left(st.detail, st.exit_code):
            # the trainer's own verdict on DFLASH_EXCLUDED_GPUS: every restart would end the same way
            return Decision(
                GIVE_UP,
                f"no GPU left for the run without the excluded ones: {st.detail}; after a reset, "
                "`dflashctl gpus --include BUS` puts a GPU back, then `dflashctl start`",
                new=True,
                kind="gpu-fault",
            )
        if s == State.CRASHED:
            if st.cause == Cause.ORPHANS_LEFT:
                if st.stop_requested:
                    return Decision(
                        WAIT,
                        "not restarted: a stop was requested, but processes of the run live on; "
                        "`dflashctl stop` ends them",
                    )
                # Its keeper is gone, so nothing else will end them: stop them (TERM first, a trainer
                # checkpoints), then start. A plain start would refuse to run beside them.
                return self._failure(st, now, STOP_THEN_RESTART)
            if st.cause == Cause.DIVERGED:
                return self._diverged(st, now)
            if st.cause == Cause.CUDA_OOM and not o.retry_oom:
                return Decision(
                    WAIT,
                    "not restarted: a CUDA OOM usually happens again at the same step; lower the "
                    "memory use and start it, or pass --retry-oom",
                )
            return self._failure(st, now, RESTART)
        if s == State.LOST:
            return self._failure(st, now, RESTART)
        return Decision(WAIT, f"state {s}")

    def _gpu_fault(self, st: Status, now: float) -> Decision:
        """No restart into a GPU that failed in hardware: it fails again until it is reset (often the host
        rebooted). By default give up, saying which GPU and Xid; with --on-gpu-fault exclude, restart
        without it (the loop adds it to the excluded set before the start), once per GPU: a second fault on
        a GPU the run already left out means the set does not reach the run, or the fault is not that GPU's."""
        if self.keep_watching and st.attempt is not None and st.attempt == self.gave_up:
            return Decision(
                WAIT,
                f"gave up on attempt {st.attempt} (GPU fault): not restarted; still watching, a new "
                "`dflashctl start` is supervised afresh",
            )
        if self.opts.on_gpu_fault != "exclude":
            return Decision(
                GIVE_UP,
                f"not restarted into a failed GPU: {describe(st)}; reset the GPU or reboot the host (or pass "
                "--on-gpu-fault exclude to restart without it), then `dflashctl start`",
                new=True,
            )
        bus = bus_id(st.gpu_bus_id)
        if bus is None:
            return Decision(
                GIVE_UP,
                f"not restarted into a failed GPU: {describe(st)}; the driver named no PCI bus id, so no GPU can "
                "be left out (--on-gpu-fault exclude): reset the GPU or reboot the host, then `dflashctl start`",
                new=True,
            )
        if bus in self.excluded and self.excluded[bus] != st.attempt:
            return Decision(
                GIVE_UP,
                f"a second fault on GPU {bus}, which the run already leaves out (excluded after attempt "
                f"{self.excluded[bus]}): {describe(st)}; reset the GPU or reboot the host, then "
                f"`dflashctl gpus --include {bus}` and `dflashctl start`",
                new=True,
            )
        d = self._failure(st, now, RESTART)
        if d.action != RESTART or not d.new:
            return d  # a crash loop gives up (exit 13 all the same: the cause is the GPU's)
        return dataclasses.replace(d, reason=f"GPU {bus} excluded (--on-gpu-fault exclude); {d.reason}")

    def _diverged(self, st: Status, now: float) -> Decision:
        """A diverged run is not restarted blindly: the trainer resumes from its latest checkpoint, which is
        the last finite one (none is written after a non-finite update), and replays the same data from
        there. By default: give up; --on-diverged resume-from-last-finite: resume once per run."""
        what = st.detail or "a non-finite loss or gradient"
        last = last_finite_checkpoint(st.detail)
        where = last or "none: the run starts over from step 0"
        again = self.resumed_diverged is not None and self.resumed_diverged != st.attempt
        if self.opts.on_diverged == "resume-from-last-finite" and not again:
            self.resumed_diverged = st.attempt
            d = self._failure(st, now, RESTART)
            if d.action != RESTART:
                return dataclasses.replace(d, kind="diverged" if d.action == GIVE_UP else d.kind)
            return dataclasses.replace(
                d,
                reason=f"{d.reason}: resuming once from the last finite checkpoint ({where}) "
                "(--on-diverged resume-from-last-finite); the same data position replays, so the same "
                "batches come again",
            )
        if again:
            why = f"it diverged again after the one resume from the last finite checkpoint ({where}): {what}"
        else:
            why = (
                f"training diverged: {what}; not restarted: a restart resumes from the last finite checkpoint "
                f"({where}) and replays the same data: lower the learning rate or look at the data, then "
                "`dflashctl start`, or pass --on-diverged resume-from-last-finite to resume once"
            )
        return Decision(GIVE_UP, why, new=True, kind="diverged")

    def _uptime(self, st: Status, now: float) -> float | None:
        started, ended = parse_iso(st.started_at), parse_iso(st.ended_at)
        if started is not None and ended is not None:
            return max(0.0, ended - started)
        span = self.alive.get(st.attempt) if st.attempt is not None else None
        return span[1] - span[0] if span else None

    def _failure(self, st: Status, now: float, action: Action) -> Decision:
        o = self.opts
        key = ("attempt", st.attempt, st.state)
        what = describe(st)
        p = self.pending
        if p is not None and p.key == key:
            if p.error is not None and p.due <= now:
                n = self.restarts_in_window(now)
                if n >= o.max_restarts:
                    return Decision(
                        GIVE_UP,
                        f"crash loop: {n} restart tries within --window {duration(o.window)} "
                        f"(--max-restarts {o.max_restarts}), the last one failed ({p.error}); "
                        f"last failure: {what}",
                        new=True,
                    )
            return Decision(p.action, p.reason, delay=max(0.0, p.due - now))
        if key in self.decided:
            # judged before (a container outage came in between): plan it again, not a second crash
            delay = self._backoff(self.streak)
            verb = "stop and restart" if action == STOP_THEN_RESTART else "restart"
            self.pending = Pending(key, action, now + delay, f"{verb} {_when(delay, o)}")
            return Decision(action, self.pending.reason, delay=delay)
        self.decided.add(key)
        uptime = self._uptime(st, now)
        early = uptime is None or uptime < o.min_uptime
        if not early:
            self.streak = 0
        fp = st.fingerprint if st.state == State.CRASHED else None
        # Twice = two different attempts, each failing before --min-uptime (a supervisor restarted by
        # cron or systemd may judge the same crashed attempt again: that is not a second crash).
        if fp is not None and fp == self.last_fingerprint and early and st.attempt != self.last_failure_attempt:
            lived = f"after {duration(uptime)}" if uptime is not None else "early"
            return Decision(
                GIVE_UP,
                f"crash loop: the same failure twice in a row, the second {lived}, before "
                f"--min-uptime {duration(o.min_uptime)}: {what}",
                new=True,
            )
        n = self.restarts_in_window(now)
        if n >= o.max_restarts:
            return Decision(
                GIVE_UP,
                f"crash loop: {n} restarts within --window {duration(o.window)} (--max-restarts "
                f"{o.max_restarts}); last failure: {what}",
                new=True,
            )
        self.last_fingerprint, self.last_failure_attempt = (fp, st.attempt) if early else (None, None)
        delay = self._backoff(self.streak)
        verb = "stop and restart" if action == STOP_THEN_RESTART else "restart"
        reason = f"{verb} {_when(delay, o)} (restart {n + 1} of at most {o.max_restarts} within {duration(o.window)})"
        self.pending = Pending(key, action, now + delay, reason)
        return Decision(action, reason, delay=delay, new=True)

    def _container(self, now: float) -> Decision:
        o = self.opts
        p = self.pending
        if p is not None and p.key == ("container",):
            return Decision(p.action, p.reason, delay=max(0.0, p.due - now))
        delay = self._backoff(self.container_failures)
        reason = f"start the container {_when(delay, o)} (--start-container), then re-probe"
        self.pending = Pending(("container",), START_CONTAINER, now + delay, reason)
        return Decision(START_CONTAINER, reason, delay=delay, new=True)

    def _backoff(self, n: int) -> float:
        # --once acts at once: cron's or the timer's period is its backoff.
        return 0.0 if self.opts.once else backoff_delay(n, self.opts.backoff, self.opts.max_backoff, self.rng)

    # ---------------------------------------------------------------- outcomes

    def cancel(self) -> None:
        """Drop the planned recovery (the far side refused it: a live run appeared meanwhile)."""
        self.pending = None

    def recovered(
        self, now: float, action: Action, *, attempt: int | None = None, ok: bool = True, error: str | None = None
    ) -> float | None:
        """Record a recovery the loop carried out. A failed one stays pending with the next backoff
        (the same incident; the window guard ends a start that always fails); returns that delay."""
        if action == START_CONTAINER:
            if ok:
                self.pending = None
                return None
            self.container_failures += 1
            delay = self._backoff(self.container_failures)
        else:
            self.restarts.append(now)  # a failed start counts too
            self.streak += 1
            if ok:
                self.pending = None
                if attempt is not None:
                    self.last_started = attempt
                    self.max_attempt = attempt if self.max_attempt is None else max(self.max_attempt, attempt)
                return None
            delay = self._backoff(self.streak)
        if self.pending is not None:
            self.pending.due = now + delay
            self.pending.error = error or "failed"
        return delay
