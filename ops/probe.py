"""Facts -> ``Status``: the pure classification behind `dflashctl status` (docs/design.md section 6).

No I/O. The input is one dict the operator side assembles (``ops.session.gather``):

    {"host", "session", "socket", "container_id", "hang_after", "startup_grace", "checked_at",
     "mode": "agent" | "fallback",
     "unreachable":    {"cause", "detail"} | None,        # typed transport errors' .cause
     "container_down": {"cause", "detail"} | None,        # ContainerDown.cause: stopped | missing
     "agent_timeout":  "detail" | None,
     "agent":    the agent's probe answer | None,
     "fallback": {"reason", "tmux", "pane_capture"} | None}

Durable evidence (exit.json, run.json, the log) decides before tmux texts do: `no server running on ...`
is printed both when the server was killed and when it exited because its only session's command
ended, so only the run's own exit record can tell those apart.
"""

from __future__ import annotations

import dataclasses
import math
import time
import typing as t

from ops import diagnosis, gpu_fault, wire
from ops.diagnosis import Progress, diagnose, progress_from_lines, progress_of
from ops.diagnosis import iso as iso  # the supervisor's modules read it here
from ops.diagnosis import short as _short
from ops.diagnosis import signame as _signame
from ops.disk import DiskView, SyncView, checkpoint_context
from ops.far import members, watch
from ops.far import tmux as tmux_mod
from ops.states import Cause, State
from ops.workers import Worker, as_int, worker_table, workers_of

# Records without PID 1's ticks compare start times: a container restart moves them by more than this.
BOOT_SLACK = 1.0
TAIL_KEEP = 30  # log lines kept on the Status for incident reports (not in the JSON)


@dataclasses.dataclass(slots=True)
class TmuxView:
    socket: str | None
    server: str | None = None  # "alive" | "dead" | None (unknown)
    session: str | None = None  # "alive" | "missing" | None
    pane: str | None = None  # "alive" | "dead" | None
    evidence: str | None = None  # the exact tmux stderr when something is not there


@dataclasses.dataclass(slots=True)
class ContainerView:
    id: int
    status: str | None  # "running" | "stopped" | "missing" | None (unknown)
    booted_at: str | None = None


@dataclasses.dataclass(slots=True)
class SupervisorView:
    """Who watches the run, from the heartbeat its supervisor's probes leave (ops/far/watch.py).

    ``state``: ``none`` (no supervisor ever probed this session), ``watching``, ``stale`` (silent for more
    than 3 of its intervals: it is not watching any more, whatever it thinks), ``stopped`` (it stopped on
    purpose) or ``unreadable`` (supervisor.json cannot be read, its numbers are not numbers, or it is from
    ahead of the container's clock: it holds no lease). A stale or unreadable one is a fault shown in the
    evidence; it never changes the run's state."""

    state: str
    by: str | None = None  # the name it goes by: the inventory's host name on the Proxmox host, else the machine's
    where: str | None = None  # the machine it runs on (its hostname)
    mode: str | None = None  # "systemd", "tmux" (installed on the host) or "foreground" (restart-on-crash)
    pid: int | None = None
    interval: float | None = None
    started_at: str | None = None
    last_probe: str | None = None
    silent_for: float | None = None  # seconds since its last probe, on the container's clock
    last_action: dict[str, t.Any] | None = None
    id: str | None = None
    unreadable: str | None = None  # why the heartbeat cannot be read

    def phrase(self) -> str:
        """``supervised by pve (systemd, last probe 12 s ago)``, ``not supervised``, ..."""
        name, mode = self.by or self.where or "?", self.mode or "?"
        ago = _ago(self.silent_for)
        if self.state == "watching":
            return f"supervised by {name} ({mode}, last probe {ago} ago)"
        pid = f", pid {self.pid}" if self.pid else ""
        if self.state == "stale":
            return (
                f"STALE: the supervisor {name} ({mode}{pid}) has been silent for {ago} (more than "
                f"{watch.STALE_AFTER} of its {_ago(self.interval)} intervals): nothing watches this run"
            )
        if self.state == "stopped":
            return f"not supervised (the supervisor {name} ({mode}) stopped {ago} ago)"
        if self.state == "unreadable":
            return f"not supervised: supervisor.json: unreadable heartbeat ({self.unreadable})"
        return "not supervised"


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    return _dur(seconds)


def supervisor_view(rec: wire.Heartbeat | None, now: float | None) -> SupervisorView:
    if rec is None:
        return SupervisorView("none")
    bad = rec.unreadable(now) if not rec.stopped else None
    quiet = rec.silent_for(now) if now is not None else None
    if bad is not None:
        state = "unreadable"
    elif rec.stopped:
        state = "stopped"
    elif now is not None and rec.live(now):
        state = "watching"
    else:
        state = "stale"
    return SupervisorView(
        state=state,
        by=rec.by,
        where=rec.where,
        mode=rec.mode,
        pid=rec.pid,
        interval=rec.interval,
        started_at=iso(rec.started_at),
        last_probe=iso(rec.at),
        silent_for=None if quiet is None else round(quiet, 1),
        last_action=dict(rec.last_action) if rec.last_action is not None else None,
        id=rec.id,
        unreadable=bad,
    )


@dataclasses.dataclass(slots=True)
class Status:
    host: str
    session: str
    state: State
    cause: str | None = None
    detail: str | None = None
    gpu: int | None = None
    gpu_bus_id: str | None = None  # gpu-fault: the PCI bus id the driver named
    xid: int | None = None  # gpu-fault: the driver's Xid code
    exit_code: int | None = None
    signal: int | None = None
    attempt: int | None = None
    started_at: str | None = None
    ended_at: str | None = None
    tmux: TmuxView = dataclasses.field(default_factory=lambda: TmuxView(None))
    container: ContainerView | None = None
    progress: Progress | None = None
    log: str | None = None
    evidence: list[str] = dataclasses.field(default_factory=list)
    checked_at: str | None = None
    mode: str = "agent"
    fingerprint: str | None = None
    pid: int | None = None
    gpus: list[wire.Gpu] | None = None
    # per worker, from the last metrics.jsonl record (see ``workers_of``); None when unknown
    workers: list[Worker] | None = None
    # who watches the run (its supervisor's heartbeat); None when the agent could not be asked
    supervisor: SupervisorView | None = None
    # the run's live processes ({pid, start, attempt, argv}: the command and all it started, any
    # attempt of the session); None when unknown (a runner that does not tag them)
    members: list[dict[str, t.Any]] | None = None
    # room for the next checkpoint and the last sync off the box (ops/disk.py); None: unknown / no sync
    disk: DiskView | None = None
    sync: SyncView | None = None
    # the PCI bus ids this attempt runs without (run.json's started_by: the supervisor started it with
    # DFLASH_EXCLUDED_GPUS); [] when it set none, None without a run record
    excluded_gpus: list[str] | None = None
    # not part of the JSON: the last log lines, for incident reports; a stop was asked for (stop.json)
    tail: list[str] = dataclasses.field(default_factory=list)
    stop_requested: bool = False
    spikes: tuple[wire.Spike, ...] = ()  # not in the JSON: the trainer's loss-spike records (metrics.jsonl)

    def to_json(self) -> dict[str, t.Any]:
        hidden = ("tail", "stop_requested", "spikes")
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in hidden}
        d["tmux"] = dataclasses.asdict(self.tmux)
        d["container"] = dataclasses.asdict(self.container) if self.container else None
        d["progress"] = dataclasses.asdict(self.progress) if self.progress else None
        d["supervisor"] = dataclasses.asdict(self.supervisor) if self.supervisor else None
        d["disk"] = dataclasses.asdict(self.disk) if self.disk else None
        d["sync"] = dataclasses.asdict(self.sync) if self.sync else None
        d["evidence"] = list(self.evidence)
        d["gpus"] = None if self.gpus is None else [g.to_json() for g in self.gpus]
        d["workers"] = None if self.workers is None else [dataclasses.asdict(w) for w in self.workers]
        return d

    # ---------------------------------------------------------------- human output

    def headline(self) -> str:
        when = _clock(self.ended_at)
        att = f"attempt {self.attempt}" if self.attempt is not None else None
        if self.state == State.CRASHED:
            how = f"signal {self.signal}" if self.exit_code is None and self.signal else f"exit {self.exit_code}"
            if self.exit_code is None and self.signal is None:
                how = "no exit record"
            return f"crashed: {_cause_text(self)} ({_join(how, when, att)})"
        if self.state == State.SUCCEEDED:
            return f"succeeded ({_join('exit 0', when, att)})"
        if self.state == State.STOPPED:
            return f"stopped by dflashctl stop ({_join(when, att)})"
        if self.state in (State.RUNNING, State.STALLED):
            prog = ""
            if self.progress and self.progress.step is not None:
                prog = f"step {self.progress.step}"
                if self.progress.loss is not None:
                    prog += f", loss {self.progress.loss:g}"
            pid = f"pid {self.pid}" if self.pid else None
            if self.state == State.STALLED:
                return f"stalled: {self.detail} ({_join(prog or None, att, pid)})"
            return f"running{': ' + prog if prog else ''} ({_join(att or 'no run record', pid)})"
        if self.state == State.LOST:
            return f"lost: {_cause_text(self)} ({_join('no exit record', att)})"
        if self.state == State.CONTAINER_DOWN:
            return f"container-down: container {self.container.id if self.container else '?'} is {self.cause}"
        if self.state == State.UNREACHABLE:
            return f"unreachable ({self.cause}): {self.detail}"
        return f"{self.state}: {self.detail}" if self.detail else self.state

    def watch_flags(self) -> list[str]:
        """What the operator should act on though the run goes on: ``low disk``, ``sync failed``."""
        return [p for p in (self.disk.phrase() if self.disk else None, self.sync.phrase() if self.sync else None) if p]

    def lines(self) -> list[str]:
        """The headline, then tmux, container, progress, log and the evidence."""
        out = [self.headline()]
        if self.detail and self.state in (State.CRASHED, State.LOST) and self.detail not in out[0]:
            out.append(f"  detail:    {self.detail}")
        out.extend(worker_table(self.workers))
        tm = self.tmux
        if tm.server is None and tm.evidence is None:
            out.append(f"  tmux:      unknown (socket {tm.socket})")
        else:
            parts = [f"server {tm.server or 'unknown'}"]
            if tm.session:
                parts.append(f"session {tm.session}")
            if tm.pane:
                parts.append(f"pane {tm.pane}")
            line = f"  tmux:      {', '.join(parts)} (socket {tm.socket})"
            if tm.evidence:
                line += f": {tm.evidence}"
            out.append(line)
        if self.container is not None:
            c = self.container
            boot = f", booted {c.booted_at}" if c.booted_at else ""
            out.append(f"  container: {c.id} {c.status or 'unknown'}{boot}")
        if self.progress is not None:
            p = self.progress
            bits = [
                f"step {p.step}" if p.step is not None else None,
                f"loss {p.loss:g}" if p.loss is not None else None,
                f"{p.ktok_s:g} Ktok/s" if p.ktok_s is not None else None,
            ]
            out.append(f"  progress:  {_join(*bits) or 'no step yet'}" + (f" (at {p.at})" if p.at else ""))
        if self.gpus:
            for g in self.gpus:
                out.append(
                    f"  gpu {g.index}:     {g.memory_used_mib}/{g.memory_total_mib} MiB, {g.utilization_pct}% util"
                )
        if self.excluded_gpus:
            out.append(f"  excluded:  {', '.join(self.excluded_gpus)} (this attempt runs without; `dflashctl gpus`)")
        if self.log:
            out.append(f"  log:       {self.log}")
        flags = self.watch_flags()
        if self.supervisor is not None or flags:
            said = [self.supervisor.phrase()] if self.supervisor is not None else []
            out.append(f"  watch:     {'; '.join([*said, *flags])}")
        if self.mode != "agent":
            out.append(f"  mode:      {self.mode}")
        if self.evidence:
            out.append("  evidence:")
            out.extend(f"    - {e}" for e in self.evidence)
        return out


def _join(*parts: str | None) -> str:
    return ", ".join(p for p in parts if p)


def _clock(ts: str | None) -> str | None:
    # "2026-11-29T15:40:02Z" -> "15:40:02"
    return ts[11:19] if ts and len(ts) >= 19 else None


def _cause_text(s: Status) -> str:
    c = s.cause
    if c == Cause.CUDA_OOM:
        return "CUDA out of memory" + (f" on GPU {s.gpu}" if s.gpu is not None else "")
    if c == Cause.HOST_OOM:
        return "killed by the host OOM killer (container memory limit)"
    if c == Cause.NCCL_TIMEOUT:
        return "NCCL watchdog timeout (a collective hung)"
    if c == Cause.NCCL_ERROR:
        return "NCCL error"
    if c == Cause.PEER_LOST:
        return "lost the other nodes of the run" + (f": {_short(s.detail)}" if s.detail else "")
    if c == Cause.GPU_FAULT:
        return "GPU fault: " + diagnosis.Fault(s.detail or "", s.xid, s.gpu_bus_id, s.gpu).phrase()
    if c == Cause.PYTHON_EXCEPTION:
        return _short(s.detail or "Python exception")
    if c == Cause.DIVERGED:
        return "training diverged" + (f": {_short(s.detail)}" if s.detail else " (a non-finite loss or gradient)")
    if c == Cause.SIGNAL:
        return f"killed by signal {s.signal} ({_signame(s.signal)})"
    if c == Cause.NONZERO_EXIT:
        # The exit code is in the parentheses already: say what the command last said, if anything.
        return f"exited with an error: {_short(s.detail)}" if s.detail else "exited with an error"
    if c == Cause.DISK_FULL:
        return "the disk is full" + (f": {_short(s.detail)}" if s.detail else "")
    if c == Cause.ORPHANS_LEFT:
        return "the command ended, processes it started run on unsupervised" + (
            f": {members_text(s.members or [])}" if s.members else ""
        )
    if c == Cause.CONTAINER_RESTART:
        return "the container restarted during the run"
    if c == Cause.TMUX_SERVER_KILLED:
        return "the run died with its tmux server"
    if c == Cause.SESSION_KILLED:
        return "the run died with its tmux session"
    return "the run vanished"


def members_text(found: t.Sequence[wire.Member] | t.Sequence[t.Mapping[str, t.Any]], limit: int = 4) -> str:
    """``pid 12 (python train.py --config), pid 13 (tee log)``: how messages name the run's processes."""
    return members.describe([m.named() if isinstance(m, wire.Member) else m for m in found], limit)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("s") else "s")


def _run_or_runs(n: int) -> str:
    return "runs" if n == 1 else "run"


# --------------------------------------------------------------------------------------------
# The classification


def tmux_view(socket: str | None, tf: wire.Tmux | None, pane: wire.Pane | None) -> TmuxView:
    if tf is None:
        return TmuxView(socket)
    if tf.timed_out:
        return TmuxView(socket, evidence="tmux did not answer (timed out)")
    if tf.installed is False:
        return TmuxView(socket, server="dead", evidence=f"tmux is not installed: {tf.stderr}")
    if tf.exit_code == 0:
        state = None if pane is None else "dead" if pane.dead == "1" else "alive"
        return TmuxView(socket, "alive", "alive", state, None)
    v = tmux_mod.classify(tf.stderr or "")
    return TmuxView(socket, v.server, v.session, None, v.text or None)


def _pane(tf: wire.Tmux | None, pid: int | None = None) -> wire.Pane | None:
    return tf.pane(pid) if tf is not None else None


def classify(facts: t.Mapping[str, t.Any]) -> Status:
    """One state, its cause and the evidence it rests on, from the facts as gathered (or recorded)."""
    return judge(wire.parse_facts(facts))


def judge(f: wire.Facts) -> Status:
    """``classify`` of facts already read; what did not read is an ``unreadable record`` line each."""
    s = Status(
        host=f.host,
        session=f.session,
        state=State.NOT_STARTED,
        checked_at=iso(f.checked_at),
        mode=f.mode,
        tmux=TmuxView(f.socket),
    )
    if f.container_id is not None:
        s.container = ContainerView(id=f.container_id, status=None)
    _judge(s, f)
    s.evidence.extend(f"unreadable record: {p}" for p in f.problems)
    return s


def _judge(s: Status, f: wire.Facts) -> None:
    if f.unreachable:
        un = f.unreachable
        s.state, s.cause, s.detail = State.UNREACHABLE, un.cause or Cause.UNKNOWN, un.detail
        s.evidence.append(f"{un.cause}: {un.detail}")
        return
    if f.container_down:
        down = f.container_down
        s.state, s.cause, s.detail = State.CONTAINER_DOWN, down.cause, down.detail
        if s.container is not None:
            s.container.status = down.cause
        s.evidence.append(f"pct: {down.detail}")
        return
    if f.agent_timeout:
        s.state, s.cause, s.detail = State.UNREACHABLE, Cause.TIMEOUT, f.agent_timeout
        if s.container is not None:
            s.container.status = "running"
        s.evidence.append(f"agent: {f.agent_timeout}")
        return

    agent = f.agent
    if agent is None:
        fb = f.fallback or wire.Fallback(None, None, None)
        s.mode = "fallback"
        if s.container is not None:
            s.container.status = "running"
        s.evidence.append(
            f"fallback mode: {fb.reason or 'the agent could not run'}; only tmux was asked (no run records read)"
        )
        _classify_by_tmux(s, fb.tmux, fb.capture, attempt=None)
        return

    if s.container is not None:
        s.container.status = "running"
        s.container.booted_at = iso(agent.pid1_start)
    if agent.gpus is not None:
        s.gpus = list(agent.gpus)
    elif agent.gpu_error:
        s.evidence.append(f"nvidia-smi failed: {agent.gpu_error}")
    af = agent.attempt
    if af is not None and af.run is not None:
        _classify_run(s, f, agent, af, af.run)
    else:
        _classify_by_tmux(s, agent.tmux, agent.capture, attempt=af)
        if agent.foreign_run is not None:
            s.evidence.insert(
                0,
                f"the pane runs {agent.foreign_run[:300]}: the run of another host entry (same container, socket "
                "and session, another run_dir); this entry's run_dir holds no record of it",
            )
    _gpu_fault(s, agent, f.host_kernel)  # the driver's words, wherever they are
    s.disk, s.sync, said = checkpoint_context(agent.checkpoints)
    s.evidence.extend(said)
    if agent.has_supervisor:  # an agent older than the heartbeat does not say (None: unknown)
        s.supervisor = supervisor_view(agent.supervisor, agent.now)
        if s.supervisor.state == "stale":
            s.evidence.append(f"supervisor: {s.supervisor.phrase()} (last probe at {s.supervisor.last_probe})")
        elif s.supervisor.state == "unreadable":
            s.evidence.append(f"supervisor.json: unreadable heartbeat ({s.supervisor.unreadable})")


def _gpu_fault(s: Status, agent: wire.Probe, host_kernel: wire.KernelLog | None) -> None:
    """A crashed run's gpu-fault (``gpu_fault.explain``): the Xid, the bus id and the GPU index go on the
    Status, each source's line in its evidence. The program's own last error (a CUDA error's traceback)
    stays as evidence: the Xid is the cause."""
    if s.state != State.CRASHED:
        return
    af = agent.attempt
    log = af.log if af is not None else None
    exc = diagnosis.last_exception((log.tail if log is not None else ()) or s.tail)  # s.tail: a pane's
    pids = {m.pid for m in af.members if m.pid is not None} if af is not None else set()
    if af is not None and af.run is not None:
        pids |= {p for p in (af.run.pid, af.run.child_pid) if p is not None}
    found = gpu_fault.explain([exc] if exc else [], agent.kernel, host_kernel, s.gpus, pids)
    s.evidence.extend(found.unread)
    fault = found.fault
    if fault is None:
        return
    if s.cause != Cause.GPU_FAULT and s.detail:
        s.evidence.append(f"the program's last error ({s.cause}): {_short(s.detail, 200)}")
    s.cause, s.detail, s.fingerprint = Cause.GPU_FAULT, _short(fault.text, 400), fault.fingerprint
    s.gpu, s.gpu_bus_id, s.xid = fault.gpu, fault.bus_id, fault.xid
    s.evidence.extend(line for line in found.lines if line not in s.evidence)  # diagnose() named the log's


def excluded_of(started_by: t.Mapping[str, t.Any] | None) -> list[str]:
    """The bus ids a supervisor started the attempt without (``started_by.excluded_gpus``), each checked."""
    listed = (started_by or {}).get("excluded_gpus")
    if not isinstance(listed, list):
        return []
    return [x[:40] for x in listed[:64] if isinstance(x, str) and x.strip()]


def _classify_run(s: Status, f: wire.Facts, agent: wire.Probe, af: wire.Attempt, run: wire.RunRecord) -> None:
    """A run started by the runner: it ended (exit.json), a process of it is alive, or neither."""
    s.tmux = tmux_view(s.tmux.socket, agent.tmux, _pane(agent.tmux, run.pid))
    s.attempt = af.attempt if af.attempt is not None else run.attempt
    s.started_at = run.started_at
    s.pid = run.child_pid or run.pid
    log = af.log or wire.Log(None, None, ())
    s.log = log.path or (f"{af.dir}/train.log" if af.dir else None)
    s.tail = list(log.tail[-TAIL_KEEP:])
    s.progress = progress_of(af.metrics, af.log)
    s.workers = workers_of(af.metrics.last if af.metrics else None, s.gpus)
    s.spikes = af.metrics.spikes if af.metrics else ()
    s.excluded_gpus = excluded_of(run.started_by)
    for err in af.errors:
        s.evidence.append(f"unreadable record: {err}")
    # The run's processes (ops/far/members.py): known when its runner tags them (run.json "tag").
    found = list(af.members) if run.tag else None
    if found is not None:
        s.members = [m.named() for m in found]
    s.stop_requested = bool(af.stop)
    alive = next((p for p in (af.child, af.keeper, af.runner) if p is not None and p.alive), None)
    if af.exit:
        _ended(s, agent, af, run, af.exit, found)
    elif alive:
        _running(s, f, agent, af, run, alive, found)
    elif found:
        # the command and its keeper are gone, not what the command started
        _orphans(s, found, af.stop, "the command and its keeper are gone (no exit record)")
        _tmux_context(s)
    else:
        _gone(s, agent, af, run)


def _ended(
    s: Status,
    agent: wire.Probe,
    af: wire.Attempt,
    run: wire.RunRecord,
    exit_rec: wire.ExitRecord,
    found: list[wire.Member] | None,
) -> None:
    """exit.json: the run succeeded, was stopped or crashed; processes that outlived it are orphans."""
    s.ended_at = exit_rec.ended_at
    s.exit_code, s.signal = exit_rec.exit_code, exit_rec.signal
    stop = af.stop
    if found:
        # exit.json is written once every process of the run is gone: these outlived the record
        _orphans(s, found, stop, f"the command ended ({_how(s.exit_code, s.signal)} at {s.ended_at})")
        _tmux_context(s)
        return
    s.evidence.append(f"exit.json: {_how(s.exit_code, s.signal)} at {s.ended_at}")
    if stop:
        s.state = State.STOPPED
        s.detail = f"stopped on purpose ({stop.reason} requested at {stop.requested_at})"
        s.evidence.append(f"stop.json: requested at {stop.requested_at}")
    elif s.exit_code == 0:
        s.state = State.SUCCEEDED
    else:
        s.state = State.CRASHED
        d = diagnose(
            af.log.tail if af.log else [],
            exit_code=s.exit_code,
            signal=s.signal,
            oom_before=run.oom_kill,
            oom_after=exit_rec.oom_kill,
            disk_free=exit_rec.disk_free if exit_rec.disk_full else None,
        )
        s.cause, s.detail, s.gpu, s.fingerprint = d.cause, d.detail, d.gpu, d.fingerprint
        if d.signal and s.signal is None:
            s.signal = d.signal
        s.evidence.extend(d.evidence)
    if exit_rec.left:
        s.evidence.append(
            f"exit.json: the command left {_plural(len(exit_rec.left), 'process')} running when it ended "
            f"({members_text(exit_rec.left)}): the run ended with its command, so they were stopped"
        )
    if exit_rec.killed:
        s.evidence.append(
            f"exit.json: {_plural(len(exit_rec.killed), 'process')} had to be killed (SIGKILL): "
            f"{members_text(exit_rec.killed)}"
        )
    if exit_rec.disk_full and s.cause != Cause.DISK_FULL:
        s.evidence.append(f"the run's disk was full when it ended ({exit_rec.disk_free} bytes free)")
    _tmux_context(s)
    _disk_context(s, agent.disk)


def _running(
    s: Status,
    f: wire.Facts,
    agent: wire.Probe,
    af: wire.Attempt,
    run: wire.RunRecord,
    alive: wire.Process,
    found: list[wire.Member] | None,
) -> None:
    """A process of the run is alive: running, or stalled when it wrote nothing for hang_after."""
    child, keeper, runner = af.child, af.keeper, af.runner
    s.pid = alive.pid
    who = (
        "the command"
        if alive is child
        else "the runner's keeper (the command's pid is gone)"
        if alive is keeper
        else "the runner (the command's pid is gone)"
    )
    if alive is child and runner is not None and not runner.alive:
        gone = f"the runner (pid {runner.pid}) is gone, the command goes on"
        if keeper is not None and keeper.alive:
            gone += f": its keeper (pid {keeper.pid}) will record its end"
        s.evidence.append(gone)
    s.evidence.append(f"{who} is alive: pid {alive.pid} (state {alive.state}, start time matches run.json)")
    others = [m for m in found or [] if m.pid != (child.pid if child else None)]
    if alive is keeper and found:
        s.pid = found[0].pid
        s.evidence.append(
            f"the command ended; {_plural(len(found), 'process')} it started still "
            f"{_run_or_runs(len(found))} ({members_text(found)}): "
            "the keeper ends them and writes exit.json once they are gone"
        )
    elif others:
        s.evidence.append(f"the run's other processes: {members_text(others)}")
    if alive is not keeper and keeper is not None and not keeper.alive and found is not None:
        s.evidence.append(
            f"its keeper (pid {keeper.pid}) is gone: nothing will record the run's end or end what it leaves"
        )
    if alive.state == "T":
        s.evidence.append(f"pid {alive.pid} is stopped (state T: SIGSTOP or a debugger)")
    if af.stop:
        s.evidence.append(f"stop.json: a stop was requested at {af.stop.requested_at} but the process still runs")
    _tmux_context(s, alive=True)
    _disk_context(s, agent.disk)
    _pace(s, f, agent, af, run)


def _pace(s: Status, f: wire.Facts, agent: wire.Probe, af: wire.Attempt, run: wire.RunRecord) -> None:
    """Running, or stalled: nothing written to the log or the metrics for hang_after (after startup_grace)."""
    now = agent.now or f.checked_at or time.time()
    started = run.started_ts
    marks = [m for m in (af.log.mtime if af.log else None, af.metrics.mtime if af.metrics else None, started) if m]
    last = max(marks) if marks else None
    hang, grace = f.hang_after, f.startup_grace
    if started is not None and now - started <= grace:
        s.state = State.RUNNING
        if last is not None and now - last > hang:
            s.evidence.append(f"no progress for {_dur(now - last)}, but still inside startup_grace ({_dur(grace)})")
    elif last is not None and now - last > hang:
        s.state = State.STALLED
        s.detail = f"no progress for {_dur(now - last)} (hang_after {_dur(hang)})"
        s.evidence.append(f"last log/metrics write at {iso(last)} (container clock; now {iso(now)})")
    else:
        s.state = State.RUNNING


def _gone(s: Status, agent: wire.Probe, af: wire.Attempt, run: wire.RunRecord) -> None:
    """No exit record and no live process: stopped when a stop was asked for, else lost (and why)."""
    child, stop = af.child, af.stop
    if s.pid and child:
        s.evidence.append(f"pid {child.pid} is gone" + (" (reused by another process)" if child.same is False else ""))
    if stop:
        s.state = State.STOPPED
        s.detail = f"stopped on purpose ({stop.reason} requested at {stop.requested_at}); the runner was killed before it wrote exit.json"
        s.evidence.append(f"stop.json: requested at {stop.requested_at}")
        _tmux_context(s)
        return
    s.state = State.LOST
    pane = _pane(agent.tmux, run.pid)
    boot_now, boot_then, started = agent.pid1_start, run.container_boot, run.started_ts
    ticks_now, ticks_then = agent.pid1_ticks, run.container_boot_ticks
    if ticks_now is not None and ticks_then is not None:
        restarted = ticks_now != ticks_then  # another PID 1: exact, no clock involved
    else:
        restarted = (boot_now is not None and boot_then is not None and boot_now > boot_then + BOOT_SLACK) or (
            boot_now is not None and started is not None and boot_now > started + BOOT_SLACK
        )
    disk = agent.disk
    if restarted:
        s.cause = Cause.CONTAINER_RESTART
        s.detail = f"the container restarted at {iso(boot_now)}, after the run started at {s.started_at}"
        s.evidence.append(f"PID 1 started at {iso(boot_now)}; run.json recorded the container boot at {iso(boot_then)}")
    elif disk is not None and disk.full:
        s.cause = Cause.DISK_FULL
        s.detail = (
            f"no exit record and no live process, and the disk holding {disk.path} is full "
            f"({disk.free} bytes free): the run's end could not be recorded"
        )
        if pane and pane.dead == "1" and pane.dead_status:
            s.detail += f"; tmux saw the runner exit with status {pane.dead_status} (the command's code)"
    elif s.tmux.server == "dead":
        s.cause = Cause.TMUX_SERVER_KILLED
        s.detail = (
            "no exit record and no live process, and the tmux server is dead: the run was killed together with it"
        )
    elif s.tmux.session == "missing":
        s.cause = Cause.SESSION_KILLED
        s.detail = "no exit record and no live process, and the session is gone: the run was killed together with it"
    else:
        s.cause = Cause.UNKNOWN
        s.detail = "no exit record and no live process: the runner was killed (SIGKILL, OOM killer...) before it could write exit.json"
    if pane and pane.dead == "1" and pane.dead_signal:
        s.evidence.append(f"tmux: the runner was killed by signal {pane.dead_signal} (pane_dead_signal)")
    oom = agent.oom_kill
    if oom is not None and run.oom_kill is not None and oom > run.oom_kill and not restarted:
        s.evidence.append(
            f"cgroup memory.events oom_kill rose from {run.oom_kill} to {oom}: the host OOM killer is the likely killer"
        )
    _tmux_context(s)


def _how(exit_code: int | None, signal: int | None) -> str:
    return f"signal {signal}" if exit_code is None and signal else f"exit {exit_code}"


def _orphans(s: Status, found: list[wire.Member], stop: wire.StopRecord | None, what: str) -> None:
    """Processes of the run outlived its command and its keeper: the run is not over, and nothing
    supervises it any more (docs/design.md section 6: `crashed`, cause `orphans-left`)."""
    s.state, s.cause = State.CRASHED, Cause.ORPHANS_LEFT
    s.pid = found[0].pid
    s.fingerprint = "orphans-left"
    s.detail = (
        f"{what}, but {_plural(len(found), 'process')} it started still {_run_or_runs(len(found))}: "
        f"{members_text(found)}; "
        "nothing will end them or record their end"
    )
    if stop:
        s.detail += f"; a stop was requested at {stop.requested_at}: run `dflashctl stop` again"
        s.evidence.append(f"stop.json: requested at {stop.requested_at}, yet processes of the run live on")
    for m in found:
        s.evidence.append(
            f"pid {m.pid} (attempt {m.attempt}, state {m.state}, parent {m.ppid}) "
            f"is alive: {' '.join(map(str, m.argv or []))[:160]}"
        )


def _disk_context(s: Status, disk: wire.Disk | None) -> None:
    if disk is not None and disk.full:
        s.evidence.append(
            f"the disk holding {disk.path} is full ({disk.free} bytes free): "
            "the log, metrics and checkpoints cannot grow"
        )


def _tmux_context(s: Status, *, alive: bool = False) -> None:
    tm = s.tmux
    if tm.server == "dead":
        extra = (
            f" but the training process is alive (pid {s.pid}): it survived, SIGHUP is ignored; `dflashctl tail` reads the log"
            if alive
            else ""
        )
        s.evidence.append(f"tmux server is dead ({tm.evidence}){extra}")
    elif tm.session == "missing":
        extra = f" but the training process is alive (pid {s.pid}): it survived, SIGHUP is ignored" if alive else ""
        s.evidence.append(f"tmux session '{s.session}' is gone ({tm.evidence}){extra}")
    elif tm.pane == "dead":
        s.evidence.append("tmux pane is dead (remain-on-exit keeps it for inspection)")


def _classify_by_tmux(
    s: Status, tf: wire.Tmux | None, capture: tuple[str, ...] | None, attempt: wire.Attempt | None
) -> None:
    """No run record (a session started by hand, or fallback mode): tmux is all there is."""
    pane = _pane(tf)
    s.tmux = tmux_view(s.tmux.socket, tf, pane)
    lines = list(capture or [])
    s.tail = lines[-TAIL_KEEP:]
    if attempt is not None:
        s.attempt = attempt.attempt
        log = attempt.log
        s.log = log.path if log else None
        if log and log.tail:
            lines = list(log.tail)
            s.tail = lines[-TAIL_KEEP:]
    tm = s.tmux
    if tm.session == "alive" or (tm.evidence and "no server running" in tm.evidence):
        s.evidence.append("no run record (run.json): this session was not started by `dflashctl start`")
    if tf is None or tf.timed_out:
        s.state, s.cause, s.detail = State.LOST, Cause.UNKNOWN, "tmux did not answer"
        return
    if tm.session == "alive" and pane is not None:
        s.pid = as_int(pane.pid)
        if pane.dead != "1":
            s.state = State.RUNNING
            s.progress = progress_from_lines(lines, None)
            s.evidence.append(
                f"pane process {pane.pid} ({pane.current_command}) is alive; "
                "without a run record progress and hangs cannot be judged"
            )
            return
        status, sig = pane.dead_status or "", pane.dead_signal or ""
        s.exit_code = as_int(status) if status else None
        s.signal = as_int(sig) if sig else None
        s.evidence.append(
            f"tmux: pane_dead=1 pane_dead_status={status or '(empty)'} pane_dead_signal={sig or '(empty)'}"
        )
        if s.exit_code == 0:
            s.state = State.SUCCEEDED
            return
        if s.exit_code is None and s.signal is None:
            # the pty closed but tmux has not reaped the process yet (or tmux < 3.3 and a signal):
            # only the pane's text can say more
            d = diagnose(lines, exit_code=None, signal=None)
            if d.cause == Cause.NONZERO_EXIT:
                s.state, s.cause = State.LOST, Cause.UNKNOWN
                s.detail = "the command ended, but tmux reported neither an exit status nor a signal, and there is no exit record"
                return
            s.state = State.CRASHED
            s.cause, s.detail, s.gpu, s.fingerprint = d.cause, d.detail, d.gpu, d.fingerprint
            s.evidence.extend(d.evidence)
            return
        s.state = State.CRASHED
        d = diagnose(lines, exit_code=s.exit_code, signal=s.signal)
        s.cause, s.detail, s.gpu, s.fingerprint = d.cause, d.detail, d.gpu, d.fingerprint
        s.evidence.extend(d.evidence)
        return
    if tm.server == "dead" and tm.evidence and "no server running" in tm.evidence:
        s.state, s.cause = State.LOST, Cause.UNKNOWN
        s.detail = (
            "the tmux server is gone and there is no exit record. tmux prints `no server running` both "
            "when the server was killed and when the session's command ended and the server exited with it "
            "(its last session closed), so this cannot be called a crash or a kill: only an exit record, "
            "written by a run started with `dflashctl start`, would tell a kill from a normal end"
        )
        s.evidence.append(f"tmux: {tm.evidence} (the socket file exists, no server answers)")
        return
    s.state = State.NOT_STARTED
    if tm.server == "dead":
        s.detail = f"no run and no tmux server on socket {tm.socket}"
    elif tm.session == "missing":
        s.detail = f"no run and no session '{s.session}'"
    else:
        s.detail = f"no run, and tmux says: {tm.evidence}"
    if tm.evidence:
        s.evidence.append(f"tmux: {tm.evidence}")


def _dur(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(max(0, seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
