"""restart-on-crash: watch one run and bring it back after a crash, without thrashing and never blind.

Two halves (DESIGN.md sections 8 and 11):

- ``Policy`` is a pure state machine: it takes a ``Status`` and the time and returns a ``Decision``
  (``restart``, ``stop-then-restart``, ``start-container``, ``wait``, ``give-up``, ``done``) with its
  reason. Backoff, the crash-loop guard and every "never restart this" rule live here, so they are
  tested from sequences of Status objects and a fake clock, without processes.
- ``Supervisor`` is the loop that executes decisions: it starts a probe every ``--interval`` over ONE
  kept connection, reconnects with jittered backoff when it drops, restarts through the start path of
  ``dflashctl start`` (``ops.session.start``: a new attempt dir, the old one's evidence kept), writes
  one JSON file per incident and hands it to ``--on-event``.

Decisions a user can count on:
- An outage (``unreachable``) is never a crash: the loop reconnects, re-probes, and only a fresh probe
  can lead to a restart. A backoff longer than the interval is watched (probed every interval), so a
  run started by hand meanwhile cancels the restart; a crashed or lost run is restarted WITHOUT
  ``--replace``, so the agent refuses if any run came alive since the probe. Only a stalled run is
  replaced (stopped: C-c, TERM, KILL), after a re-probe that still says stalled.
- ``stopped`` (a ``dflashctl stop`` during supervision) is reported once and never restarted; the
  supervisor keeps watching, so a later ``dflashctl start`` is supervised again without restarting it.
- A run started by hand (an attempt this supervisor did not start) resets the crash-loop memory.
- The memory (restart times, backoff streak, last fingerprint) is kept in the state dir, so a
  supervisor run from cron with ``--once`` or restarted by systemd still sees a crash loop.
"""

from __future__ import annotations

import calendar
import dataclasses
import errno
import fcntl
import json
import logging
import os
import random
import re
import shlex
import signal
import sys
import threading
import time
import typing as t
from pathlib import Path

from ops import errors
from ops.hosts import Host
from ops.probe import Status, iso
from ops.runner import write_json_atomic

if t.TYPE_CHECKING:
    from ops.remote import Remote

logger = logging.getLogger(__name__)

# Actions a Decision can carry.
RESTART = "restart"
STOP_THEN_RESTART = "stop-then-restart"
START_CONTAINER = "start-container"
WAIT = "wait"
GIVE_UP = "give-up"
DONE = "done"
RECOVERY = (RESTART, STOP_THEN_RESTART, START_CONTAINER)

HOOK_TIMEOUT = 60.0
STACK_TIMEOUT = 30.0
JITTER = 0.25  # a delay is stretched by up to 25%: supervisors of many runs do not act in lockstep
RECONNECT_FIRST = 1.0  # first reconnect delay (seconds), doubled per failure up to max(interval, RECONNECT_CAP)
RECONNECT_CAP = 60.0
STACK_FILE = "py-spy-dump.txt"


# --------------------------------------------------------------------------------------------
# Options


@dataclasses.dataclass(frozen=True)
class Options:
    """The command-line options of restart-on-crash (defaults: DESIGN.md section 11)."""

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

    def __post_init__(self) -> None:
        for name in ("interval", "backoff", "max_backoff", "min_uptime", "window"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value != value or value < 0:
                raise errors.ConfigError(f"--{name.replace('_', '-')}", f"expected a number of seconds >= 0, got {value!r}")
        if self.interval <= 0:
            raise errors.ConfigError("--interval", f"must be more than 0 seconds, got {self.interval:g}")
        if self.window <= 0:
            raise errors.ConfigError("--window", f"must be more than 0 seconds, got {self.window:g}")
        if self.max_backoff < self.backoff:
            raise errors.ConfigError("--max-backoff", f"must be >= --backoff ({self.backoff:g}), got {self.max_backoff:g}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise errors.ConfigError("--max-restarts", f"expected a whole number >= 0, got {self.max_restarts!r}")


def _when(delay: float, opts: Options) -> str:
    return ("now (--once)" if opts.once else "now") if delay <= 0 else f"in {_dur(delay)}"


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


def parse_iso(text: str | None) -> float | None:
    """``2026-11-29T15:02:11Z`` -> epoch seconds (None when absent or unreadable)."""
    if not text:
        return None
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))
    except (TypeError, ValueError):
        return None


def _dur(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


# --------------------------------------------------------------------------------------------
# The policy: pure


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one Status.

    ``delay``: seconds until a recovery action is due (0: now). ``new``: this Status starts a new
    incident (announce it; write it down). ``cancelled``: a planned recovery that no longer applies,
    and why. ``recovered_after``: the outage that just ended lasted this long."""

    action: str
    reason: str
    delay: float = 0.0
    new: bool = False
    cancelled: str | None = None
    recovered_after: float | None = None
    note: str | None = None


@dataclasses.dataclass
class Pending:
    """A recovery decided but not done yet (waiting out its backoff, or a try that failed)."""

    key: tuple[t.Any, ...]
    action: str
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

    def __init__(self, opts: Options, *, rng: random.Random | None = None) -> None:
        self.opts = opts
        self.rng = rng or random.Random()
        # crash-loop memory
        self.restarts: list[float] = []  # when recoveries of the run happened (window guard)
        self.streak = 0  # recoveries since a run last survived min_uptime (the backoff exponent)
        self.last_fingerprint: str | None = None  # the previous EARLY failure's fingerprint ("twice in a row")
        self.last_failure_attempt: int | None = None  # the attempt that failure belongs to
        self.last_started: int | None = None  # the attempt this supervisor (or its predecessor) started last
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
        return {"restarts": list(self.restarts), "streak": self.streak, "last_fingerprint": self.last_fingerprint,
                "last_failure_attempt": self.last_failure_attempt, "last_started": self.last_started, "seen": list(self.seen) if self.seen else None}

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
        seen = mem.get("seen")
        if isinstance(seen, list) and len(seen) == 3 and all(x is None or isinstance(x, (str, int)) for x in seen):
            self.seen = tuple(seen)

    def reset(self) -> None:
        self.restarts.clear()
        self.streak = 0
        self.last_fingerprint = None
        self.last_failure_attempt = None

    def restarts_in_window(self, now: float) -> int:
        self.restarts = [x for x in self.restarts if x > now - self.opts.window]
        return len(self.restarts)

    # ---------------------------------------------------------------- observe

    def observe(self, st: Status, now: float) -> Decision:
        o = self.opts
        if st.state == "unreachable":
            first = self.outage_since is None
            if first:
                self.outage_since = now
            # Nothing about the run is known: the pending recovery (if any) waits for a real probe.
            return Decision(WAIT, f"unreachable ({st.cause}): not a crash; reconnecting with backoff and re-probing "
                            "before any restart", new=first)
        recovered = None
        if self.outage_since is not None:
            recovered, self.outage_since = now - self.outage_since, None

        note = self._track_attempt(st)
        cancelled = self._cancel_stale(st)
        d = self._decide(st, now)
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
            return f"attempt {st.attempt} is a new run (attempts went back from {known}): crash-loop memory reset" if had else None
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
            if st.state != "container-down":
                self.pending = None
                return f"the container is back ({st.state}): {p.action} not needed"
            return None
        attempt = p.key[1]
        if st.attempt is not None and st.attempt != attempt and st.state != "container-down":
            self.pending = None
            return f"attempt {st.attempt} appeared (started outside this supervisor): the {p.action} of attempt {attempt} is cancelled"
        if st.attempt == attempt and st.state in ("running", "succeeded", "stopped"):
            self.pending = None
            return f"attempt {attempt} is {st.state} now: the {p.action} is cancelled"
        return None

    def _decide(self, st: Status, now: float) -> Decision:
        o = self.opts
        s = st.state
        if s in ("running", "stalled") and st.attempt is not None:
            span = self.alive.setdefault(st.attempt, [now, now])
            span[1] = now
            if span[1] - span[0] >= o.min_uptime:
                self.streak = 0  # it survived min_uptime: the next crash starts the backoff over
                self.container_failures = 0
        if s == "running":
            return Decision(WAIT, "running")
        if s == "stalled":
            if not o.restart_stalled:
                return Decision(WAIT, "stalled, and not restarted: pass --restart-stalled to stop and restart a hung run")
            return self._failure(st, now, STOP_THEN_RESTART)
        if s == "succeeded":
            return Decision(DONE, "the run succeeded: nothing left to supervise", new=True)
        if s == "stopped":
            return Decision(WAIT, "stopped on purpose (dflashctl stop): not restarted; still watching, a new "
                            "`dflashctl start` is supervised again")
        if s == "not-started":
            return Decision(WAIT, "nothing runs under this session yet: waiting for `dflashctl start` "
                            "(restart-on-crash only restarts runs that crashed)")
        if s == "container-down":
            if not o.start_container:
                return Decision(WAIT, f"the container is {st.cause}: not starting it (pass --start-container); "
                                "waiting for it to come back")
            if st.cause == "missing":
                return Decision(WAIT, "the container does not exist: nothing to start; waiting")
            return self._container(now)
        if s == "crashed":
            if st.cause == "cuda-oom" and not o.retry_oom:
                return Decision(WAIT, "not restarted: a CUDA OOM usually happens again at the same step; lower the "
                                "memory use and start it, or pass --retry-oom")
            return self._failure(st, now, RESTART)
        if s == "lost":
            return self._failure(st, now, RESTART)
        return Decision(WAIT, f"state {s}")

    def _uptime(self, st: Status, now: float) -> float | None:
        started, ended = parse_iso(st.started_at), parse_iso(st.ended_at)
        if started is not None and ended is not None:
            return max(0.0, ended - started)
        span = self.alive.get(st.attempt) if st.attempt is not None else None
        return span[1] - span[0] if span else None

    def _failure(self, st: Status, now: float, action: str) -> Decision:
        o = self.opts
        key = ("attempt", st.attempt, st.state)
        what = describe(st)
        p = self.pending
        if p is not None and p.key == key:
            if p.error is not None and p.due <= now:
                n = self.restarts_in_window(now)
                if n >= o.max_restarts:
                    return Decision(GIVE_UP, f"crash loop: {n} restart tries within --window {_dur(o.window)} "
                                    f"(--max-restarts {o.max_restarts}), the last one failed ({p.error}); "
                                    f"last failure: {what}", new=True)
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
        fp = st.fingerprint if st.state == "crashed" else None
        # Twice = two different attempts, each failing before --min-uptime (a supervisor restarted by
        # cron or systemd may judge the same crashed attempt again: that is not a second crash).
        if fp is not None and fp == self.last_fingerprint and early and st.attempt != self.last_failure_attempt:
            lived = f"after {_dur(uptime)}" if uptime is not None else "early"
            return Decision(GIVE_UP, f"crash loop: the same failure twice in a row, the second {lived}, before "
                            f"--min-uptime {_dur(o.min_uptime)}: {what}", new=True)
        n = self.restarts_in_window(now)
        if n >= o.max_restarts:
            return Decision(GIVE_UP, f"crash loop: {n} restarts within --window {_dur(o.window)} (--max-restarts "
                            f"{o.max_restarts}); last failure: {what}", new=True)
        self.last_fingerprint, self.last_failure_attempt = (fp, st.attempt) if early else (None, None)
        delay = self._backoff(self.streak)
        verb = "stop and restart" if action == STOP_THEN_RESTART else "restart"
        reason = f"{verb} {_when(delay, o)} (restart {n + 1} of at most {o.max_restarts} within {_dur(o.window)})"
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

    def recovered(self, now: float, action: str, *, attempt: int | None = None, ok: bool = True,
                  error: str | None = None) -> float | None:
        """Record a recovery the loop carried out. A failed one stays pending with the next backoff
        (the same incident; the window guard ends a start that always fails); returns that delay."""
        o = self.opts
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


# --------------------------------------------------------------------------------------------
# The state dir: incidents, memory, lock


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/dflashctl``, else ``~/.local/state/dflashctl``."""
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "dflashctl"
    return Path.home() / ".local" / "state" / "dflashctl"


def private_dir(path: Path) -> Path:
    """``path`` as a folder only we can read (0700): incidents hold log tails, the lock the
    --on-event command line. An existing folder of ours that is open to others is closed."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


class Lock:
    """One supervisor per host+session: an flock'ed file holding the owner's pid. The kernel drops
    the lock when the owner dies, so a stale file never blocks."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self.fd: int | None = None

    def acquire(self) -> Lock:
        private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
            holder = self._holder(fd)
            os.close(fd)
            raise errors.SupervisorLocked(
                f"restart-on-crash is already watching {self.what}: pid {holder.get('pid', '?')}"
                f"{' since ' + holder['since'] if holder.get('since') else ''} holds {self.path}; "
                "stop that one first (Ctrl-C or kill <pid>)") from None
        info = {"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
        os.fchmod(fd, 0o600)  # a lock file left by an older dflashctl was 0644
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd = fd
        return self

    @staticmethod
    def _holder(fd: int) -> dict[str, t.Any]:
        try:
            data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class IncidentLog:
    """One JSON file per incident under ``<state dir>/incidents/``; an incident that goes on (a
    restart after its backoff) is rewritten in place, atomically."""

    def __init__(self, state_dir: Path, host: str, session: str) -> None:
        self.dir = state_dir / "incidents"
        self.host, self.session = host, session
        self.count = 0

    def path_for(self, incident: dict[str, t.Any], now: float) -> Path:
        self.count += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
        att = f"attempt{incident['attempt']}" if incident.get("attempt") is not None else "noattempt"
        name = f"{stamp}-{_slug(self.host)}-{_slug(self.session)}-{att}-{incident['state']}-{os.getpid()}-{self.count}.json"
        return self.dir / name

    def write(self, path: Path, incident: dict[str, t.Any]) -> None:
        private_dir(self.dir)
        write_json_atomic(path, incident, mode=0o600)


def incident_for(st: Status, d: Decision, now: float, *, restarts: int, opts: Options) -> dict[str, t.Any]:
    """The facts of one incident (the keys are stable: hooks read them)."""
    return {
        "time": iso(now),
        "host": st.host,
        "session": st.session,
        "attempt": st.attempt,
        "state": st.state,
        "cause": st.cause,
        "detail": st.detail,
        "exit_code": st.exit_code,
        "signal": st.signal,
        "gpu": st.gpu,
        "fingerprint": st.fingerprint,
        "started_at": st.started_at,
        "ended_at": st.ended_at,
        "progress": dataclasses.asdict(st.progress) if st.progress else None,
        "evidence": list(st.evidence),
        "log": st.log,
        "log_tail": list(st.tail),
        "action": d.action,
        "reason": d.reason,
        "delay": round(d.delay, 3),
        "outcome": "pending" if d.action in RECOVERY else "noted",
        "next_attempt": None,
        "done_at": None,
        "error": None,
        "restarts_in_window": restarts,
        "options": dataclasses.asdict(opts),
        "supervisor_pid": os.getpid(),
        "hook": None,
    }


def run_hook(argv: t.Sequence[str], incident: dict[str, t.Any], path: Path | None,
             hide_env: t.Sequence[str] = ()) -> dict[str, t.Any]:
    """``--on-event``: the incident as JSON on stdin, its gist in DFLASHCTL_* variables, without the
    secret variables named in ``hide_env`` (the inventory's API tokens). Through LocalTransport
    (its own session: a Ctrl-C meant for us does not reach it); never raises."""
    from ops.transport import LocalTransport

    env = {
        "DFLASHCTL_STATE": incident.get("state") or "",
        "DFLASHCTL_CAUSE": incident.get("cause") or "",
        "DFLASHCTL_HOST": incident.get("host") or "",
        "DFLASHCTL_SESSION": incident.get("session") or "",
        "DFLASHCTL_ACTION": incident.get("action") or "",
        "DFLASHCTL_ATTEMPT": "" if incident.get("attempt") is None else str(incident["attempt"]),
        "DFLASHCTL_INCIDENT": str(path) if path else "",
    }
    # `env NAME=VALUE... cmd`: the variables travel as argv items, no shell, nothing to quote.
    unset = [a for name in hide_env for a in ("-u", name)]
    full = ["env", *unset, "--", *(f"{k}={v}" for k, v in env.items()), *argv]
    try:
        res = LocalTransport().run(full, stdin=json.dumps(incident).encode(), timeout=HOOK_TIMEOUT)
    except OSError as e:
        return {"ok": False, "exit_code": None, "error": f"cannot run {shlex.join(argv)}: {e}"}
    if res.timed_out:
        return {"ok": False, "exit_code": None, "error": f"{shlex.join(argv)}: no exit within {HOOK_TIMEOUT:g}s (killed)"}
    if res.exit_code != 0:
        last = (res.err.strip().splitlines() or res.out.strip().splitlines() or [""])[-1]
        how = f"signal {res.signal}" if res.exit_code is None else f"exit {res.exit_code}"
        return {"ok": False, "exit_code": res.exit_code, "error": f"{shlex.join(argv)}: {how}" + (f": {last}" if last else "")}
    return {"ok": True, "exit_code": 0, "error": None}


def parse_hook(cmd: str | None) -> list[str] | None:
    if cmd is None:
        return None
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        raise errors.ConfigError("--on-event", f"cannot split {cmd!r} like a shell would: {e}") from None
    if not argv:
        raise errors.ConfigError("--on-event", "empty command")
    return argv


# --------------------------------------------------------------------------------------------
# A stack of the hung process, before it is stopped


def save_stack(remote: Remote, st: Status) -> dict[str, t.Any]:
    """``py-spy dump`` of the hung command (where the run lives), saved as ``py-spy-dump.txt`` in its
    attempt dir. py-spy is looked for on PATH, then next to the configured python (a venv's bin).
    Never raises: a missing py-spy is a note in the incident."""
    if st.pid is None:
        return {"saved": None, "error": "no pid to dump"}
    python = remote.host.python
    candidates = ["py-spy"]
    if "/" in python:
        candidates.append(os.path.join(os.path.dirname(python), "py-spy"))
    tried = []
    for exe in candidates:
        try:
            res = remote.run([exe, "dump", "--pid", str(st.pid)], timeout=STACK_TIMEOUT)
        except errors.OpsError as e:
            return {"saved": None, "error": f"py-spy: {e}"}
        if res.exit_code == 127 or "Failed to exec" in res.err or "No such file" in res.err and not res.out:
            tried.append(exe)
            continue
        if not res.ok or not res.out.strip():
            return {"saved": None, "tool": exe, "error": f"py-spy dump failed (exit {res.exit_code}): {res.err.strip()[-300:]}"}
        text = res.out
        saved = None
        if st.log:
            target = os.path.join(os.path.dirname(st.log), STACK_FILE)
            try:
                w = remote.run(["tee", target], stdin=text.encode(), timeout=STACK_TIMEOUT)
                saved = target if w.ok else None
            except errors.OpsError:
                saved = None
        return {"saved": saved, "tool": exe, "stack": text[-20000:], "error": None if saved else "could not write the dump"}
    return {"saved": None, "error": f"py-spy is not installed where the run lives (tried {', '.join(tried)}): no stack saved"}


# --------------------------------------------------------------------------------------------
# The loop


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How the supervisor ended: ``succeeded``, ``interrupted`` (a signal) or ``once`` (with the
    state it left the run in, ``restarted`` when it started a new attempt)."""

    kind: str
    state: str | None = None
    message: str = ""


class Supervisor:
    """The restart-on-crash loop for one host+session."""

    def __init__(
        self,
        host: Host,
        session: str | None,
        opts: Options,
        *,
        state_dir: Path | None = None,
        on_event: t.Sequence[str] | None = None,
        emit: t.Callable[[str], None] = print,
        connect: t.Callable[[Host], Remote] | None = None,
        clock: t.Callable[[], float] = time.time,
        rng: random.Random | None = None,
        hide_env: t.Sequence[str] = (),
    ) -> None:
        from ops import session as run

        self.host = host
        self.session = run.session_name(host, session)
        self.opts = opts
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.on_event = list(on_event) if on_event else None
        # Secrets the hook must not inherit: this host's API token variable, and any the caller names.
        self.hide_env = tuple(dict.fromkeys([*host.secret_env, *hide_env]))
        self._emit = emit
        if connect is None:
            from ops.remote import connect as connect_remote

            connect = connect_remote
        self._connect_fn = connect
        self.clock = clock
        self.rng = rng or random.Random()
        self.policy = Policy(opts, rng=self.rng)
        self.incidents = IncidentLog(self.state_dir, host.name, self.session)
        base = f"{_slug(host.name)}.{_slug(self.session)}"
        self.lock = Lock(self.state_dir / "supervise" / f"{base}.lock", f"{host.name}/{self.session}")
        self.memory_path = self.state_dir / "supervise" / f"{base}.json"
        self._remote: Remote | None = None
        self._stop = threading.Event()
        self._signal: str | None = None
        self._open: tuple[Path, dict[str, t.Any]] | None = None  # the incident whose recovery is pending
        self._outage: tuple[Path, dict[str, t.Any]] | None = None

    # ---------------------------------------------------------------- plumbing

    def emit(self, text: str) -> None:
        self._emit(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.host.name}/{self.session}: {text}")

    def _connect(self) -> Remote:
        if self._remote is None:
            self._remote = self._connect_fn(self.host)
        return self._remote

    def _drop(self) -> None:
        if self._remote is not None:
            try:
                self._remote.close()
            except Exception:  # closing a broken connection must not end supervision
                logger.debug("closing the connection failed", exc_info=True)
            self._remote = None

    def probe(self) -> Status:
        from ops import session as run

        try:
            st = run.status(self.host, self.session, self._connect)
        except Exception as e:  # a bug or an untyped library error must not end an overnight watch
            logger.exception("probe failed")
            self._drop()
            st = Status(host=self.host.name, session=self.session, state="unreachable", cause="unknown",
                        detail=f"the probe failed: {type(e).__name__}: {e}", checked_at=iso(self.clock()),
                        evidence=[f"probe error: {type(e).__name__}: {e}"])
        logger.info("probe %s/%s: %s", self.host.name, self.session, st.headline())
        return st

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            self._stop.wait(seconds)

    def _on_signal(self, signum: int, _frame: t.Any) -> None:
        self._signal = signal.Signals(signum).name
        self._stop.set()

    def _load_memory(self) -> None:
        try:
            data = json.loads(self.memory_path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            self.emit(f"note: ignoring an unreadable supervisor memory {self.memory_path}: {e}")
            return
        if isinstance(data, dict):
            self.policy.load(data)

    def _save_memory(self) -> None:
        try:
            private_dir(self.memory_path.parent)
            write_json_atomic(self.memory_path, {**self.policy.memory(), "host": self.host.name, "session": self.session,
                                                  "updated_at": iso(self.clock())}, mode=0o600)
        except OSError as e:
            self.emit(f"warning: cannot save the supervisor memory {self.memory_path}: {e}")

    def _record(self, path: Path, incident: dict[str, t.Any]) -> None:
        try:
            self.incidents.write(path, incident)
        except OSError as e:
            self.emit(f"warning: cannot write the incident {path}: {e}")

    def _announce(self, path: Path, incident: dict[str, t.Any]) -> None:
        """Write the incident, then hand it to --on-event (a failing hook is reported, never fatal)."""
        self._record(path, incident)
        if self.on_event is None:
            return
        result = run_hook(self.on_event, incident, path, hide_env=self.hide_env)
        incident["hook"] = result
        self._record(path, incident)
        if not result["ok"]:
            self.emit(f"warning: --on-event failed: {result['error']}")

    # ---------------------------------------------------------------- run

    def run(self) -> Outcome:
        if self.state_dir == default_state_dir():
            private_dir(self.state_dir)  # ours by name; a --state-dir given by the user keeps its mode
        else:
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with self.lock:
            self._load_memory()
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                return self._loop()
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
                self._drop()
                self._save_memory()

    def _loop(self) -> Outcome:
        o = self.opts
        first = True
        failures = 0  # reconnect tries in the current outage
        last: Status | None = None
        while not self._stop.is_set():
            tick = time.monotonic()  # probes start every interval, however long one takes
            st = self.probe()
            now = self.clock()
            d = self.policy.observe(st, now)
            last = st
            if first:
                mode = "once" if o.once else f"every {o.interval:g}s"
                self.emit(f"watching ({mode}): {describe(st)}")
                first = False
            elif d.new and st.state in ("running",):
                self.emit(f"{describe(st)}")
            if d.note:
                self.emit(d.note)
            if d.cancelled:
                self._close_open("cancelled", d.cancelled, now)
            if d.recovered_after is not None:
                self._outage_over(now, d.recovered_after, failures)
                failures = 0

            if st.state == "unreachable":
                self._drop()
                if d.new:
                    inc = incident_for(st, d, now, restarts=self.policy.restarts_in_window(now), opts=o)
                    path = self.incidents.path_for(inc, now)
                    self._outage = (path, inc)
                    self.emit(f"{describe(st)} -> {d.reason}")
                    self._announce(path, inc)
                if o.once:
                    return Outcome("once", st.state, f"unreachable: {st.detail}")
                failures += 1
                delay = reconnect_delay(failures, o.interval, self.rng)
                logger.info("reconnect try %d in %.2fs", failures, delay)
                self._sleep(delay)
                continue

            if d.new and d.action not in RECOVERY and st.state != "running":
                inc = incident_for(st, d, now, restarts=self.policy.restarts_in_window(now), opts=o)
                self.emit(f"{describe(st)} -> {d.action}: {d.reason}")
                self._announce(self.incidents.path_for(inc, now), inc)
            elif d.new and d.action in RECOVERY:
                if self._open is not None:
                    self._close_open("superseded", f"{describe(st)}: a new incident replaces the pending one", now)
                inc = incident_for(st, d, now, restarts=self.policy.restarts_in_window(now), opts=o)
                path = self.incidents.path_for(inc, now)
                self._open = (path, inc)
                self._record(path, inc)
                self.emit(f"{describe(st)} -> {d.reason}")

            if d.action == GIVE_UP:
                self._save_memory()
                raise errors.CrashLoop(f"{self.host.name}/{self.session}: gave up: {d.reason}. The run is left "
                                       "crashed: fix the cause, then `dflashctl start` (a run started by hand is "
                                       "supervised afresh)")
            if d.action == DONE:
                return Outcome("succeeded", st.state, d.reason)
            if d.action in RECOVERY:
                wait = 0.0 if o.once else d.delay
                if wait > o.interval or (wait > 0 and d.action == STOP_THEN_RESTART):
                    # A long backoff is watched (a human may act meanwhile); a stalled run is
                    # re-probed before it is stopped (it may have moved again).
                    self._sleep(min(wait, o.interval))
                    continue
                # A short backoff is slept through without another probe: that is safe because a
                # restart never passes --replace (the agent refuses over any live run).
                self._sleep(wait)
                if self._stop.is_set():
                    break  # asked to stop: start nothing new
                restarted = self._recover(st, d)
                self._save_memory()
                if d.action == START_CONTAINER:
                    continue  # re-probe at once: the run's own state decides what comes next
                if o.once:
                    return Outcome("once", "restarted" if restarted else st.state, d.reason)
                self._sleep(o.interval - (time.monotonic() - tick))
                continue
            if o.once:
                return Outcome("once", st.state, d.reason)
            self._sleep(o.interval - (time.monotonic() - tick))
        state = last.state if last else None
        self.emit(f"supervisor stopped by {self._signal or 'request'}; the run is left as it is"
                  + (f" ({last.state}, attempt {last.attempt})" if last and last.attempt is not None else ""))
        return Outcome("interrupted", state, self._signal or "")

    def _recover(self, st: Status, d: Decision) -> bool:
        """Carry out a due recovery; update its incident and announce it. True when a new attempt started."""
        from ops import session as run

        now = self.clock()
        path, inc = self._open if self._open is not None else (None, None)
        if inc is None:
            inc = incident_for(st, d, now, restarts=self.policy.restarts_in_window(now), opts=self.opts)
            path = self.incidents.path_for(inc, now)
        assert path is not None
        attempt = None
        try:
            remote = self._connect()
            if d.action == START_CONTAINER:
                if remote.container is None:
                    raise errors.OpsError(f"{self.host.label} has no container to start")
                remote.container.start()
                self.emit(f"container {remote.container.vmid} started; re-probing")
            else:
                if d.action == STOP_THEN_RESTART:
                    stack = save_stack(remote, st)
                    inc["stack"] = stack
                    if stack.get("saved"):
                        self.emit(f"saved the hung process's stack to {stack['saved']}")
                    else:
                        self.emit(f"no stack saved: {stack.get('error')}")
                # --replace only to stop a hung run: a crashed or lost one has no live process, and if
                # one appeared since the probe (someone ran `dflashctl start`) the agent refuses.
                out = run.start(remote, self.session, replace=d.action == STOP_THEN_RESTART)
                attempt = out.get("attempt")
                how = f"replaced attempt {out['replaced'].get('attempt')} by {out['replaced'].get('how')}; " if out.get("replaced") else ""
                self.emit(f"restarted: {how}attempt {attempt} started (command pid {out.get('child_pid')}); log {out.get('log')}")
        except (errors.NotDeployed, errors.ConfigError):
            raise  # the supervisor cannot fix these (nothing deployed, a missing API token): say so and end (exit 1)
        except errors.RunActive as e:
            self.policy.cancel()
            self._open = (path, inc)
            self._close_open("cancelled", f"not restarted: a live run appeared meanwhile ({e}); re-probing", now)
            return False
        except Exception as e:  # OpsError, or an untyped library error: a failed try, never the end
            if not isinstance(e, errors.OpsError):
                logger.exception("%s failed", d.action)
                self._drop()
            if isinstance(e, (errors.UnreachableError, errors.ContainerDown, errors.CommandTimeout)):
                self._drop()
            delay = self.policy.recovered(now, d.action, ok=False, error=str(e))
            inc.update(outcome="failed", error=str(e), done_at=iso(now))
            self.emit(f"{d.action} failed: {e}; re-probing" + (f", next try in {_dur(delay)}" if delay else ""))
            self._open = (path, inc)
            self._announce(path, inc)
            return False
        self.policy.recovered(now, d.action, attempt=attempt, ok=True)
        inc.update(outcome="done", next_attempt=attempt, done_at=iso(self.clock()), error=None)
        self._open = None
        self._announce(path, inc)
        return attempt is not None

    def _close_open(self, outcome: str, why: str, now: float) -> None:
        self.emit(why)
        if self._open is None:
            return
        path, inc = self._open
        self._open = None
        inc.update(outcome=outcome, reason=f"{inc['reason']}; {why}", done_at=iso(now))
        self._announce(path, inc)

    def _outage_over(self, now: float, lasted: float, tries: int) -> None:
        self.emit(f"reachable again after {_dur(lasted)} ({tries} reconnect tr{'y' if tries == 1 else 'ies'}); re-probed")
        if self._outage is None:
            return
        path, inc = self._outage
        self._outage = None
        inc.update(outcome="recovered", done_at=iso(now), outage_seconds=round(lasted, 3))
        self._record(path, inc)
