"""The far side's protocol, typed: the request/answer envelope and the agent's facts. stdlib only.

Every far-side verb (the agent's probe/start/stop/tail/read, the release program's
inspect/install/rollback) takes ONE JSON object and answers ONE JSON object on stdout:

    {"ok": true,  "protocol": 1, "verb": "probe", ...the verb's answer...}
    {"ok": false, "protocol": 1, "verb": "start", "error": "<kind>", "message": "<one line>", ...}

The operator side reads it with ``ops.far_call`` and parses each answer once into ``ops.wire``'s
frozen types (``dflashctl status --facts`` prints the probe's facts as they came). A refusal's kind is
one of ``ops.far.refusal``'s names. ``tmux_facts`` is the one reading of tmux's
session and panes, used by the agent and by the operator's raw fallback alike.
"""

from __future__ import annotations

import time
import typing as t

from ops.far import tmux
from ops.far.procfs import ProcessFacts

PROTOCOL = 1


class Envelope(t.TypedDict, total=False):
    ok: t.Required[bool]
    protocol: int
    verb: str
    error: str  # when not ok: the kind, one of ops.far.refusal's names
    message: str  # when not ok: one line for a person


# --------------------------------------------------------------------------------------------
# The agent's facts (probe)

Pane = dict[str, str]  # ops.far.tmux.PANE_FIELDS -> value


class TmuxFacts(t.TypedDict):
    socket: str
    exit_code: int | None
    stderr: str
    timed_out: bool
    installed: bool
    panes: list[Pane]


class CaptureFacts(t.TypedDict):
    exit_code: int | None
    stderr: str
    lines: list[str]


class LogFacts(t.TypedDict, total=False):
    path: t.Required[str]
    size: int
    mtime: float
    tail: list[str]
    error: str


class MetricsFacts(t.TypedDict, total=False):
    path: t.Required[str]
    size: int
    mtime: float
    last: dict[str, t.Any] | None
    events: list[dict[str, t.Any]]  # the trainer's loss-spike records among the file's last lines
    error: str


class MemberFacts(t.TypedDict):
    """A live process of the session's runs (ops/far/members.py), as the agent found it."""

    pid: int
    start: int  # clock ticks since boot: (pid, start) is the process
    ppid: int
    pgid: int
    sid: int
    state: str
    attempt: int | None  # the attempt its tag names (None: found below the keeper, without a tag)
    argv: list[str]  # its first words, cut


class AttemptFacts(t.TypedDict, total=False):
    dir: t.Required[str]
    attempt: t.Required[int | None]
    run: dict[str, t.Any] | None  # run.json as the runner wrote it
    exit: dict[str, t.Any] | None  # exit.json
    stop: dict[str, t.Any] | None  # stop.json
    runner: ProcessFacts | None
    keeper: ProcessFacts | None
    child: ProcessFacts | None
    # every live process of the session's runs (tagged, or below the live keeper); [] for a runner that
    # tags nothing (run.json without "tag")
    members: list[MemberFacts]
    log: LogFacts | None
    metrics: MetricsFacts | None
    errors: list[str]


class DiskFacts(t.TypedDict):
    path: str
    free: int
    full: bool


class GpuFacts(t.TypedDict):
    index: int
    name: str
    memory_used_mib: float | None
    memory_total_mib: float | None
    utilization_pct: float | None
    pci_bus_id: t.NotRequired[str]  # 00000000:3B:00.0


class ProbeFacts(t.TypedDict):
    """The probe verb's answer (less the envelope)."""

    disk: DiskFacts | None
    # the run's checkpoints (ops/far/checkpoints.py): dir, record (the trainer's checkpointing.json), free,
    # checkpoints [{step, bytes, run_id}], truncated, best_step, error; absent from an older agent's answer
    checkpoints: dict[str, t.Any]
    now: float
    supervisor: dict[str, t.Any] | None  # the heartbeat record of who watches the run (ops/far/watch.py)
    heartbeat: dict[str, t.Any] | None  # what became of the request's heartbeat (None: it carried none)
    hostname: str
    pid1_start: float | None
    pid1_ticks: int | None
    oom_kill: int | None
    tmux: TmuxFacts
    attempt: AttemptFacts | None
    pane_capture: CaptureFacts | None
    foreign_run: str | None  # the pane's runner's attempt dir, when it is another run_dir's (no record here)
    gpus: list[GpuFacts] | dict[str, str] | None
    kernel: dict[str, t.Any] | None  # a crashed attempt's NVRM kernel log lines (ops/far/kernel_log.py)


class RunResult(t.NamedTuple):
    """One finished command, as both sides see it (the agent's subprocess, the operator's Remote.run)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool


def tmux_facts(run: t.Callable[[list[str]], RunResult], socket: str, session: str, tmux_bin: str = "tmux") -> TmuxFacts:
    """Server, session and panes in ONE tmux call (has-session ; list-panes), with the exact stderr.
    ``run`` runs an argv where tmux is (the agent: a subprocess; the raw fallback: ``Remote.run``)."""
    argv = tmux.panes_argv(socket, session, tmux_bin)
    for _ in range(4):
        res = run(argv)
        # tmux marks a pane dead when its pty closes, a moment before it reaps the process: in that
        # window pane_dead=1 with neither status nor signal. Ask again rather than report "unknown".
        if res.exit_code != 0 or not any(status_pending(p) for p in tmux.parse_panes(res.stdout)):
            break
        time.sleep(0.05)
    return {
        "socket": socket,
        "exit_code": res.exit_code,
        "stderr": res.stderr.strip(),
        "timed_out": res.timed_out,
        "installed": not tmux.not_found(res.exit_code, res.stderr),
        "panes": tmux.parse_panes(res.stdout) if res.exit_code == 0 else [],
    }


def status_pending(pane: Pane) -> bool:
    return pane.get("pane_dead") == "1" and not pane.get("pane_dead_status") and not pane.get("pane_dead_signal")
