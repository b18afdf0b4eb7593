"""restart-on-crash's loop: probe every --interval over one kept connection, carry out the policy's
decisions (restart through ``ops.session.start``, start the container, save a hung run's stack), record
and announce incidents."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import socket
import threading
import time
import typing as t
from pathlib import Path

from ops import errors, gpu_health
from ops import session as run
from ops.diagnosis import bus_id, spike_line
from ops.far.atomic import write_json_atomic
from ops.far_call import cannot_exec
from ops.hosts import Host
from ops.probe import Status, classify, iso
from ops.redaction import Scrubber, scrubbed_status, secret_values
from ops.remote import connect as connect_remote
from ops.state_dir import default_state_dir, private_dir
from ops.states import RECOVERY, Cause, State
from ops.supervise.episode import Episodes
from ops.supervise.exclusions import EXCLUDED_ENV, Excluded, Exclusions, env_value
from ops.supervise.heartbeat import Heartbeat
from ops.supervise.policy import (
    DONE,
    GIVE_UP,
    START_CONTAINER,
    STOP_THEN_RESTART,
    Decision,
    Options,
    Policy,
    describe,
    reconnect_delay,
)
from ops.supervise.state import IncidentLog, Lock, incident_for, run_hook, slug
from ops.times import duration

if t.TYPE_CHECKING:
    from ops.notify import Notifier
    from ops.remote import Remote

logger = logging.getLogger(__name__)

STACK_TIMEOUT = 30.0
STACK_FILE = "py-spy-dump.txt"


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
        if cannot_exec(res) or "No such file" in res.err and not res.out:
            tried.append(exe)
            continue
        if not res.ok or not res.out.strip():
            return {
                "saved": None,
                "tool": exe,
                "error": f"py-spy dump failed (exit {res.exit_code}): {res.err.strip()[-300:]}",
            }
        text = res.out
        saved = None
        if st.log:
            target = os.path.join(os.path.dirname(st.log), STACK_FILE)
            try:
                w = remote.run(["tee", target], stdin=text.encode(), timeout=STACK_TIMEOUT)
                saved = target if w.ok else None
            except errors.OpsError:
                saved = None
        return {
            "saved": saved,
            "tool": exe,
            "stack": text[-20000:],
            "error": None if saved else "could not write the dump",
        }
    return {
        "saved": None,
        "error": f"py-spy is not installed where the run lives (tried {', '.join(tried)}): no stack saved",
    }


def _cut(text: str | None, n: int) -> str | None:
    return text if text is None or len(text) <= n else text[: n - 3] + "..."


def gpu_check(remote: Remote) -> tuple[list[gpu_health.GpuHealth], list[str]]:
    """doctor's gpu-health check where the run lives (ECC, row remapping), before a restart that leaves a
    failed GPU out: (each GPU's verdict, the lines said). A check that cannot run is said, never fatal."""
    try:
        res = remote.run(list(gpu_health.ARGV), timeout=60)
    except errors.OpsError as e:
        return [], [f"gpu-health: not checked: {e}"]
    # a GPU that does not answer makes nvidia-smi exit non-zero: the verdicts it gave still count
    found = gpu_health.parse(f"{res.out}\n{res.err}")
    if not res.ok and not found:
        return [], [
            f"gpu-health: not checked: {' '.join(gpu_health.ARGV)} failed (exit {res.exit_code}): {_cut(res.err.strip(), 200)}"
        ]
    return found, [f"gpu-health: {g.line()}" for g in found] or ["gpu-health: nvidia-smi -q listed no GPU"]


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
        notifier: Notifier | None = None,
        heartbeat: Heartbeat | None = None,
        keep_watching: bool = False,
    ) -> None:
        self.host = host
        self.session = run.session_name(host, session)
        self.opts = opts
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir()
        self.on_event = list(on_event) if on_event else None
        self.notifier = notifier  # --notify: queued, delivered in the background (ops/notify.py)
        # What the run prints is scrubbed once, as it is read: every record, line and message comes from it
        self.scrub = Scrubber([*secret_values([host], os.environ), *(notifier.scrub.secrets if notifier else ())])
        self.label = host.name  # how its messages name what it watches
        # Secrets the hook must not inherit: this host's API token variable, and any the caller names.
        self.hide_env = tuple(dict.fromkeys([*host.secret_env, *hide_env]))
        self._emit = emit
        if connect is None:
            connect = connect_remote
        self._connect_fn = connect
        self.clock = clock
        self.rng = rng or random.Random()
        # keep_watching (the supervisor installed on the host): a run that succeeded, or a crash loop it
        # gave up on, is watched on, never left unwatched: a later `dflashctl start` is supervised again.
        self.keep_watching = keep_watching
        self.policy = Policy(opts, rng=self.rng, keep_watching=keep_watching)
        self.episodes = Episodes()  # low disk, a failing sync: told once per episode (kept with the memory)
        # Who watches, written with every probe (docs/design.md section 18); --once only reads the lease.
        self.heartbeat = heartbeat or Heartbeat(interval=opts.interval, clock=clock)
        self._beating = False  # a heartbeat went out (then a stop on purpose says so: _end_lease)
        self.incidents = IncidentLog(self.state_dir, host.name, self.session)
        base = f"{slug(host.name)}.{slug(self.session)}"
        self.lock = Lock(self.state_dir / "supervise" / f"{base}.lock", f"{host.name}/{self.session}")
        self.memory_path = self.state_dir / "supervise" / f"{base}.json"
        self.exclusions = Exclusions(self.state_dir / "supervise" / base, host.name, self.session)
        self._excluded_problem: str | None = None  # said once, not at every probe
        self._remote: Remote | None = None
        self._stop = threading.Event()
        self._signal: str | None = None
        self._open: tuple[Path, dict[str, t.Any]] | None = None  # the incident whose recovery is pending
        self._outage: tuple[Path, dict[str, t.Any]] | None = None

    # ---------------------------------------------------------------- plumbing

    def emit(self, text: str) -> None:
        self._emit(self.scrub(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {self.host.name}/{self.session}: {text}"))

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
        beat = None if self.opts.once else self.heartbeat.request()
        try:
            facts = run.gather(self.host, self.session, self._connect, heartbeat=beat)
            st = classify(facts)
        except Exception as e:  # a bug or an untyped library error must not end an overnight watch
            logger.exception("probe failed")
            self._drop()
            st = Status(
                host=self.host.name,
                session=self.session,
                state=State.UNREACHABLE,
                cause=Cause.UNKNOWN,
                detail=f"the probe failed: {type(e).__name__}: {e}",
                checked_at=iso(self.clock()),
                evidence=[f"probe error: {type(e).__name__}: {e}"],
            )
        else:
            self._beating = self._beating or beat is not None
            # Another live supervisor's lease: SupervisorLocked, before anything is decided or done.
            note = self.heartbeat.check(facts, f"{self.host.name}/{self.session}", wrote=beat is not None)
            if note:
                self.emit(note)
        st = scrubbed_status(st, self.scrub)
        logger.info("probe %s/%s: %s", self.host.name, self.session, st.headline())
        return st

    def _end_lease(self) -> None:
        """A supervisor that stops on purpose says so in its heartbeat: its lease ends at once, and
        `dflashctl status` says `not supervised` rather than, later, stale. Best effort."""
        if not self._beating:
            return  # it never sent one (--once, a group's supervisor): nothing to end
        try:
            run.gather(self.host, self.session, self._connect, heartbeat=self.heartbeat.request(stopped=True))
        except Exception:  # leaving must never fail: a heartbeat left behind turns stale by itself
            logger.debug("the farewell heartbeat failed", exc_info=True)
        self.heartbeat.ended()

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
        except (OSError, ValueError, RecursionError) as e:
            self.emit(f"note: ignoring an unreadable supervisor memory {self.memory_path}: {e}")
            return
        if isinstance(data, dict):
            self.policy.load(data)
            self.episodes.load(data)

    def _save_memory(self) -> None:
        try:
            private_dir(self.memory_path.parent)
            write_json_atomic(
                self.memory_path,
                {
                    **self.policy.memory(),
                    **self.episodes.memory(),
                    "host": self.host.name,
                    "session": self.session,
                    "updated_at": iso(self.clock()),
                },
                mode=0o600,
            )
        except OSError as e:
            self.emit(f"warning: cannot save the supervisor memory {self.memory_path}: {e}")

    def _record(self, path: Path, incident: dict[str, t.Any]) -> None:
        try:
            self.incidents.write(path, self.scrub.tree(incident))
        except OSError as e:
            self.emit(f"warning: cannot write the incident {path}: {e}")

    def _notify(self, incident: dict[str, t.Any]) -> None:
        if self.notifier is not None:
            self.notifier.incident(incident)  # never blocks: a bounded queue per URL

    def _announce(self, path: Path, incident: dict[str, t.Any]) -> None:
        """Write the incident, notify it, then hand it to --on-event (a failing hook is reported, never fatal)."""
        self.heartbeat.acted(incident)
        self._record(path, incident)
        self._notify(incident)
        if self.on_event is None:
            return
        result = run_hook(self.on_event, self.scrub.tree(incident), path, hide_env=self.hide_env)
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
            # SIGHUP too: a closed terminal, or the tmux session of an installed supervisor killed
            old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
            end_lease = True
            ended = "an error"
            try:
                outcome = self._loop()
                ended = self._ending(outcome)
                return outcome
            except errors.SupervisorLocked as e:
                end_lease = False  # the lease is another supervisor's: not ours to end
                ended = str(e)
                self.heartbeat.failed(str(e))
                raise
            except errors.OpsError as e:  # CrashLoop among them
                gave_up = isinstance(e, (errors.CrashLoop, errors.GpuFaultGiveUp))
                ended = str(e) if gave_up else f"{type(e).__name__}: {e}"
                self.heartbeat.failed(str(e))
                raise
            except BaseException as e:
                ended = f"{type(e).__name__}: {e}"
                raise
            finally:
                for s, h in old.items():
                    signal.signal(s, h)
                if end_lease:
                    self._end_lease()
                self._drop()
                self._save_memory()
                self._farewell(ended)

    def _ending(self, outcome: Outcome) -> str:
        if outcome.kind == "succeeded":
            return f"the run succeeded: {outcome.message}"
        if outcome.kind == "interrupted":
            return f"stopped by {outcome.message or 'request'}; the run is left as it is ({outcome.state})"
        return f"{outcome.kind}: {outcome.state}"

    def _hello(self, st: Status) -> None:
        """--notify: the supervisor started (not with --once: cron's every run would say it)."""
        if self.notifier is not None and not self.opts.once:
            self.notifier.supervisor(
                "started", self.label, self.session, f"watching every {self.opts.interval:g}s: {describe(st)}"
            )

    def _farewell(self, ended: str) -> None:
        """--notify: the supervisor stopped, and why; then its last messages get a bounded time to go."""
        if self.notifier is None:
            return
        if not self.opts.once:
            self.notifier.supervisor("stopped", self.label, self.session, ended)
        self.notifier.close()

    def _loop(self) -> Outcome:
        o = self.opts
        first = True
        failures = 0  # reconnect tries in the current outage
        last: Status | None = None
        while not self._stop.is_set():
            tick = time.monotonic()  # probes start every interval, however long one takes
            st = self.probe()
            now = self.clock()
            self._read_excluded()
            d = self.policy.observe(st, now)
            self.heartbeat.probed(st, d)
            self._episodes(st, now)
            self._training_warnings(st)
            last = st
            if first:
                mode = "once" if o.once else f"every {o.interval:g}s"
                self.emit(f"watching ({mode}): {describe(st)}")
                self._hello(st)
                first = False
            elif d.new and st.state in (State.RUNNING,):
                self.emit(f"{describe(st)}")
            if d.note:
                self.emit(d.note)
            if d.cancelled:
                self._close_open("cancelled", d.cancelled, now)
            if d.recovered_after is not None:
                self._outage_over(now, d.recovered_after, failures)
                failures = 0

            if st.state == State.UNREACHABLE:
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

            if d.new and d.action not in RECOVERY and st.state != State.RUNNING:
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
                self._notify(inc)  # the crash now; the restart (or its failure) when it is done
                self.emit(f"{describe(st)} -> {d.reason}")

            if d.action == GIVE_UP and self.keep_watching:
                self._save_memory()
                self.emit(
                    "gave up on this run; still watching: fix the cause, then `dflashctl start` "
                    "(a run started by hand is supervised afresh)"
                )
            elif d.action == GIVE_UP and (st.cause == Cause.GPU_FAULT or d.kind == "gpu-fault"):
                self._save_memory()
                raise errors.GpuFaultGiveUp(
                    f"{self.host.name}/{self.session}: gave up: {d.reason}. The run is left crashed"
                )
            elif d.action == GIVE_UP:
                self._save_memory()
                gave_up = errors.GaveUpDiverged if d.kind == "diverged" else errors.CrashLoop
                raise gave_up(
                    f"{self.host.name}/{self.session}: gave up: {d.reason}. The run is left "
                    "crashed: fix the cause, then `dflashctl start` (a run started by hand is "
                    "supervised afresh)"
                )
            if d.action == DONE and not self.keep_watching:
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
        self.emit(
            f"supervisor stopped by {self._signal or 'request'}; the run is left as it is"
            + (f" ({last.state}, attempt {last.attempt})" if last and last.attempt is not None else "")
        )
        return Outcome("interrupted", state, self._signal or "")

    def _episodes(self, st: Status, now: float) -> None:
        """Low disk, a failing sync: a line and a notification when an episode begins, a line when it ends."""
        changes = self.episodes.observe(st, now)
        for c in changes:
            self.emit(c.text)
            if c.began and self.notifier is not None:
                from ops.notify import flag_message  # as the notifier itself: only with --notify

                self.notifier.send(flag_message(c.flag, self.label, self.session, c.text, st.attempt))
        if changes:
            self._save_memory()

    def _training_warnings(self, st: Status) -> None:
        """The trainer's loss-spike records (metrics.jsonl, never a printed line): one line each, once, and
        at most one --notify message a probe (the newest, with how many came with it); a warning only, while
        the run goes on (a crash's message is never preceded by one)."""
        if st.state not in (State.RUNNING, State.STALLED):
            return
        news = [s for s in st.spikes if self.policy.spike_news(st.attempt, s.step)]
        for spike in news:
            self.emit(f"attempt {st.attempt}: {spike_line(spike)} (a warning: the run goes on)")
        if news and self.notifier is not None:
            more = f" ({len(news)} spikes since the last probe)" if len(news) > 1 else ""
            self.notifier.training("loss-spike", self.host.name, self.session, st.attempt, spike_line(news[-1]) + more)

    def _recover(self, st: Status, d: Decision) -> bool:
        """Carry out a due recovery; update its incident and announce it. True when a new attempt started."""
        now = self.clock()
        path, inc = self._open if self._open is not None else (None, None)
        if inc is None:
            inc = incident_for(st, d, now, restarts=self.policy.restarts_in_window(now), opts=self.opts)
            path = self.incidents.path_for(inc, now)
        assert path is not None
        try:
            attempt = self._act(st, d, inc)
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
            if self._drops_after(e):
                self._drop()
            delay = self.policy.recovered(now, d.action, ok=False, error=str(e))
            inc.update(outcome="failed", error=str(e), done_at=iso(now))
            self.emit(f"{d.action} failed: {e}; re-probing" + (f", next try in {duration(delay)}" if delay else ""))
            self._open = (path, inc)
            self._announce(path, inc)
            return False
        self.policy.recovered(now, d.action, attempt=attempt, ok=True)
        inc.update(outcome="done", next_attempt=attempt, done_at=iso(self.clock()), error=None)
        self._open = None
        self._announce(path, inc)
        return attempt is not None

    def _act(self, st: Status, d: Decision, inc: dict[str, t.Any]) -> int | None:
        """The recovery itself (the incident's bookkeeping is ``_recover``'s): the attempt it started, or
        None when it started none (a container start: the next probe decides)."""
        remote = self._connect()
        if d.action == START_CONTAINER:
            if remote.container is None:
                raise errors.OpsError(f"{self.host.label} has no container to start")
            remote.container.start()
            self.emit(f"container {remote.container.vmid} started; re-probing")
            return None
        if d.action == STOP_THEN_RESTART and st.state == State.STALLED:
            stack = save_stack(remote, st)
            inc["stack"] = stack
            if stack.get("saved"):
                self.emit(f"saved the hung process's stack to {stack['saved']}")
            else:
                self.emit(f"no stack saved: {stack.get('error')}")
        added, excluded = self._exclude(remote, st, inc)
        by = self.started_by(st, d, inc)
        if excluded:
            by["excluded_gpus"] = [e.bus_id for e in excluded]
        # --replace only to stop a hung run or what a dead keeper left running (cause orphans-left):
        # a crashed or lost run has no live process, and if one appeared since the probe (someone ran
        # `dflashctl start`) the agent refuses.
        out = run.start(
            remote,
            self.session,
            replace=d.action == STOP_THEN_RESTART,
            started_by=by,
            env={EXCLUDED_ENV: env_value(excluded)} if excluded else None,
        )
        attempt = out.get("attempt")
        if added:
            them = "it" if len(added) == 1 else "them"
            inc["excluded"] = f"{', '.join(e.phrase() for e in added)} excluded; attempt {attempt} runs without {them}"
            self.emit(inc["excluded"] + f" ({EXCLUDED_ENV}={env_value(excluded)})")
        how = (
            f"replaced attempt {out['replaced'].get('attempt')} by {out['replaced'].get('how')}; "
            if out.get("replaced")
            else ""
        )
        self.emit(
            f"restarted: {how}attempt {attempt} started (command pid {out.get('child_pid')}); log {out.get('log')}"
        )
        return None if attempt is None else int(attempt)

    def _read_excluded(self) -> None:
        """The session's excluded GPUs, afresh (``dflashctl gpus --include`` may have put one back)."""
        items = self.exclusions.load()
        self.policy.excluded = {e.bus_id: e.attempt for e in items}
        problem = self.exclusions.problem
        if problem and problem != self._excluded_problem:
            self.emit(f"warning: {problem}")
        self._excluded_problem = problem

    def _exclude(self, remote: Remote, st: Status, inc: dict[str, t.Any]) -> tuple[list[Excluded], list[Excluded]]:
        """Before a restart: after a gpu-fault with --on-gpu-fault exclude, the failed GPU and every GPU the
        gpu-health check fails join the session's excluded set. Returns (those added now, the whole set:
        what the next attempt runs without, whatever its crash was)."""
        new: list[Excluded] = []
        bus = bus_id(st.gpu_bus_id)
        now = iso(self.clock())
        if st.cause == Cause.GPU_FAULT and self.opts.on_gpu_fault == "exclude" and bus is not None:
            new.append(Excluded(bus, _cut(st.detail, 300) or "GPU fault", st.xid, st.attempt, now))
            health, said = gpu_check(remote)
            inc["gpu_health"] = said
            for g in health:
                other = bus_id(g.bus_id)
                if g.status == "fail" and other is not None:
                    new.append(Excluded(other, f"gpu-health: {'; '.join(g.why)}", None, st.attempt, now))
        try:
            added = list(self.exclusions.add(new, now)) if new else []
            excluded = list(self.exclusions.load())
        except OSError as e:  # the set is not kept, but this start still runs without the GPU
            self.emit(f"warning: cannot write the excluded GPUs to {self.exclusions.path}: {e}")
            added, excluded = new, [*self.exclusions.load(), *new]
        inc["excluded_gpus"] = [e.bus_id for e in excluded]
        return added, excluded

    def started_by(self, st: Status, d: Decision, inc: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
        """run.json's ``started_by`` of an attempt this supervisor starts: where it runs, and the failure it
        answers (``after``: what it saw of the attempt before; ``dflashctl history`` reads it)."""
        return {
            "by": "supervisor",
            "machine": socket.gethostname(),
            "pid": os.getpid(),
            "action": str(d.action),
            "why": _cut(f"{describe(st)}: {inc.get('reason') or d.reason}", 300),
            "after": {
                "attempt": st.attempt,
                "state": str(st.state),
                "cause": st.cause,
                "detail": _cut(st.detail, 200),
                "exit_code": st.exit_code,
                "signal": st.signal,
                "seen_at": inc.get("time"),
            },
        }

    def _drops_after(self, e: Exception) -> bool:
        """Whether a failed recovery's connection is dropped (the next probe reconnects): after an untyped
        error, or one that says the link or the container went."""
        return not isinstance(e, errors.OpsError) or isinstance(
            e, (errors.UnreachableError, errors.ContainerDown, errors.CommandTimeout)
        )

    def _close_open(self, outcome: str, why: str, now: float) -> None:
        self.emit(why)
        if self._open is None:
            return
        path, inc = self._open
        self._open = None
        inc.update(outcome=outcome, reason=f"{inc['reason']}; {why}", done_at=iso(now))
        self._announce(path, inc)

    def _outage_over(self, now: float, lasted: float, tries: int) -> None:
        self.emit(
            f"reachable again after {duration(lasted)} ({tries} reconnect tr{'y' if tries == 1 else 'ies'}); re-probed"
        )
        if self._outage is None:
            return
        path, inc = self._outage
        self._outage = None
        inc.update(outcome="recovered", done_at=iso(now), outage_seconds=round(lasted, 3))
        self._record(path, inc)
        self._notify(inc)
