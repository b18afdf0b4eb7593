"""The agent: runs inside the container (or on this machine) and answers one JSON object per call.

    <python> -I -S -c BOOT <workdir>/current <probe|start|stop|tail|read|history|checkpoint|fetch> --json  < request.json

(``ops.session.agent_argv``; by hand, ``python -m ops.far.agent probe --json < request.json`` does the same.)

The request is ONE JSON object on stdin (session, socket, run_dir, workdir, python, command, env,
options), so no user value is ever quoted into a command line. stdlib only (it runs with whatever
python the container has): tmux is called directly rather than through libtmux because libtmux waits
on tmux with no timeout and hides the stderr texts that are our evidence. Every subprocess call has a
timeout, so the agent never hangs; probing never raises because something is down.

The operator side of the protocol (``agent_argv``, ``call``) is in ops/session.py.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import typing as t

from ops.far import (
    admission,
    checkpoints,
    kernel_log,
    members,
    nvidia_smi,
    protocol,
    records,
    refusal,
    request,
    tmux,
    watch,
)
from ops.far import history as far_history
from ops.far.admission import SessionLock, disk_refusal
from ops.far.atomic import write_json_atomic
from ops.far.logs import TAIL_WINDOW, log_facts, metrics_facts, tail_bytes
from ops.far.procfs import ProcessFacts, oom_kill_count, pid1_start, process_facts
from ops.far.protocol import (
    PROTOCOL,
    AttemptFacts,
    CaptureFacts,
    MemberFacts,
    Pane,
    ProbeFacts,
    RunResult,
    TmuxFacts,
)
from ops.far.records import (
    ENV_FILE,
    EXIT_JSON,
    EXIT_RESERVED,
    LOG,
    METRICS,
    RUN_JSON,
    RUN_RESERVED,
    STARTED_BY,
    STOP_JSON,
)
from ops.far.records import attempt_number as _attempt_number
from ops.far.records import read_json as _read_json
from ops.far.refusal import Refused
from ops.far.runner import DISK_FULL_BYTES, disk_facts, iso, reserve

VERBS = ("probe", "start", "stop", "tail", "read", "history", "checkpoint", "fetch")
TMUX_TIMEOUT = 10.0
DIAG_LINES = 200  # log lines the probe brings back for diagnosis
STEP_LINES = 20  # `history`: log lines of an attempt that did not crash (its last step, when it wrote no metrics)
FOLLOW_CHUNK = 1 << 20  # at most this many bytes per `tail -f` poll
READ_CAP = 4 << 20  # `read`: at most this many bytes of metrics.jsonl per call, all attempts together
MAX_LINES = 10_000  # `tail -n` above this shows this many

Request = t.Mapping[str, t.Any]


# --------------------------------------------------------------------------------------------
# Running tmux (and friends) with a timeout


def _tmux_env(req: Request) -> dict[str, str]:
    """The environment tmux (and so the server and every pane) gets: no $TMUX, we are not inside a pane
    (pct exec keeps the ssh session's environment, so an operator inside tmux would leak it)."""
    env = dict(os.environ)
    for key in ("TMUX", "TMUX_PANE"):
        env.pop(key, None)
    return env


def _run(
    argv: t.Sequence[str], *, timeout: float = TMUX_TIMEOUT, env: dict[str, str] | None = None
) -> dict[str, t.Any]:
    """{exit_code, stdout, stderr, timed_out}; a missing program is exit 127, never an exception."""
    try:
        p = subprocess.run(
            list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, env=env, check=False
        )
    except FileNotFoundError as e:
        return {"exit_code": 127, "stdout": "", "stderr": f"{argv[0]}: {e.strerror}", "timed_out": False}
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode("utf-8", "replace") if isinstance(e.stderr, bytes) else ""
        return {"exit_code": None, "stdout": "", "stderr": err, "timed_out": True}
    return {
        "exit_code": p.returncode,
        "stdout": p.stdout.decode("utf-8", "replace"),
        "stderr": p.stderr.decode("utf-8", "replace"),
        "timed_out": False,
    }


def tmux_facts(req: Request) -> TmuxFacts:
    """Server, session and panes in ONE tmux call, with the exact stderr (``ops.far.protocol.tmux_facts``)."""
    env = _tmux_env(req)

    def run(argv: list[str]) -> RunResult:
        res = _run(argv, env=env)
        return RunResult(res["exit_code"], res["stdout"], res["stderr"], res["timed_out"])

    return protocol.tmux_facts(run, req["socket"], req["session"], req.get("tmux", "tmux"))


def _session_alive(tf: TmuxFacts) -> bool:
    return tf["exit_code"] == 0


def _pane(tf: TmuxFacts, pid: int | None = None) -> Pane | None:
    """The run's pane: the one whose process is our runner, else the first one."""
    panes = tf.get("panes") or []
    for p in panes:
        if pid is not None and p.get("pane_pid") == str(pid):
            return p
    return panes[0] if panes else None


def capture(req: Request, lines: int) -> CaptureFacts:
    res = _run(tmux.capture_argv(req["socket"], req["session"], lines, req.get("tmux", "tmux")), env=_tmux_env(req))
    rows = res["stdout"].split("\n") if res["exit_code"] == 0 else []
    return {"exit_code": res["exit_code"], "stderr": res["stderr"].strip(), "lines": tmux.last_lines(rows, lines)}


# --------------------------------------------------------------------------------------------
# The run's records on disk


def session_dir(req: Request) -> str:
    return os.path.join(req["run_dir"], req["session"])


def current_attempt(req: Request) -> str | None:
    """The attempt dir `current` points to, else the highest attempt-<n>, else None."""
    return records.current_attempt(session_dir(req))


def session_members(req: Request, run: t.Mapping[str, t.Any] | None = None) -> list[members.Member]:
    """Every live process of this session's runs (``ops.far.members.of_session``)."""
    return members.of_session(req["session"], session_dir(req), run)


def attempt_facts(req: Request, lines: int = DIAG_LINES) -> AttemptFacts | None:
    adir = current_attempt(req)
    return None if adir is None else facts_of(adir, lines, req)


def numbered_attempts(sdir: str) -> list[tuple[int, str]]:
    """The session dir's attempt dirs as (number, name), oldest first; none when it does not exist yet."""
    try:
        names = os.listdir(sdir)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise Refused(refusal.RUN_DIR, f"cannot list {sdir}: {e.strerror or e}") from None
    return sorted((n, name) for name in names if (n := _attempt_number(name)) is not None)


def facts_of(adir: str, lines: int = DIAG_LINES, req: Request | None = None) -> AttemptFacts:
    """One attempt dir's records, its processes' liveness, the log's last ``lines`` and the last metrics record;
    with the session's request, its live members too (the current attempt's probe; history needs none)."""
    errors: list[str] = []
    found: dict[str, dict[str, t.Any] | None] = {}
    for key, name in (("run", RUN_JSON), ("exit", EXIT_JSON), ("stop", STOP_JSON)):
        found[key], problems = records.read_record(os.path.join(adir, name))
        errors.extend(problems)
    run = found["run"] or {}
    return {
        "dir": adir,
        "attempt": _attempt_number(os.path.basename(adir)),
        "run": found["run"],
        "exit": found["exit"],
        "stop": found["stop"],
        "runner": process_facts(run.get("pid"), run.get("pid_start")),
        "keeper": process_facts(run.get("keeper_pid"), run.get("keeper_start")),
        "child": process_facts(run.get("child_pid"), run.get("child_start")),
        "members": members.facts(session_members(req, run)) if req is not None else [],
        "log": log_facts(os.path.join(adir, LOG), lines),
        "metrics": metrics_facts(os.path.join(adir, METRICS)),
        "errors": errors,
    }


def _alive(af: AttemptFacts | None) -> ProcessFacts | None:
    """The live process of an attempt (the command first, then its keeper and runner), or None."""
    if not af or af.get("exit"):
        return None
    for p in (af.get("child"), af.get("keeper"), af.get("runner")):
        if p and p["alive"]:
            return p
    return None


def _leftovers(af: AttemptFacts | None) -> list[MemberFacts]:
    """Processes of the session's runs that live on though no run of it is alive (their command and
    keeper are gone, or its exit record is written): what a start must not run beside."""
    if af is None or _alive(af) is not None:
        return []
    return list(af.get("members") or [])


# --------------------------------------------------------------------------------------------
# Verbs


def probe(req: Request) -> ProbeFacts:
    """Every fact the classification needs, in one call."""
    gpus = nvidia_smi.start()
    tf = tmux_facts(req)
    lines = min(int(req.get("lines", DIAG_LINES)), MAX_LINES)
    af = attempt_facts(req, lines)
    pane_capture = foreign = None
    if (af is None or af.get("run") is None) and _session_alive(tf):
        # no run record (a session started by hand): the pane is the only log there is
        pane_capture, foreign = capture(req, lines), members.foreign_run(_pane(tf), session_dir(req))
    boot, boot_ticks = pid1_start()
    now = time.time()
    # Who watches the run (ops/far/watch.py): a supervisor's probe carries its heartbeat, written here.
    heartbeat = watch.beat(session_dir(req), req["heartbeat"], now) if req.get("heartbeat") is not None else None
    return {
        "disk": disk_facts(req["run_dir"]),
        # optional (an older agent sends none): sizes and free space for status's low-disk flag and sync
        "checkpoints": checkpoints.checkpoint_facts(
            af["dir"] if af else None, os.path.join(session_dir(req), "checkpoints")
        ),
        "now": now,
        "supervisor": watch.read(session_dir(req)),
        "heartbeat": heartbeat,
        "hostname": os.uname().nodename,
        "pid1_start": boot,
        "pid1_ticks": boot_ticks,
        "oom_kill": oom_kill_count(),
        "tmux": tf,
        "attempt": af,
        "pane_capture": pane_capture,
        "foreign_run": foreign,
        "gpus": nvidia_smi.finish(gpus),
        "kernel": kernel_log.of_failed(af),  # a crash's only (an LXC usually may not read it: no evidence)
    }


def _describe(af: AttemptFacts, live: ProcessFacts) -> str:
    run = af.get("run") or {}
    started = run.get("started_at")
    return f"attempt {af.get('attempt')}, pid {live['pid']}" + (f", started {started}" if started else "")


def _prepare_attempt(adir: str, env: t.Mapping[str, str], started_by: t.Mapping[str, t.Any] | None = None) -> str:
    """What the runner needs before it starts: an empty log, room for run.json and exit.json (so a
    disk that fills up later cannot lose them, and a full disk fails HERE, cleanly), who started it
    (for run.json's ``started_by``), and the run's environment in a 0600 file it reads and unlinks.
    Returns that file's path."""
    os.close(os.open(os.path.join(adir, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
    reserve(os.path.join(adir, RUN_RESERVED))
    reserve(os.path.join(adir, EXIT_RESERVED))
    if started_by is not None:
        write_json_atomic(os.path.join(adir, STARTED_BY), dict(started_by))
    path = os.path.join(adir, ENV_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dict(env), f)
        f.flush()
        os.fsync(fd)
    return path


def start(req: Request) -> dict[str, t.Any]:
    admission.validate_start(req)
    current = os.path.join(req["workdir"], "current")
    if not os.path.isdir(current):
        raise Refused(refusal.NOT_DEPLOYED, f"nothing is deployed at {current}: run `dflashctl deploy` first")
    with SessionLock(session_dir(req), req, "start"):
        return _start_locked(req, current)


def _start_locked(req: Request, current: str) -> dict[str, t.Any]:
    """Check, then make the new run, and only once it exists take the session name over and point
    `current` at it: a start that fails leaves the previous attempt, its pane and `current` as they were."""
    release = os.path.basename(os.path.realpath(current))
    session, socket_name = req["session"], req["socket"]
    start_id = admission.start_id(req)
    sdir = session_dir(req)
    admission.prune_cancelled(sdir)
    if start_id is not None and os.path.exists(admission.cancel_mark(sdir, start_id)):
        # the dflashctl that asked for this start was interrupted, and its stop got here first
        raise Refused(refusal.CANCELLED, f"this start of session '{session}' was cancelled (Ctrl-C) before it ran")
    replaced = _clear_the_way(req, sdir)
    n, adir, env_file = _new_attempt(req, sdir)
    runner = _runner_argv(req, adir, n, current=current, release=release, env_file=env_file, start_id=start_id)
    # The new run starts under a name of its own; the old session (a dead pane to read, or the run
    # just replaced) keeps the real name until the new one is known to live.
    staging = f"{session}-starting-{os.getpid()}"
    res = _run(tmux.start_argv(socket_name, staging, runner, req.get("tmux", "tmux")), env=_tmux_env(req))
    if res["exit_code"] != 0:
        raise _undo(adir, "tmux-failed", f"tmux could not create session '{session}': {res['stderr'].strip() or res}")
    run, warning = _await_record(req, adir, staging)

    # The new run exists: now it takes the session's name and `current`.
    warning = _take_the_name(req, staging) or warning
    records.point_current(sdir, os.path.basename(adir))
    exit_rec, _ = _read_json(os.path.join(adir, EXIT_JSON))
    out: dict[str, t.Any] = {
        "attempt": n,
        "attempt_dir": adir,
        "log": os.path.join(adir, LOG),
        "release": release,
        "pid": run.get("pid") if run else None,
        "child_pid": run.get("child_pid") if run else None,
        "started_at": run.get("started_at") if run else None,
        "exit": exit_rec,
        "replaced": replaced,
    }
    if warning:
        out["warning"] = warning
    return out


def _clear_the_way(req: Request, sdir: str) -> dict[str, t.Any] | None:
    """The checks against what runs now: tmux there, the disk not full, no live run (or, with ``replace``,
    the live one stopped: what that stop answered, else None)."""
    session = req["session"]
    tf = tmux_facts(req)
    if not tf["installed"]:
        raise Refused(refusal.NO_TMUX, f"tmux is not installed where the run lives ({tf['stderr']})")
    af = attempt_facts(req, 0)
    live = _alive(af)
    runner = (af or {}).get("runner") if af and af.get("exit") else None
    for _ in range(100):  # an ended run's runner, between its exit record and its pane's end: a moment
        pane = _pane(tf)
        if not (runner and pane and pane.get("pane_dead") == "0" and pane.get("pane_pid") == str(runner["pid"])):
            break
        time.sleep(0.05)
        tf = tmux_facts(req)
    pane = _pane(tf)
    pane_live = pane is not None and pane.get("pane_dead") == "0"
    disk = disk_facts(sdir)
    if disk is not None and disk["full"]:
        raise Refused(
            refusal.DISK_FULL,
            f"the disk holding {disk['path']} is full ({disk['free']} bytes free, "
            f"less than {DISK_FULL_BYTES >> 20} MiB): free some space, then start again",
        )
    replaced = None
    leftovers = _leftovers(af)
    if live or pane_live or leftovers:
        what = _describe(af, live) if (af and live) else f"pane pid {pane['pane_pid']} (no run record)" if pane else "?"
        other = members.foreign_run(pane, sdir) if pane is not None and not live else None
        what = (
            f"pane pid {(pane or {}).get('pane_pid')}: the run of {other}, another host entry's run_dir"
            if other
            else what
        )
        if not req.get("replace"):
            if leftovers and not live:
                raise Refused(
                    refusal.RUN_ACTIVE,
                    f"session '{session}' has processes of an ended run still running ({members.describe(leftovers)}): "
                    "stop them with `dflashctl stop`, or start with --replace",
                    attempt=af.get("attempt") if af else None,
                    pid=leftovers[0]["pid"],
                )
            raise Refused(
                refusal.RUN_ACTIVE,
                f"session '{session}' already has a live run ({what}): "
                "stop it with `dflashctl stop`, or start with --replace",
                attempt=af.get("attempt") if af else None,
                pid=live["pid"] if live else None,
            )
        # A live pane with no live run record (started by hand): the last attempt dir, if any, belongs
        # to an ended run whose evidence must not be touched, so stop the pane, not that attempt.
        replaced = _stop(
            req,
            af if (live or leftovers) else None,
            tf,
            grace=float(req.get("replace_grace", 10.0)),
            reason="replaced",
        )
        if not replaced.get("ended"):
            left = members.facts(session_members(req, (af.get("run") if af else None)))
            raise Refused(
                refusal.RUN_ACTIVE,
                f"session '{session}': the run it replaces did not end"
                + (f" ({members.describe(left)} still running)" if left else "")
                + ": nothing was started beside it; stop it with `dflashctl stop`, then start again",
                attempt=af.get("attempt") if af else None,
                pid=left[0]["pid"] if left else None,
            )
    return replaced


def _new_attempt(req: Request, sdir: str) -> tuple[int, str, str]:
    """The next attempt dir, prepared for its runner: (its number, its path, its env file)."""
    try:
        n, adir = records.next_attempt_dir(sdir)
    except OSError as e:
        raise disk_refusal(e, f"cannot create an attempt under {sdir}") from None
    try:
        env_file = _prepare_attempt(adir, req.get("env") or {}, req.get("started_by"))
    except OSError as e:
        shutil.rmtree(adir, ignore_errors=True)
        raise disk_refusal(e, f"cannot prepare {adir}") from None
    return n, adir, env_file


def _undo(adir: str, kind: str, message: str) -> Refused:
    """A start that failed once its attempt dir was made: the dir goes, the refusal says why."""
    shutil.rmtree(adir, ignore_errors=True)
    return Refused(kind, message)


def _runner_argv(
    req: Request, adir: str, n: int, *, current: str, release: str, env_file: str, start_id: str | None
) -> list[str]:
    python = req.get("python") or sys.executable
    # Nothing secret (env) and nothing tmux would expand (the cwd) on this command line.
    return [
        python,
        "-m",
        "ops.far.runner",
        "--attempt-dir",
        adir,
        "--session",
        req["session"],
        "--attempt",
        str(n),
        "--cwd",
        current,
        "--python",
        python,
        "--release",
        release,
        "--env-file",
        env_file,
        *(["--leftover-grace", str(float(req["leftover_grace"]))] if req.get("leftover_grace") is not None else []),
        *(["--start-id", start_id] if start_id else []),
        "--",
        *req["command"],
    ]


def _await_record(req: Request, adir: str, staging: str) -> tuple[dict[str, t.Any] | None, str | None]:
    """Wait for the runner's record, so we can say which pid runs (and catch an instant failure):
    (run.json, a warning when there is none yet); a runner that died at once is refused, its attempt undone."""
    staged = {**req, "session": staging}
    run = None
    deadline = time.monotonic() + float(req.get("wait", 10.0))
    while run is None and time.monotonic() < deadline:
        run, _ = _read_json(os.path.join(adir, RUN_JSON))
        if run is None:
            spane = _pane(tmux_facts(staged))
            if spane is None or spane.get("pane_dead") == "1":
                break  # the runner is gone: without a record, unless it wrote one after our look (below)
            time.sleep(0.02)
    warning = None
    if run is None:
        spane = _pane(tmux_facts(staged))
        dead = spane is None or spane.get("pane_dead") == "1"
        if dead:
            # it wrote its record, ran and ended between the two looks (a command that fails at once, on a
            # loaded box): it started, and its records stay
            run, _ = _read_json(os.path.join(adir, RUN_JSON))
    if run is None:
        if dead:
            # tmux's own "Pane is dead" line is not the runner's; tmux can lose a fast exit's last output
            lines = [ln.strip() for ln in capture(staged, 100)["lines"] if ln.strip()]
            said = " | ".join([ln for ln in lines if not ln.startswith("Pane is dead")][-5:])
            base = tmux.base(req["socket"], req.get("tmux", "tmux"))
            _run(base + ["kill-session", "-t", tmux.exact(staging)], env=_tmux_env(req))
            raise _undo(
                adir, "runner-failed", f"the runner died at once, nothing was started: {said or 'it printed nothing'}"
            )
        warning = "the runner wrote no run.json yet"
    return run, warning


def _take_the_name(req: Request, staging: str) -> str | None:
    """The new run's tmux session takes the session's name (the old one ends); a warning when it cannot."""
    session, env = req["session"], _tmux_env(req)
    base = tmux.base(req["socket"], req.get("tmux", "tmux"))
    _run(base + ["kill-session", "-t", tmux.exact(session)], env=env)
    ren = _run(base + ["rename-session", "-t", tmux.exact(staging), session], env=env)
    if ren["exit_code"] != 0:
        return f"the run lives in tmux session '{staging}': renaming it failed ({ren['stderr'].strip()})"
    return None


def _stop(req: Request, af: AttemptFacts | None, tf: TmuxFacts, *, grace: float, reason: str) -> dict[str, t.Any]:
    """C-c to the pane, wait `grace` for exit.json, TERM, wait again, then KILL. The stop record is
    written FIRST: whatever the run does next, it was on purpose.

    A run that tags its processes (run.json "tag", ops/far/members.py) is ended as one: the interrupt
    and the TERM go to its keeper, which passes them to every process of the run; without a live keeper
    they go from here to each process, by the same rule. KILL goes from here to every process of the
    session's runs, each named in stop.json first (the keeper copies them into exit.json's `killed`).
    A run of an older runner: TERM and KILL to the command (by pid and start time), then the runner."""
    socket_name, session = req["socket"], req["session"]
    tmux_bin = req.get("tmux", "tmux")
    env = _tmux_env(req)
    adir = af["dir"] if af else None
    t0 = time.monotonic()
    run = (af.get("run") if af else None) or {}
    stop_path = os.path.join(adir, STOP_JSON) if adir else None
    stop_rec = {"requested_at": iso(time.time()), "grace": grace, "reason": reason, "by": "dflashctl"}
    if stop_path and af and af.get("run") is not None:
        write_json_atomic(stop_path, stop_rec)
    tagged = bool(run.get("tag")) or bool(af and af.get("members"))
    ending = members.Ending(run.get("child_pid"))  # our own, for when the keeper is gone
    killed: list[dict[str, t.Any]] = []

    def found() -> list[members.Member]:
        return session_members(req, run)

    def deliver() -> None:
        """The current step to the processes due it: a KILL always from here (each named in stop.json
        before it is sent); an interrupt or a TERM from here only while no keeper passes it on."""
        if ending.step is None or (ending.step != signal.SIGKILL and members.keeper_alive(run)):
            return
        now = found()
        if ending.step == signal.SIGKILL:
            new = [m for m in now if signal.SIGKILL not in ending.sent.get((m.pid, m.start), set())]
            if new and stop_path and af and af.get("run") is not None:
                killed.extend(m.record() for m in new)
                write_json_atomic(stop_path, {**stop_rec, "killed": killed})
        ending.deliver(now)

    def ended() -> bool:
        if af is None or af.get("run") is None:
            if tagged:
                return not found()
            cur = _pane(tmux_facts(req))
            return cur is None or cur.get("pane_dead") == "1"
        if os.path.exists(os.path.join(af["dir"], EXIT_JSON)):
            # recorded, but the run is over only once nothing of it runs (a keeper killed after its
            # record, or an older attempt's leftovers): those get the next steps, exit.json or not
            return not (tagged and found())
        if tagged:
            return not members.keeper_alive(run) and not found()
        return _alive(attempt_facts(req, 0)) is None

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if ended():
                return True
            deliver()  # a process whose parent died meanwhile is due now
            time.sleep(0.1)
        return ended()

    def step(sig: int) -> bool:
        """One step of the end; False when there was nobody to send it to."""
        ending.ask(sig)
        if sig != signal.SIGKILL and members.keeper_alive(run):
            return members.send(run["keeper_pid"], run.get("keeper_start"), sig)
        before = len(ending.killed), sum(map(len, ending.sent.values()))
        deliver()
        return (len(ending.killed), sum(map(len, ending.sent.values()))) != before

    steps = []
    pane = _pane(tf)
    if pane is not None and pane.get("pane_dead") == "0":
        _run(tmux.base(socket_name, tmux_bin) + ["send-keys", "-t", tmux.pane_target(session), "C-c"], env=env)
        ending.ask(signal.SIGINT)
        steps.append("interrupt")
    elif tagged and step(signal.SIGINT):
        steps.append("interrupt")
    how = "interrupt"
    if not (steps and wait(grace)):
        if tagged:
            for sig, name in ((signal.SIGTERM, "term"), (signal.SIGKILL, "kill")):
                if ended():
                    break
                if step(sig):
                    how = name
                    steps.append(name)
                if wait(grace if name == "term" else 5.0):
                    break
        else:
            targets = [(run.get("child_pid"), run.get("child_start")), (run.get("pid"), run.get("pid_start"))]
            if not run and pane is not None:
                targets = [(int(pane["pane_pid"]), None)]
            for sig, name in ((signal.SIGTERM, "term"), (signal.SIGKILL, "kill")):
                sent = False
                for pid, start_ticks in targets:
                    p = process_facts(pid, start_ticks)
                    if p and p["alive"]:
                        try:
                            os.kill(p["pid"], sig)
                            sent = True
                        except ProcessLookupError:
                            pass
                    if sent:
                        break  # the runner exits by itself once the command is gone
                if sent:
                    how = name
                    steps.append(name)
                    if wait(grace if name == "term" else 5.0):
                        break
                elif ended():
                    break
    exit_rec = _read_json(os.path.join(adir, EXIT_JSON))[0] if adir else None
    return {
        "attempt": af.get("attempt") if af else None,
        "how": how,
        "steps": steps,
        "exit": exit_rec,
        "killed": killed,
        "ended": ended(),
        "seconds": round(time.monotonic() - t0, 2),
    }


def stop(req: Request) -> dict[str, t.Any]:
    with SessionLock(session_dir(req), req, "stop", optional=True):
        return _stop_locked(req)


def _stop_locked(req: Request) -> dict[str, t.Any]:
    tf = tmux_facts(req)
    af = attempt_facts(req, 0)
    start_id = admission.start_id(req)
    if start_id is not None and ((af.get("run") if af else None) or {}).get("start_id") != start_id:
        # "stop what start <id> started": it has not run (yet). Under the session lock, so either
        # that start ran before us (and is stopped here) or it will find this mark and refuse.
        try:
            with open(admission.cancel_mark(session_dir(req), start_id), "w"):
                pass
        except OSError as e:
            raise disk_refusal(e, f"cannot cancel start {start_id}") from None
        return {"stopped": False, "cancelled": True, "reason": "that start has not run: it never will"}
    live = _alive(af)
    pane = _pane(tf)
    hand_started = (af is None or af.get("run") is None) and pane is not None and pane.get("pane_dead") == "0"
    if live is None and not hand_started and not _leftovers(af):
        state = "nothing to stop"
        if af and af.get("exit"):
            state = f"attempt {af.get('attempt')} already ended"
        return {
            "stopped": False,
            "reason": state,
            "attempt": af.get("attempt") if af else None,
            "exit": af.get("exit") if af else None,
        }
    result = _stop(req, af if not hand_started else None, tf, grace=float(req.get("grace", 60.0)), reason="stop")
    result["stopped"] = result["ended"]
    return result


def tail(req: Request) -> dict[str, t.Any]:
    """The last N lines from the pane (live session) or the durable log, and why; or, with an
    ``offset``, the log's new complete lines after that offset (``tail -f``)."""
    asked = int(req.get("lines", 30))
    n = min(asked, MAX_LINES)
    capped = f" (at most {MAX_LINES} lines are shown)" if asked > MAX_LINES else ""
    source = req.get("source", "auto")
    if req.get("offset") is not None:
        return _follow(req)
    adir = current_attempt(req)
    log = os.path.join(adir, LOG) if adir else None
    have_log = log is not None and os.path.exists(log)
    tf = tmux_facts(req)
    pane = _pane(tf)
    verdict = tmux.classify(tf["stderr"]) if not _session_alive(tf) else None

    # `tail -f` reads ONE stream, the log: its first lines and what follows come from the same offsets
    live_pane = pane is not None and pane.get("pane_dead") == "0" and not (req.get("follow") and have_log)
    if source == "pane" or (source == "auto" and live_pane):
        if pane is None:
            raise Refused(refusal.NO_PANE, f"no pane to show: {verdict.text if verdict else 'no session'}")
        cap = capture(req, n)
        if cap["exit_code"] != 0:
            raise Refused(refusal.NO_PANE, f"cannot capture the pane: {cap['stderr']}")
        why = f"session '{req['session']}' is alive; showing its pane"
        if pane.get("pane_dead") == "1":
            why = f"showing the dead pane of session '{req['session']}'"
        # `tail -f` goes on from the log's end as it is now
        offset = os.path.getsize(log) if have_log else None  # type: ignore[arg-type]
        return {
            "source": "pane",
            "reason": why + capped,
            "lines": cap["lines"],
            "log": log if have_log else None,
            "offset": offset,
        }

    if have_log:
        assert log is not None
        if source == "log":
            why = f"showing the log {log}"
        elif req.get("follow") and pane is not None and pane.get("pane_dead") == "0":
            why = f"following the log {log} (the session is alive too: `dflashctl attach` for the pane)"
        elif verdict is not None and verdict.server == "dead":
            why = f"tmux server is not running ({verdict.text}); showing the log {log}"
        elif verdict is not None:
            why = f"session '{req['session']}' is gone ({verdict.text}); showing the log {log}"
        elif pane is not None:
            why = f"the pane is dead; showing the log {log}"
        else:
            why = f"showing the log {log}"
        data, size, _ = tail_bytes(log, n)
        lines = tmux.decode_lines(data)
        if size > TAIL_WINDOW and len(lines) < n:
            capped += f" (only the last {TAIL_WINDOW >> 20} MiB of the log are read)"
        return {"source": "log", "reason": why + capped, "lines": lines, "log": log, "offset": size}
    if source == "auto" and pane is not None:
        cap = capture(req, n)
        return {
            "source": "pane",
            "reason": f"no log yet; showing the dead pane of session '{req['session']}'",
            "lines": cap["lines"],
            "log": None,
        }
    where = f"no log under {session_dir(req)}"
    raise Refused(refusal.NOTHING, f"nothing to show: {where}" + (f" and {verdict.text}" if verdict else ""))


def _follow(req: Request) -> dict[str, t.Any]:
    adir = current_attempt(req)
    current_log = os.path.join(adir, LOG) if adir else None
    log = req.get("log") or current_log
    offset = int(req["offset"])
    try:
        with open(log, "rb") as f:  # type: ignore[arg-type]
            size = os.fstat(f.fileno()).st_size
            if size < offset:
                offset = 0  # truncated or replaced: start over
            f.seek(offset)
            data = f.read(FOLLOW_CHUNK)
    except (OSError, TypeError) as e:
        raise Refused(refusal.NO_LOG, f"cannot read the log {log}: {e}") from None
    # only complete lines; a partial one waits for its newline (unless it is huge). With no newline
    # at all, a `\r` ends a progress segment: tqdm output with no newline for hours still shows.
    cut = (data.rfind(b"\n") + 1) or (data.rfind(b"\r") + 1)
    if cut == 0 and len(data) < FOLLOW_CHUNK:
        cut = 0
    elif cut == 0:
        cut = len(data)
    return {
        "source": "log",
        "log": log,
        "current_log": current_log,
        "lines": tmux.decode_lines(data[:cut]),
        "offset": offset + cut,
        "size": size,
    }


def read(req: Request) -> dict[str, t.Any]:
    """`dflashctl plot`: every attempt's records (run.json, exit.json, stop.json), its metrics.jsonl
    from the offset the caller already has (complete lines only, base64, at most ``cap`` bytes in all:
    the caller loops while an attempt says ``more``), the log tail of the attempts it asks one for
    (``tail``: true, or "crashed" = when it ended non-zero and not on request: to name the cause), and the checkpoints under ``<run_dir>/<session>/checkpoints``."""
    import base64  # here: the status probe, every call's verb, has no use for it (start-up time)

    sdir = session_dir(req)
    known = req.get("attempts") or {}
    if not isinstance(known, dict):
        raise Refused(refusal.BAD_REQUEST, "attempts: expected an object {attempt: {offset, run, tail}}")
    cap, offsets = req.get("cap", READ_CAP), [a.get("offset") or 0 for a in known.values() if isinstance(a, dict)]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (cap, *offsets)):
        raise Refused(refusal.BAD_REQUEST, "cap and attempts.*.offset: expected whole numbers >= 0")
    budget = max(1, min(cap, READ_CAP))
    numbered = numbered_attempts(sdir)
    attempts = []
    for n, name in numbered:
        adir = os.path.join(sdir, name)
        rec: dict[str, t.Any] = {"attempt": n}
        for key, fname in (("run", RUN_JSON), ("exit", EXIT_JSON), ("stop", STOP_JSON)):
            rec[key] = records.read_record(os.path.join(adir, fname))[0]
        rec["run_key"] = records.run_key(rec["run"])
        ask = known.get(str(n))
        ask = ask if isinstance(ask, dict) else {}
        offset = ask.get("offset") or 0
        reset = ask.get("run") is not None and ask.get("run") != rec["run_key"]
        if reset:
            offset = 0  # another run made this attempt dir: all of it again
        data, size = b"", None
        try:
            with open(os.path.join(adir, METRICS), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < offset:
                    reset, offset = True, 0  # truncated: from the start
                f.seek(offset)
                data = f.read(budget) if budget > 0 else b""
        except FileNotFoundError:
            pass
        except OSError as e:
            rec["error"] = f"{os.path.join(adir, METRICS)}: {e.strerror or e}"
        full = budget <= 0 or len(data) == budget
        cut = data.rfind(b"\n") + 1
        if cut == 0 and full and budget > 0:
            cut = len(data)  # one line longer than the cap: pass it on (it is no JSON record anyway)
        budget -= cut
        rec.update(
            size=size,
            offset=offset,
            next=offset + cut,
            reset=reset,
            more=full and size is not None and offset + cut < size,
            data=base64.b64encode(data[:cut]).decode("ascii"),
        )
        want = ask.get("tail", req.get("tail"))
        ended_badly = bool(rec["exit"]) and rec["exit"].get("exit_code") != 0 and not rec["stop"]
        if want is True or (want == "crashed" and ended_badly):
            lf = log_facts(os.path.join(adir, LOG), DIAG_LINES)
            rec["log_tail"] = (lf.get("tail") if lf else None) or []
        attempts.append(rec)  # past the cap, an attempt still reports its records; its bytes come next call
    cur = current_attempt(req)
    return {
        "session_dir": sdir,
        "current": _attempt_number(os.path.basename(cur)) if cur else None,
        "attempts": attempts,
        "checkpoints": checkpoints.marks(checkpoints.root_of(sdir)),
        "now": time.time(),
    }


def history(req: Request) -> dict[str, t.Any]:
    """`dflashctl history`: every attempt's facts, oldest first (what `probe` gives of the current one),
    with the checkpoint its log says it resumed from (``ops.far.history``); ``last``: only the last N.
    The log tail that names a crash's cause comes only with the attempts that ended non-zero and not on
    request; the others bring a few lines (their last step, when they wrote no metrics)."""
    last = req.get("last")
    if last is not None and (not isinstance(last, int) or isinstance(last, bool) or last < 1):
        raise Refused(refusal.BAD_REQUEST, "last: expected a whole number >= 1")
    sdir = session_dir(req)
    numbered = numbered_attempts(sdir)
    attempts = []
    for _, name in numbered[-last:] if last else numbered:
        adir = os.path.join(sdir, name)
        af = facts_of(adir, STEP_LINES)
        ended = af.get("exit") or {}
        if ended and ended.get("exit_code") != 0 and not af.get("stop"):
            af["log"] = log_facts(os.path.join(adir, LOG), DIAG_LINES)
        attempts.append({**af, "resumed_from": far_history.resumed_from(os.path.join(adir, LOG))})
    boot, boot_ticks = pid1_start()
    cur = current_attempt(req)
    return {
        "session_dir": sdir,
        "current": _attempt_number(os.path.basename(cur)) if cur else None,
        "total": len(numbered),
        "attempts": attempts,
        "now": time.time(),
        "hostname": os.uname().nodename,
        "pid1_start": boot,
        "pid1_ticks": boot_ticks,
    }


def _pulling(verb: t.Callable[[str, Request], dict[str, t.Any]], req: Request) -> dict[str, t.Any]:
    """`dflashctl pull`'s verbs (ops/far/checkpoints.py): Missing is `no-checkpoint`, ValueError `bad-request`."""
    try:
        return verb(session_dir(req), req)
    except (checkpoints.Missing, ValueError) as e:
        kind = refusal.NO_CHECKPOINT if isinstance(e, checkpoints.Missing) else refusal.BAD_REQUEST
        raise Refused(kind, str(e)) from None


HANDLERS: dict[str, t.Callable[[Request], t.Mapping[str, object]]] = {
    "probe": probe,
    "start": start,
    "stop": stop,
    "tail": tail,
    "read": read,
    "history": history,
    "checkpoint": functools.partial(_pulling, checkpoints.listing),
    "fetch": functools.partial(_pulling, checkpoints.chunk),
}
REQUIRED = {
    "probe": ("session", "socket", "run_dir"),
    "start": ("session", "socket", "run_dir", "workdir", "command"),
    "stop": ("session", "socket", "run_dir"),
    "tail": ("session", "socket", "run_dir"),
    "read": ("session", "socket", "run_dir"),
    "history": ("session", "socket", "run_dir"),
    "checkpoint": ("session", "socket", "run_dir"),
    "fetch": ("session", "socket", "run_dir", "dir", "name"),
}


def main(argv: t.Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    args = [a for a in args if a != "--json"]  # JSON is the only output there is
    if len(args) != 1 or args[0] not in HANDLERS:
        usage = f"usage: python -m ops.far.agent {{{','.join(VERBS)}}} --json"
        return request.answer({"ok": False, "error": refusal.USAGE, "message": usage}, 2)
    verb = args[0]
    try:
        req = request.read_request()
        missing = [k for k in REQUIRED[verb] if k not in req]
        if missing:
            raise ValueError(f"missing keys: {', '.join(missing)}")
        for key in ("run_dir", "workdir", "python", "tmux"):
            if req.get(key) is not None and (not isinstance(req[key], str) or "\0" in req[key]):
                raise ValueError(f"{key}: expected a path without NUL bytes")
        for key in ("session", "socket"):
            # a tmux target and a folder name: nothing that could walk out of run_dir or change the target
            if not re.fullmatch(r"[A-Za-z0-9_-]+", str(req[key])):
                raise ValueError(f"{key}: use letters, digits, '-', '_' only, got {req[key]!r}")
    except ValueError as e:
        return request.answer({"ok": False, "error": refusal.BAD_REQUEST, "message": f"{verb}: bad request: {e}"}, 2)
    if req.get("protocol", PROTOCOL) != PROTOCOL:
        # Another dflashctl's request: refuse before acting (a start must not start a run it cannot report).
        answer = {
            "ok": False,
            "protocol": PROTOCOL,
            "verb": verb,
            "error": refusal.PROTOCOL,
            "message": f"this agent speaks protocol {PROTOCOL}, the request {req['protocol']}: run `dflashctl deploy`",
        }
        return request.answer(answer)
    try:
        result = HANDLERS[verb](req)
        answer = {"ok": True, "protocol": PROTOCOL, "verb": verb, **result}
    except Refused as e:
        answer = {"ok": False, "protocol": PROTOCOL, "verb": verb, "error": e.kind, "message": str(e), **e.extra}
    return request.answer(answer)


if __name__ == "__main__":
    sys.exit(main())
