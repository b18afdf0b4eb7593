"""The far side's answers as the operator reads them: parsed once, at the edge, into frozen types.

Stdlib only: the supervisor on the Proxmox host loads it (tests/ops/test_supervise_host.py). The agent
writes its answers as ops/far/protocol.py declares them; an older or broken one may not, so every key
is read by its type here: a key of the wrong type reads as absent and is named once, ``<where>: <key>:
<why>`` (the classification shows each as an ``unreadable record: ...`` evidence line, as it shows a
record the agent could not read). The run's records go through ``ops.far.records.check``, the agent's
own reader. An empty record is no record (an exit.json whose every key failed tells nothing).
"""

from __future__ import annotations

import dataclasses
import typing as t

from ops.far import records, watch

Problems = list[str]


class Fields:
    """One object's keys read by type: a key that is absent or null is None; one of another type is
    None and one line in ``problems``."""

    def __init__(self, rec: t.Mapping[str, t.Any], where: str, problems: Problems) -> None:
        self.rec, self.where, self.problems = rec, where, problems

    def _kind(self, key: str, kind: str) -> t.Any:
        value = self.rec.get(key)
        if value is None:
            return None
        try:
            return records.fits(kind, value)
        except ValueError as e:
            self.problems.append(f"{self.where}: {key}: {e}")
            return None

    def _bad(self, key: str, expected: str) -> None:
        self.problems.append(f"{self.where}: {key}: expected {expected}")

    def whole(self, key: str) -> int | None:
        return t.cast("int | None", self._kind(key, records.INT))

    def count(self, key: str) -> int | None:
        """A whole number >= 0 (a size, a step)."""
        value = self.whole(key)
        if value is not None and value < 0:
            self._bad(key, "a whole number >= 0")
            return None
        return value

    def number(self, key: str) -> float | None:
        return t.cast("float | None", self._kind(key, records.NUM))

    def flag(self, key: str) -> bool | None:
        return t.cast("bool | None", self._kind(key, records.BOOL))

    def text(self, key: str) -> str | None:
        value = self.rec.get(key)
        if value is None or isinstance(value, str):
            return value
        self._bad(key, "a string")
        return None

    def lines(self, key: str) -> tuple[str, ...]:
        """A list of strings (a log tail), kept whole: diagnose reads all of it."""
        value = self.rec.get(key)
        if value is None:
            return ()
        if isinstance(value, list) and all(isinstance(x, str) for x in value):
            return tuple(value)
        self._bad(key, "a list of strings")
        return ()

    def obj(self, key: str) -> t.Mapping[str, t.Any] | None:
        value = self.rec.get(key)
        if value is None or isinstance(value, dict):
            return value
        self._bad(key, "an object")
        return None

    def objs(self, key: str) -> tuple[t.Mapping[str, t.Any], ...]:
        """A list of objects; entries that are not objects are left out (and named once)."""
        value = self.rec.get(key)
        if value is None:
            return ()
        if not isinstance(value, list):
            self._bad(key, "a list of objects")
            return ()
        if not all(isinstance(x, dict) for x in value):
            self._bad(key, "a list of objects")
        return tuple(x for x in value if isinstance(x, dict))

    def sub(self, key: str) -> Fields | None:
        """The object under ``key`` read the same way; None when it is absent, empty or not an object."""
        rec = self.obj(key)
        return Fields(rec, f"{self.where}.{key}", self.problems) if rec else None


def fields(value: t.Any, where: str, problems: Problems) -> Fields | None:
    """``value`` as an object to read; None when it is absent or empty, a problem when it is no object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(f"{where}: expected an object")
        return None
    return Fields(value, where, problems) if value else None


# --------------------------------------------------------------------------------------------
# A run's records (ops/far/records.py): checked by the agent's reader, then typed


@dataclasses.dataclass(frozen=True, slots=True)
class RunRecord:
    """run.json."""

    attempt: int | None
    started_at: str | None
    started_ts: float | None
    pid: int | None
    child_pid: int | None
    tag: str | None
    oom_kill: int | None
    container_boot: float | None
    container_boot_ticks: int | None
    started_by: t.Mapping[str, t.Any] | None


@dataclasses.dataclass(frozen=True, slots=True)
class ExitRecord:
    """exit.json."""

    exit_code: int | None
    signal: int | None
    ended_at: str | None
    ended_ts: float | None
    oom_kill: int | None
    disk_free: int | None
    disk_full: bool | None
    left: tuple[t.Mapping[str, t.Any], ...]  # what the command left running ({pid, start, argv})
    killed: tuple[t.Mapping[str, t.Any], ...]  # what had to be killed


@dataclasses.dataclass(frozen=True, slots=True)
class StopRecord:
    """stop.json."""

    reason: str | None
    requested_at: str | None


def record_fields(value: t.Any, name: str, problems: Problems) -> Fields | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        problems.append(f"{name}: not a JSON object")
        return None
    rec, found = records.check(name, value)
    problems += found
    return Fields(rec, name, problems) if rec else None


def parse_run(value: t.Any, problems: Problems) -> RunRecord | None:
    f = record_fields(value, records.RUN_JSON, problems)
    if f is None:
        return None
    return RunRecord(
        attempt=f.whole("attempt"),
        started_at=f.text("started_at"),
        started_ts=f.number("started_ts"),
        pid=f.whole("pid"),
        child_pid=f.whole("child_pid"),
        tag=f.text("tag"),
        oom_kill=f.whole("oom_kill"),
        container_boot=f.number("container_boot"),
        container_boot_ticks=f.whole("container_boot_ticks"),
        started_by=f.obj("started_by"),
    )


def parse_exit(value: t.Any, problems: Problems) -> ExitRecord | None:
    f = record_fields(value, records.EXIT_JSON, problems)
    if f is None:
        return None
    return ExitRecord(
        exit_code=f.whole("exit_code"),
        signal=f.whole("signal"),
        ended_at=f.text("ended_at"),
        ended_ts=f.number("ended_ts"),
        oom_kill=f.whole("oom_kill"),
        disk_free=f.whole("disk_free"),
        disk_full=f.flag("disk_full"),
        left=f.objs("left"),
        killed=f.objs("killed"),
    )


def parse_stop(value: t.Any, problems: Problems) -> StopRecord | None:
    f = record_fields(value, records.STOP_JSON, problems)
    if f is None:
        return None
    # an absent reason is a plain stop; a null one is shown as it is
    return StopRecord(reason=f.text("reason") if "reason" in f.rec else "stop", requested_at=f.text("requested_at"))


# --------------------------------------------------------------------------------------------
# An attempt's facts (protocol.AttemptFacts)


@dataclasses.dataclass(frozen=True, slots=True)
class Process:
    """One of the run's three processes (procfs.ProcessFacts): is the recorded (pid, start) alive."""

    pid: int | None
    alive: bool
    state: str | None
    same: bool | None  # the recorded start matches (None: nothing recorded to compare)


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """A live process of the session's runs (protocol.MemberFacts)."""

    pid: int | None
    start: int | None
    ppid: int | None
    state: str | None
    attempt: int | None
    argv: tuple[str, ...] | None

    def named(self) -> dict[str, t.Any]:
        """How status and messages name it: {pid, start, attempt, argv}."""
        argv = None if self.argv is None else list(self.argv)
        return {"pid": self.pid, "start": self.start, "attempt": self.attempt, "argv": argv}


@dataclasses.dataclass(frozen=True, slots=True)
class Log:
    path: str | None
    mtime: float | None
    tail: tuple[str, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Metrics:
    mtime: float | None
    last: t.Mapping[str, t.Any] | None  # the last metrics.jsonl record: the trainer's, read by its readers
    spikes: tuple[Spike, ...] = ()  # its loss-spike records (an older agent sends none)


@dataclasses.dataclass(frozen=True, slots=True)
class Spike:
    """The trainer's loss-spike record (dflash.train.divergence.Spike.record)."""

    step: int
    loss: float | None
    median: float | None
    factor: float | None
    steps: int | None


def _spikes(f: Fields) -> tuple[Spike, ...]:
    out = []
    for rec in f.objs("events"):
        e = Fields(rec, f"{f.where}.events", f.problems)
        step = e.count("step")
        if step is not None:
            out.append(Spike(step, e.number("loss"), e.number("median"), e.number("factor"), e.whole("steps")))
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    dir: str | None
    attempt: int | None
    run: RunRecord | None
    exit: ExitRecord | None
    stop: StopRecord | None
    runner: Process | None
    keeper: Process | None
    child: Process | None
    members: tuple[Member, ...]
    log: Log | None
    metrics: Metrics | None
    errors: tuple[str, ...]  # what the agent could not read, then what did not read here: one line each
    resumed_from: t.Any = None  # history only: the checkpoint its log says it resumed from


def _process(value: t.Any, where: str, problems: Problems) -> Process | None:
    f = fields(value, where, problems)
    if f is None:
        return None
    return Process(pid=f.whole("pid"), alive=bool(f.rec.get("alive")), state=f.text("state"), same=f.flag("same"))


def _member(f: Fields) -> Member:
    argv = f.rec.get("argv")
    return Member(
        pid=f.whole("pid"),
        start=f.whole("start"),
        ppid=f.whole("ppid"),
        state=f.text("state"),
        attempt=f.whole("attempt"),
        argv=tuple(map(str, argv)) if isinstance(argv, list) else None,
    )


def parse_attempt(value: t.Any, where: str = "attempt") -> Attempt | None:
    """An attempt's facts, its records read as the agent reads them (``ops.far.records.check``): an
    older agent sends them unchecked, and a wrong-typed or non-finite value must not reach a figure."""
    if not isinstance(value, dict) or not value:
        return None
    problems: Problems = []
    f = Fields(value, where, problems)
    run = parse_run(value.get("run"), problems)
    exit_rec = parse_exit(value.get("exit"), problems)
    stop = parse_stop(value.get("stop"), problems)
    log, metrics = f.sub("log"), f.sub("metrics")
    raw = value.get("errors")
    errors = [str(e) for e in raw] if isinstance(raw, list) else []
    att = Attempt(
        dir=f.text("dir"),
        attempt=f.whole("attempt"),
        run=run,
        exit=exit_rec,
        stop=stop,
        runner=_process(value.get("runner"), f"{where}.runner", problems),
        keeper=_process(value.get("keeper"), f"{where}.keeper", problems),
        child=_process(value.get("child"), f"{where}.child", problems),
        members=tuple(_member(Fields(m, f"{where}.members", problems)) for m in f.objs("members")),
        log=None if log is None else Log(path=log.text("path"), mtime=log.number("mtime"), tail=log.lines("tail")),
        metrics=None
        if metrics is None
        else Metrics(mtime=metrics.number("mtime"), last=metrics.obj("last"), spikes=_spikes(metrics)),
        errors=(),
        resumed_from=value.get("resumed_from"),
    )
    return dataclasses.replace(att, errors=tuple([*errors, *(p for p in problems if p not in errors)]))


# --------------------------------------------------------------------------------------------
# The probe verb's answer (protocol.ProbeFacts) and what the operator side adds to it


@dataclasses.dataclass(frozen=True, slots=True)
class Pane:
    """One tmux pane (ops.far.tmux.PANE_FIELDS); a field tmux did not give is None."""

    dead: str | None
    dead_status: str | None
    dead_signal: str | None
    pid: str | None
    current_command: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Tmux:
    exit_code: int | None
    stderr: str | None
    timed_out: bool
    installed: bool | None
    panes: tuple[Pane, ...]

    def pane(self, pid: int | None = None) -> Pane | None:
        """The run's pane: the one whose process is ``pid``, else the first one."""
        for p in self.panes:
            if pid is not None and p.pid == str(pid):
                return p
        return self.panes[0] if self.panes else None


@dataclasses.dataclass(frozen=True, slots=True)
class Disk:
    path: str | None
    free: int | None
    full: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as nvidia-smi told the agent (protocol.GpuFacts)."""

    index: int | None
    name: str | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    utilization_pct: float | None
    pci_bus_id: str | None = None  # 00000000:3B:00.0 (an agent older than gpu-fault does not say)

    def to_json(self) -> dict[str, t.Any]:
        """The GPU as the agent said it: ``pci_bus_id`` only where nvidia-smi gave one."""
        d = dataclasses.asdict(self)
        if d["pci_bus_id"] is None:
            del d["pci_bus_id"]
        return d


# --------------------------------------------------------------------------------------------
# The probe's side facts: the kernel log, the checkpoints, the supervisor's heartbeat


@dataclasses.dataclass(frozen=True, slots=True)
class KernelLog:
    """ops/far/kernel_log.py's answer: the NVRM lines of a kernel log, or why it could not be read."""

    source: str | None
    lines: tuple[str, ...]
    error: str | None


def parse_kernel(value: t.Any, where: str, problems: Problems) -> KernelLog | None:
    f = fields(value, where, problems)
    return None if f is None else KernelLog(f.text("source"), f.lines("lines"), f.text("error"))


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointEntry:
    """One checkpoint of the run's folder (its manifest read): step, size, the run that wrote it."""

    step: int
    bytes: int
    run_id: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class SyncLast:
    ok: bool
    step: int | None
    at: str | None
    error: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class SyncRecord:
    """``[checkpoint] sync`` as the trainer recorded it: its program, failures in a row, its last run."""

    command: str | None
    failures: int | None
    last: SyncLast | None


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """The trainer's checkpointing.json: the run, checkpoint.keep, the warning threshold, the last
    checkpoint skipped for want of room, the sync (None: none configured)."""

    run_id: str | None
    keep: int | None
    disk_warn_bytes: int | None
    skipped_step: int | None
    sync: SyncRecord | None


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointFacts:
    """ops/far/checkpoints.py's answer (protocol.ProbeFacts ``checkpoints``)."""

    dir: str | None
    record: CheckpointRecord | None
    free: int | None
    checkpoints: tuple[CheckpointEntry, ...]
    best_step: int | None
    error: str | None


def _sync(f: Fields | None) -> SyncRecord | None:
    if f is None:
        return None
    last = f.sub("last")
    return SyncRecord(
        command=f.text("command"),
        failures=f.count("failures"),
        last=None
        if last is None
        else SyncLast(last.rec.get("ok") is True, last.count("step"), last.text("at"), last.text("error")),
    )


def parse_checkpoints(value: t.Any, where: str, problems: Problems) -> CheckpointFacts | None:
    f = fields(value, where, problems)
    if f is None:
        return None
    rec = f.sub("record")
    found = []
    for c in f.objs("checkpoints"):
        cf = Fields(c, f"{where}.checkpoints", problems)
        step, size = cf.count("step"), cf.count("bytes")
        if step is not None and size is not None:
            found.append(CheckpointEntry(step, size, cf.text("run_id")))
    skipped = rec.sub("skipped") if rec is not None else None
    return CheckpointFacts(
        dir=f.text("dir"),
        record=None
        if rec is None
        else CheckpointRecord(
            run_id=rec.text("run_id"),
            keep=rec.count("keep"),
            disk_warn_bytes=rec.count("disk_warn_bytes"),
            skipped_step=skipped.count("step") if skipped is not None else None,
            sync=_sync(rec.sub("sync")),
        ),
        free=f.count("free"),
        checkpoints=tuple(found),
        best_step=f.count("best_step"),
        error=f.text("error"),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """supervisor.json (ops/far/watch.py): who watches the run. ``problem``: why its lease cannot be read
    (the agent could not read the file, ``at`` or ``interval`` is not a usable number); such a record
    holds no lease."""

    id: str | None
    by: str | None
    where: str | None
    mode: str | None
    pid: int | None
    interval: float | None
    started_at: float | None
    at: float | None
    stopped: bool
    last_action: t.Mapping[str, t.Any] | None
    problem: str | None

    def unreadable(self, now: float | None) -> str | None:
        """``problem``, or ``at`` ahead of the container's clock (watch.unreadable's rule)."""
        if self.problem is not None or now is None or self.at is None:
            return self.problem
        return watch.unreadable({"at": self.at, "interval": self.interval}, now)

    def silent_for(self, now: float) -> float | None:
        return watch.silent_for({"at": self.at}, now)

    def live(self, now: float) -> bool:
        return not self.stopped and watch.live(
            {"at": self.at, "interval": self.interval, "unreadable": self.problem}, now
        )

    def named(self) -> dict[str, t.Any]:
        """How a message names its holder (``ops.supervise.heartbeat.holder_text``)."""
        said = {"by": self.by, "mode": self.mode, "pid": self.pid, "where": self.where, "at": self.at}
        return {k: v for k, v in said.items() if v is not None}


def parse_heartbeat(value: t.Any, where: str, problems: Problems) -> Heartbeat | None:
    if not isinstance(value, dict) or not value:
        return None
    f = Fields(value, where, problems)
    return Heartbeat(
        id=f.text("id"),
        by=f.text("by"),
        where=f.text("where"),
        mode=f.text("mode"),
        pid=f.whole("pid"),
        interval=watch.number(value.get("interval"), 0.0, watch.MAX_INTERVAL),
        started_at=watch.number(value.get("started_at"), 0.0, watch.MAX_TIME),
        at=watch.number(value.get("at"), 0.0, watch.MAX_TIME),
        stopped=bool(value.get("stopped")),
        last_action=f.obj("last_action"),
        problem=watch.unreadable(value, None),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    now: float | None
    pid1_start: float | None
    pid1_ticks: int | None
    oom_kill: int | None
    disk: Disk | None
    tmux: Tmux | None
    attempt: Attempt | None
    capture: tuple[str, ...] | None  # the pane's lines, when there is no run record
    foreign_run: str | None
    gpus: tuple[Gpu, ...] | None  # None: not sampled (no nvidia-smi), or it failed
    gpu_error: str | None  # nvidia-smi failed: what it said
    supervisor: Heartbeat | None
    has_supervisor: bool  # an agent older than the heartbeat does not say (then: unknown)
    kernel: KernelLog | None  # a crashed attempt's container kernel log (ops/far/kernel_log.py)
    checkpoints: CheckpointFacts | None  # None: an agent older than the checkpoint facts


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    cause: str | None
    detail: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class Fallback:
    reason: str | None
    tmux: Tmux | None
    capture: tuple[str, ...] | None


@dataclasses.dataclass(frozen=True, slots=True)
class Facts:
    """Every fact `status` classifies (``ops.session.gather``): the probe's answer and how it went."""

    host: str
    session: str
    socket: str | None
    container_id: int | None
    hang_after: float
    startup_grace: float
    checked_at: float | None
    mode: str
    unreachable: Fault | None
    container_down: Fault | None
    agent_timeout: str | None
    agent: Probe | None
    fallback: Fallback | None
    problems: tuple[str, ...]  # what did not read, beside the attempt's own errors
    # the Proxmox host's kernel log (ops/far/kernel_log.py's answer), read where dflashctl runs on the host
    host_kernel: KernelLog | None = None


def parse_tmux(value: t.Any, where: str, problems: Problems) -> Tmux | None:
    if value is None:
        return None
    f = fields(value, where, problems) or Fields({}, where, problems)
    panes = []
    for p in f.objs("panes"):
        pf = Fields(p, f"{where}.panes", problems)
        panes.append(
            Pane(
                dead=pf.text("pane_dead"),
                dead_status=pf.text("pane_dead_status"),
                dead_signal=pf.text("pane_dead_signal"),
                pid=pf.text("pane_pid"),
                current_command=pf.text("pane_current_command"),
            )
        )
    return Tmux(
        exit_code=f.whole("exit_code"),
        stderr=f.text("stderr"),
        timed_out=bool(f.rec.get("timed_out")),
        installed=f.flag("installed"),
        panes=tuple(panes),
    )


def _capture(value: t.Any, where: str, problems: Problems) -> tuple[str, ...] | None:
    f = fields(value, where, problems)
    return None if f is None else f.lines("lines")


def _gpu(f: Fields) -> Gpu:
    return Gpu(
        index=f.whole("index"),
        name=f.text("name"),
        memory_used_mib=f.number("memory_used_mib"),
        memory_total_mib=f.number("memory_total_mib"),
        utilization_pct=f.number("utilization_pct"),
        pci_bus_id=f.text("pci_bus_id"),
    )


def parse_probe(answer: dict[str, t.Any], problems: Problems) -> Probe:
    """The probe verb's answer."""
    f = Fields(answer, "probe", problems)
    gpus = answer.get("gpus")
    gpu_error, gpu_list = None, None
    if isinstance(gpus, dict):
        gpu_error = Fields(gpus, "probe.gpus", problems).text("error")
    elif gpus is not None:
        gpu_list = tuple(_gpu(Fields(g, "probe.gpus", problems)) for g in f.objs("gpus"))
    disk = f.sub("disk")
    return Probe(
        now=f.number("now"),
        pid1_start=f.number("pid1_start"),
        pid1_ticks=f.whole("pid1_ticks"),
        oom_kill=f.whole("oom_kill"),
        disk=None if disk is None else Disk(disk.text("path"), disk.whole("free"), bool(disk.rec.get("full"))),
        tmux=parse_tmux(answer.get("tmux"), "probe.tmux", problems),
        attempt=parse_attempt(answer.get("attempt"), "probe.attempt"),
        capture=_capture(answer.get("pane_capture"), "probe.pane_capture", problems),
        foreign_run=answer.get("foreign_run") if isinstance(answer.get("foreign_run"), str) else None,
        gpus=gpu_list,
        gpu_error=gpu_error,
        supervisor=parse_heartbeat(answer.get("supervisor"), "probe.supervisor", problems),
        has_supervisor="supervisor" in answer,
        kernel=parse_kernel(answer.get("kernel"), "probe.kernel", problems),
        checkpoints=parse_checkpoints(answer.get("checkpoints"), "probe.checkpoints", problems),
    )


def _fault(value: t.Any, where: str, problems: Problems) -> Fault | None:
    f = fields(value, where, problems)
    return None if f is None else Fault(f.text("cause"), f.text("detail"))


def _or(value: str | None, default: str) -> str:
    return default if value is None else value


def parse_facts(facts: t.Mapping[str, t.Any]) -> Facts:
    """What ``ops.session.gather`` assembled (or a recorded fact set: ``dflashctl status --facts``)."""
    problems: Problems = []
    f = Fields(facts, "facts", problems)
    agent = facts.get("agent")
    fb = facts.get("fallback")
    fallback = None
    if agent is None:
        fbf = fields(fb, "facts.fallback", problems) or Fields({}, "facts.fallback", problems)
        fallback = Fallback(
            reason=fbf.text("reason"),
            tmux=parse_tmux(fbf.rec.get("tmux"), "fallback.tmux", problems),
            capture=_capture(fbf.rec.get("pane_capture"), "fallback.pane_capture", problems),
        )
    elif not isinstance(agent, dict):
        problems.append("facts: agent: expected an object")
        agent = {}
    hang, grace = f.number("hang_after"), f.number("startup_grace")
    host_kernel = parse_kernel(facts.get("host_kernel"), "facts.host_kernel", problems)
    probe = None if agent is None else parse_probe(agent, problems)
    return Facts(
        host=_or(f.text("host"), "?"),
        session=_or(f.text("session"), "?"),
        socket=f.text("socket"),
        container_id=f.whole("container_id"),
        hang_after=900.0 if hang is None else float(hang),
        startup_grace=1200.0 if grace is None else float(grace),
        checked_at=f.number("checked_at"),
        mode=_or(f.text("mode"), "agent"),
        unreachable=_fault(facts.get("unreachable"), "facts.unreachable", problems),
        container_down=_fault(facts.get("container_down"), "facts.container_down", problems),
        agent_timeout=f.text("agent_timeout") or None,
        agent=probe,
        fallback=fallback,
        problems=tuple(problems),
        host_kernel=host_kernel,
    )


# --------------------------------------------------------------------------------------------
# The history verb's answer


@dataclasses.dataclass(frozen=True, slots=True)
class HistoryAnswer:
    """Every attempt's facts, oldest first (what ``probe`` gives of the current one)."""

    attempts: tuple[Attempt, ...]
    total: int  # attempts in the session dir (``last`` shows fewer)
    now: float | None
    pid1_start: float | None
    pid1_ticks: int | None


def parse_history(answer: t.Mapping[str, t.Any]) -> HistoryAnswer:
    """The history verb's answer; an attempt that is not an object is left out (it has no row)."""
    problems: Problems = []
    f = Fields(answer, "history", problems)
    raw = answer.get("attempts")
    attempts = [parse_attempt(a) for a in raw] if isinstance(raw, list) else []
    return HistoryAnswer(
        attempts=tuple(a for a in attempts if a is not None),
        total=f.whole("total") or 0,
        now=f.number("now"),
        pid1_start=f.number("pid1_start"),
        pid1_ticks=f.whole("pid1_ticks"),
    )


# --------------------------------------------------------------------------------------------
# The answers of the supervisor service on the Proxmox host (ops/supervise/service.py)


@dataclasses.dataclass(frozen=True, slots=True)
class LastProbe:
    at: str | None
    headline: str | None
    decision: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class LastAction:
    at: str | None
    action: str | None
    outcome: str | None
    state: str | None
    cause: str | None
    attempt: int | None
    next_attempt: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class IncidentGist:
    time: str | None
    action: str | None
    outcome: str | None
    state: str | None
    cause: str | None
    attempt: int | None
    next_attempt: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorStatus:
    """The host service's ``status``: whether a supervisor is installed and runs, and what it last did."""

    installed: bool
    message: str | None  # why it is not known (the call failed)
    running: bool
    pid: int | None
    since: str | None
    mode: str | None  # systemd | tmux
    tmux_socket: str | None
    options: t.Mapping[str, t.Any] | None  # the policy it was installed with
    installed_at: str | None
    release: str | None
    unit: t.Mapping[str, t.Any]  # systemctl's properties, or {"tmux_session": alive | missing}
    probes: int | None
    last_probe: LastProbe | None
    last_action: LastAction | None
    error: str | None  # what it ended on
    incidents: int
    newest: tuple[IncidentGist, ...]
    log: str | None
    problems: tuple[str, ...]


def _action(f: Fields | None) -> LastAction | None:
    if f is None:
        return None
    return LastAction(
        at=f.text("at"),
        action=f.text("action"),
        outcome=f.text("outcome"),
        state=f.text("state"),
        cause=f.text("cause"),
        attempt=f.whole("attempt"),
        next_attempt=f.whole("next_attempt"),
    )


def _gist(f: Fields) -> IncidentGist:
    return IncidentGist(
        time=f.text("time"),
        action=f.text("action"),
        outcome=f.text("outcome"),
        state=f.text("state"),
        cause=f.text("cause"),
        attempt=f.whole("attempt"),
        next_attempt=f.whole("next_attempt"),
    )


def parse_supervisor_status(answer: t.Mapping[str, t.Any]) -> SupervisorStatus:
    problems: Problems = []
    f = Fields(answer, "supervise status", problems)
    service = f.sub("service") or Fields({}, "service", problems)
    st = f.sub("status") or Fields({}, "status", problems)
    probe, inc = st.sub("last_probe"), f.sub("incidents") or Fields({}, "incidents", problems)
    return SupervisorStatus(
        installed=bool(answer.get("installed")),
        message=f.text("message"),
        running=bool(answer.get("running")),
        pid=f.whole("pid"),
        since=f.text("since"),
        mode=service.text("mode"),
        tmux_socket=service.text("tmux_socket"),
        options=service.obj("options"),
        installed_at=service.text("installed_at"),
        release=service.text("release"),
        unit=f.obj("unit") or {},
        probes=st.whole("probes"),
        last_probe=None
        if probe is None
        else LastProbe(probe.text("at"), probe.text("headline"), probe.text("decision")),
        last_action=_action(st.sub("last_action")),
        error=st.text("error"),
        incidents=inc.whole("count") or 0,
        newest=tuple(_gist(Fields(i, "incidents.newest", problems)) for i in inc.objs("newest")),
        log=f.text("log"),
        problems=tuple(problems),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorInstalled:
    """The host service's ``install``."""

    mode: str | None
    unit: str | None
    tmux_socket: str | None
    pid: int | None
    updated: bool
    replaced_running: bool  # a supervisor ran before and was replaced
    replaced_pid: int | None
    command: tuple[str, ...]
    first_probe: LastProbe | None
    notes: tuple[str, ...]
    log: str | None
    problems: tuple[str, ...]


def parse_supervisor_installed(answer: t.Mapping[str, t.Any]) -> SupervisorInstalled:
    problems: Problems = []
    f = Fields(answer, "supervise install", problems)
    replaced, first = f.sub("replaced"), f.sub("first_probe")
    return SupervisorInstalled(
        mode=f.text("mode"),
        unit=f.text("unit"),
        tmux_socket=f.text("tmux_socket"),
        pid=f.whole("pid"),
        updated=bool(answer.get("updated")),
        replaced_running=bool(replaced.rec.get("was_running")) if replaced else False,
        replaced_pid=replaced.whole("pid") if replaced else None,
        command=f.lines("command"),
        first_probe=None
        if first is None
        else LastProbe(first.text("at"), first.text("headline"), first.text("decision")),
        notes=f.lines("notes"),
        log=f.text("log"),
        problems=tuple(problems),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class SupervisorStopped:
    """The host service's ``stop`` and ``uninstall``."""

    mode: str | None
    pid: int | None
    was_running: bool
    stopped: bool
    removed: tuple[str, ...]  # uninstall: what it removed
    kept: str | None  # uninstall: the folder kept (incidents, memory, its log)
    problems: tuple[str, ...]


def parse_supervisor_stopped(answer: t.Mapping[str, t.Any]) -> SupervisorStopped:
    problems: Problems = []
    f = Fields(answer, "supervise stop", problems)
    return SupervisorStopped(
        mode=f.text("mode"),
        pid=f.whole("pid"),
        was_running=bool(answer.get("was_running")),
        stopped=bool(answer.get("stopped")),
        removed=f.lines("removed"),
        kept=f.text("kept"),
        problems=tuple(problems),
    )
