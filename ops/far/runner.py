"""The runner: the wrapper tmux runs around the training command (docs/design.md section 5). stdlib only.

    python -m ops.far.runner --attempt-dir DIR --session S --attempt N [--cwd DIR] [--python P]
                         [--release ID] [--env-file FILE] -- COMMAND ARGS...

Three processes, so that no single kill takes the evidence or the training down:

- the runner (this process, the pane's process): shows the log in the pane and forwards SIGINT/SIGTERM;
- the keeper (forked, in its own session): starts the command, waits for it and writes ``run.json``
  and ``exit.json``; a SIGKILLed runner (or pane, or tmux server) leaves it and the command running;
- the command: its stdout and stderr ARE ``train.log`` (opened O_APPEND), so its output never depends
  on a pipe to another process staying alive.

The run is every process the command starts (ops/far/members.py): the keeper is their subreaper and
each carries the run's tag. An interrupt or a TERM meant for the run reaches them all (as a
terminal's Ctrl-C reaches a job); ``exit.json`` is written once every one of them is gone. A command
that ends while some of its processes still run ends its run, as systemd's KillMode=control-group
has it: they get SIGTERM, then SIGKILL after ``--leftover-grace`` seconds (``left`` and ``killed`` in
``exit.json`` name them). During a stop, the stop's steps end them; a stop that never finishes them (its
agent was killed midway) is finished by the keeper, two stop graces and a leftover grace later.

``exit.json`` is written into a record pre-allocated at start (``.exit.reserved``, overwritten in place,
then renamed), so a disk that filled up during the run cannot take the command's real end with it.
SIGHUP is ignored (a dying tmux server or a killed session must not end training). The run's
environment comes in a 0600 file (``--env-file``) that is read and unlinked at once: nothing secret
is ever in an argv (``ps``, tmux's pane start command). ``--cwd`` is entered here rather than by tmux,
which would expand ``#(...)`` formats in a path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
import typing as t

# The records' names and the process facts live in ops.far (shared with the agent and the release
# program); re-exported here for the code that has always imported them from the runner.
from ops.far import members, records
from ops.far.atomic import write_json_atomic as write_json_atomic
from ops.far.procfs import oom_kill_count as oom_kill_count
from ops.far.procfs import pid1_start as pid1_start
from ops.far.procfs import proc_stat as proc_stat
from ops.far.procfs import start_epoch as start_epoch
from ops.far.protocol import DiskFacts
from ops.far.records import ENV_FILE as ENV_FILE
from ops.far.records import EXIT_JSON, EXIT_RESERVED, LOG, RUN_JSON, RUN_RESERVED, STARTED_BY, STOP_JSON, read_json
from ops.far.records import METRICS as METRICS

RESERVE_BYTES = 16384  # room for a run record with a long command line
STARTED_BY_FILE = 8 * records.STARTED_BY_MAX  # .started_by.json is indented: its object is what is limited
MAX_NAMED = 8  # members named in exit.json's `left` and `killed` (each at most ~1.3 KB)
# Less free space than this where the run writes is a full disk: `start` refuses, exit.json says so.
DISK_FULL_BYTES = 1 << 20
POLL = 0.1  # how often the pane is refreshed from the log while the command is quiet
KEEPER_POLL = 0.2  # how often the keeper reaps (and, while a run ends, looks for its members)
# A command that ended with processes still running: seconds from their SIGTERM to their SIGKILL
# (the stop's default grace: time for a trainer's checkpoint).
LEFTOVER_GRACE = 60.0


# --------------------------------------------------------------------------------------------
# Small facts about processes and the machine (also used by the agent)


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def reserve(path: str, size: int = RESERVE_BYTES) -> None:
    """Pre-allocate a record: ``size`` real bytes on disk, so filling it in later needs no free space."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b" " * size)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    os.close(fd)


def write_record(attempt_dir: str, name: str, reserved: str, data: dict[str, t.Any]) -> str | None:
    """``<attempt_dir>/<name>`` from ``data``: into the pre-allocated ``reserved`` file (overwritten in
    place, fsynced, renamed), else written then renamed. Returns None, or why neither worked."""
    path, res = os.path.join(attempt_dir, name), os.path.join(attempt_dir, reserved)
    body = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
    try:
        fd = os.open(res, os.O_WRONLY)  # never O_CREAT: only the blocks allocated at start
        try:
            size = os.fstat(fd).st_size
            if len(body) <= size:
                os.pwrite(fd, body + b" " * (size - len(body)), 0)  # JSON allows trailing blanks
                os.fsync(fd)
            else:
                size = -1
        finally:
            os.close(fd)
        if size >= 0:
            os.replace(res, path)
            return None
    except OSError:
        pass
    try:
        write_json_atomic(path, data)
    except OSError as e:
        return f"cannot write {path}: {e.strerror or e}"
    try:
        os.unlink(res)
    except OSError:
        pass
    return None


def disk_free(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_facts(path: str) -> DiskFacts | None:
    """Free space where the run writes (the nearest existing folder of ``path``)."""
    probe_at = os.path.abspath(path)
    while not os.path.isdir(probe_at) and os.path.dirname(probe_at) != probe_at:
        probe_at = os.path.dirname(probe_at)
    free = disk_free(probe_at)
    return None if free is None else {"path": probe_at, "free": free, "full": free < DISK_FULL_BYTES}


def read_env_file(path: str) -> dict[str, str]:
    """The run's environment ({"K": "V"}), from the 0600 file the agent wrote; the file is unlinked
    first, so the secret lives on disk only for the moment between `start` and here."""
    with open(path, "rb") as f:
        raw = f.read()
    os.unlink(path)
    data = json.loads(raw.decode("utf-8"))
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError("expected a JSON object of strings")
    return data


def read_started_by(attempt_dir: str) -> dict[str, t.Any] | None:
    """Who started this attempt and why (the agent's ``.started_by.json``, taken into run.json and
    removed); None for a runner started by hand."""
    path = os.path.join(attempt_dir, STARTED_BY)
    try:
        with open(path, "rb") as f:
            raw = f.read(STARTED_BY_FILE + 1)  # the file is indented: the limit is on the object (compact), below
        os.unlink(path)
    except OSError:
        return None
    try:
        if len(raw) > STARTED_BY_FILE:
            raise ValueError(f"larger than {STARTED_BY_FILE} bytes")
        data = records.parse_record(raw)
        if len(json.dumps(data)) > records.STARTED_BY_MAX:
            raise ValueError(f"larger than {records.STARTED_BY_MAX} bytes as JSON")
        return data
    except ValueError as e:
        return {"note": f"{STARTED_BY} was not kept: {e}"}


# --------------------------------------------------------------------------------------------
# The pane: what the log says, shown best effort


class Pane:
    """The runner's view of its pane: non-blocking and forgiving. A stopped or dead tmux server must
    never stop the runner, so EAGAIN drops pane output and EIO/EPIPE turn the pane off for good
    (the log, written by the command itself, is not affected either way)."""

    def __init__(self, fd: int = 1) -> None:
        self.fd: int | None = fd
        self.dropped = 0
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        except OSError:
            self.fd = None

    def write(self, data: bytes) -> None:
        if self.fd is None:
            return
        try:
            n = os.write(self.fd, data)
            self.dropped += len(data) - n
        except BlockingIOError:
            self.dropped += len(data)
        except OSError as e:
            if e.errno in (errno.EIO, errno.EPIPE, errno.EBADF, errno.ENXIO):
                self.fd = None  # the pane is gone; the log goes on
            else:
                self.dropped += len(data)


def note(log_fd: int | None, pane: Pane | None, text: str) -> None:
    """A line of the runner's own: in the log (the pane shows the log), else straight on the pane."""
    line = f"[dflash runner] {text}\n".encode()
    if log_fd is not None:
        try:
            os.write(log_fd, line)
            return
        except OSError:
            pass
    if pane is not None:
        pane.write(line)


# --------------------------------------------------------------------------------------------


def parse_args(argv: t.Sequence[str]) -> t.Any:
    import argparse  # here: the agent imports this module too, and must start fast

    p = argparse.ArgumentParser(prog="python -m ops.far.runner", description=__doc__.split("\n\n")[0])
    p.add_argument("--attempt-dir", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--cwd", default=None, help="the command's working directory (entered by the runner)")
    p.add_argument("--python", default=None, help="the configured interpreter; its folder goes first on PATH")
    p.add_argument("--release", default=None)
    p.add_argument("--start-id", default=None, help="the id of the start that made this run (run.json)")
    p.add_argument("--env-file", default=None, help="a JSON object of environment variables; read, then unlinked")
    p.add_argument(
        "--leftover-grace",
        type=float,
        default=LEFTOVER_GRACE,
        help="seconds from the SIGTERM of what the ended command left running to its SIGKILL",
    )
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(list(argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command after --")
    return args


def child_env(args: t.Any, extra: t.Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TMUX", None)  # the command is not a tmux client
    env.pop("TMUX_PANE", None)
    if args.python and "/" in args.python:
        # so `command = "python -m dflash ..."` runs the configured interpreter
        env["PATH"] = os.path.dirname(os.path.abspath(args.python)) + os.pathsep + env.get("PATH", os.defpath)
    env.update(extra)
    env["DFLASH_RUN_DIR"] = os.path.abspath(args.attempt_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main(argv: t.Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    pane = Pane()
    extra: dict[str, str] = {}
    env_error = None
    if args.env_file:
        try:
            extra = read_env_file(args.env_file)  # first of all: the secret leaves the disk
        except (OSError, ValueError) as e:
            env_error = f"cannot read the environment file {args.env_file}: {e}"
    # A dying tmux server or a killed session hangs up the pty: that must not end training.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # Ctrl-Z in an attached pane would stop the runner (and, before, the training behind a full pipe).
    for sig in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_IGN)
    attempt_dir = os.path.abspath(args.attempt_dir)
    os.makedirs(attempt_dir, exist_ok=True)
    log_path = os.path.join(attempt_dir, LOG)
    log_fd: int | None = None
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        pane.write(f"[dflash runner] cannot open {log_path}: {e.strerror}\n".encode())
    for name, reserved in ((RUN_JSON, RUN_RESERVED), (EXIT_JSON, EXIT_RESERVED)):
        path = os.path.join(attempt_dir, reserved)
        if not os.path.exists(path):  # the agent reserves them; the runner alone does it here
            try:
                reserve(path)
            except OSError as e:
                note(log_fd, pane, f"cannot reserve room for {name}: {e.strerror}")
    me = proc_stat(os.getpid())
    boot = pid1_start()
    record: dict[str, t.Any] = {
        "session": args.session,
        "attempt": args.attempt,
        "pid": os.getpid(),
        "pid_start": me[1] if me else None,
        "child_pid": None,
        "child_start": None,
        "keeper_pid": None,
        "keeper_start": None,
        "tag": None,
        "subreaper": None,
        "started_at": iso(time.time()),
        "started_ts": round(time.time(), 3),
        "command": list(args.command),
        "cwd": None,
        "release": args.release,
        "start_id": args.start_id,
        "container_boot": boot[0],
        "container_boot_ticks": boot[1],
        "oom_kill": oom_kill_count(),
        "hostname": os.uname().nodename,
        "python": args.python or sys.executable,
        "started_by": read_started_by(attempt_dir),
    }
    failure = env_error or (None if log_fd is not None else f"cannot open {log_path}")
    if failure is None and args.cwd:
        try:
            os.chdir(args.cwd)
        except OSError as e:
            failure = f"cannot enter {args.cwd}: {e.strerror}"
    try:
        record["cwd"] = os.getcwd()
    except OSError:
        pass
    if failure is not None:
        note(log_fd, pane, failure)
        return _end_without_command(attempt_dir, record, 126, log_fd, pane)
    assert log_fd is not None
    env = child_env(args, extra)

    # A stop signal that lands before the command exists is held, then passed on: it must neither
    # kill the runner nor be lost.
    held: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    ready_r, ready_w = os.pipe()
    keeper = os.fork()
    if keeper == 0:  # the keeper: never returns
        os.close(ready_r)
        code = 70  # EX_SOFTWARE: the keeper itself failed
        try:
            code = _keep(args.command, env, attempt_dir, record, log_fd, ready_w, pane, args.leftover_grace)
        except BaseException:
            import traceback  # here: only when the keeper fails (the agent imports this module and must start fast)

            note(log_fd, pane, "the keeper failed: " + traceback.format_exc().replace("\n", "\n[dflash runner] "))
        finally:
            os._exit(code)
    os.close(ready_w)
    child_pid = _read_ready(ready_r)

    def forward(signum: int, _frame: t.Any) -> None:
        # to the keeper, which passes it to every process of the run (it is our child: its pid cannot
        # be reused before we reap it)
        if child_pid is not None:
            try:
                os.kill(keeper, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for signum in held:
        forward(signum, None)
    status = _show_until_exit(keeper, ready_r, log_path, pane)
    os.close(ready_r)
    os.close(log_fd)
    # The keeper exits with the command's code (128+N for a signal): so does the runner, and tmux's
    # pane_dead_status carries the command's end even where no record could be written.
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 128 + os.WTERMSIG(status)


def _read_ready(fd: int) -> int | None:
    """The command's pid, as the keeper reports it once it runs (None: it could not start)."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = os.read(fd, 64)
        except InterruptedError:
            continue
        if not chunk:
            break
        data += chunk
    try:
        pid = int(data.strip() or b"0")
    except ValueError:
        return None
    return pid or None


def _keep(
    command: list[str],
    env: dict[str, str],
    attempt_dir: str,
    record: dict[str, t.Any],
    log_fd: int,
    ready_w: int,
    pane: Pane,
    leftover_grace: float = LEFTOVER_GRACE,
) -> int:
    """The keeper: start the command with the log as its stdout and stderr, record it, wait for it and
    for every process it started, record its end. Its own session: no tty, no signal meant for the pane
    or the runner reaches it."""
    os.setsid()
    asked: list[int] = []  # interrupts and TERMs meant for the run, in the order they came

    def ask(signum: int, _frame: t.Any) -> None:
        asked.append(signum)

    signal.signal(signal.SIGTERM, ask)
    signal.signal(signal.SIGINT, ask)
    kst = proc_stat(os.getpid())
    record["keeper_pid"], record["keeper_start"] = os.getpid(), kst[1] if kst else None
    # Orphans of the command's tree (a setsid'ed or double-forked child whose parent died) come to us,
    # not to the container's init: we stay able to find, signal and reap them.
    record["subreaper"] = members.become_subreaper()
    tag = members.new_tag(str(record["session"]), int(record["attempt"]))
    record["tag"] = tag
    env = {**env, members.TAG: tag}
    # The command leads a process group of its own, as a shell's job does: an interrupt reaches that
    # group, as a terminal's Ctrl-C would (ops.far.members.gentle_due).
    group: dict[str, t.Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    try:
        # stdin from /dev/null: nobody types into a training run.
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, env=env, **group)
    except OSError as e:
        code = 127 if e.errno == errno.ENOENT else 126
        note(log_fd, pane, f"cannot run {command[0]}: {e.strerror}")
        _record(attempt_dir, RUN_JSON, RUN_RESERVED, record, log_fd, pane)
        os.write(ready_w, b"0\n")
        _write_exit(attempt_dir, code, None, record, log_fd, pane)
        return code
    cst = proc_stat(proc.pid)
    record["child_pid"] = proc.pid
    record["child_start"] = cst[1] if cst else None
    _record(attempt_dir, RUN_JSON, RUN_RESERVED, record, log_fd, pane)
    try:
        # ready_w stays open until the keeper exits: its EOF tells the runner at once
        os.write(ready_w, f"{proc.pid}\n".encode())
    except OSError:
        pass  # the runner is gone already: the keeper goes on alone
    status, left, killed = _until_all_gone(proc.pid, tag, attempt_dir, asked, log_fd, pane, leftover_grace)
    proc.returncode = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)  # reaped by us
    died_of = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    rc = None if died_of else os.WEXITSTATUS(status)
    _write_exit(attempt_dir, rc, died_of, record, log_fd, pane, left=left, killed=killed)
    return 128 + died_of if died_of else (rc or 0)


def _reap(command_pid: int) -> int | None:
    """Reap every child that ended (the command, and orphans re-parented to us); the command's wait
    status when it was among them."""
    found = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return found
        if pid == 0:
            return found
        if pid == command_pid:
            found = status


def _until_all_gone(
    command_pid: int,
    tag: str,
    attempt_dir: str,
    asked: list[int],
    log_fd: int,
    pane: Pane,
    leftover_grace: float,
) -> tuple[int, list[dict[str, t.Any]], list[dict[str, t.Any]]]:
    """Wait for the command and every process it started; pass each interrupt or TERM meant for the run
    to all of them (``members.Ending``). Returns the command's wait status, the members still running
    when it ended (``left``) and those that had to be SIGKILLed (``killed``: by us, or by a stop)."""
    ending = members.Ending(command_pid)
    status: int | None = None
    left: list[members.Member] | None = None
    stop_asked = False
    term_at: float | None = None  # a stop's steps did not end them by then: we do (TERM, then KILL)
    kill_at: float | None = None
    while True:
        reaped = _reap(command_pid)
        if reaped is not None:
            status = reaped
        if asked:
            stop_asked = True
            ending.ask(asked[-1])
            del asked[:]
        if status is None and ending.step is None:
            time.sleep(KEEPER_POLL)  # the common case: the command runs, nobody asked anything
            continue
        found = members.scan(tag=tag, keepers=[os.getpid()])
        if status is not None and left is None:
            left = found
            if found:
                how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
                stopping = stop_asked or os.path.exists(os.path.join(attempt_dir, STOP_JSON))
                if stopping:
                    # The stop's own steps end them (its TERM and KILL come within two of its graces).
                    # Should that stop never finish them (its dflashctl or agent was killed midway), we
                    # do, one leftover grace later: nothing of the run waits forever for a stop.
                    wait_s = 2 * _stop_grace(attempt_dir) + leftover_grace
                    note(
                        log_fd,
                        pane,
                        f"the command ended ({how}); waiting for {members.describe(found)} (the stop ends them; "
                        f"if they still run {wait_s:g}s from now, they get SIGTERM, then SIGKILL)",
                    )
                    term_at = time.monotonic() + wait_s
                else:
                    # systemd's KillMode=control-group: the run ends with its command
                    note(
                        log_fd,
                        pane,
                        f"the command ended ({how}) and left {members.describe(found)} running: the run ends "
                        f"with its command, so they get SIGTERM, then SIGKILL after {leftover_grace:g}s",
                    )
                    ending.ask(signal.SIGTERM)
                    kill_at = time.monotonic() + leftover_grace
        if status is not None and not found:
            break
        if term_at is not None and time.monotonic() >= term_at:
            note(log_fd, pane, f"SIGTERM to {members.describe(found)}: the stop did not end them")
            ending.ask(signal.SIGTERM)
            term_at, kill_at = None, time.monotonic() + leftover_grace
        ending.deliver(found)
        if kill_at is not None and time.monotonic() >= kill_at:
            note(log_fd, pane, f"SIGKILL to {members.describe(found)}: still running {leftover_grace:g}s after SIGTERM")
            ending.ask(signal.SIGKILL)
            ending.deliver(found)
            kill_at = None
        time.sleep(KEEPER_POLL)
    killed = [m.record() for m in ending.killed]
    stop, _ = read_json(os.path.join(attempt_dir, STOP_JSON))
    for k in (stop or {}).get("killed") or []:  # the stop's last step (the agent's): named there first
        if isinstance(k, dict) and all(k.get("pid") != m["pid"] or k.get("start") != m["start"] for m in killed):
            killed.append({"pid": k.get("pid"), "start": k.get("start"), "argv": k.get("argv") or []})
    assert status is not None
    return status, [m.record() for m in left or []], killed


def _stop_grace(attempt_dir: str) -> float:
    """The grace of the stop asked for (stop.json), else the stop's default."""
    stop, _ = read_json(os.path.join(attempt_dir, STOP_JSON))
    grace = (stop or {}).get("grace")
    return float(grace) if isinstance(grace, (int, float)) and not isinstance(grace, bool) and grace >= 0 else 60.0


def _record(
    attempt_dir: str, name: str, reserved: str, data: dict[str, t.Any], log_fd: int | None, pane: Pane | None
) -> bool:
    err = write_record(attempt_dir, name, reserved, data)
    if err:
        note(log_fd, pane, err)
    return err is None


def _show_until_exit(keeper: int, ready_r: int, log_path: str, pane: Pane) -> int:
    """Copy the log into the pane until the keeper has exited (its end of ``ready_r`` closes then);
    returns the keeper's wait status."""
    import selectors  # here: the agent imports this module too, and must start fast

    sel = selectors.DefaultSelector()
    sel.register(ready_r, selectors.EVENT_READ)
    status: int | None = None
    try:
        with open(log_path, "rb", buffering=0) as log:
            while True:
                while chunk := log.read(1 << 16):
                    pane.write(chunk)
                if status is not None:
                    return status  # the keeper is gone and the log is shown to its end
                pid, st = os.waitpid(keeper, os.WNOHANG)
                if pid == keeper:
                    status = st
                    continue  # one more pass: what the command printed last
                if sel.select(POLL) and not os.read(ready_r, 64):
                    sel.unregister(ready_r)  # EOF: the keeper exited; waitpid says how next round
    except OSError:
        pass
    finally:
        sel.close()
    return status if status is not None else os.waitpid(keeper, 0)[1]


def _end_without_command(attempt_dir: str, record: dict[str, t.Any], code: int, log_fd: int | None, pane: Pane) -> int:
    _record(attempt_dir, RUN_JSON, RUN_RESERVED, record, log_fd, pane)
    _write_exit(attempt_dir, code, None, record, log_fd, pane)
    if log_fd is not None:
        os.close(log_fd)
    return code


def _write_exit(
    attempt_dir: str,
    exit_code: int | None,
    signum: int | None,
    record: dict[str, t.Any],
    log_fd: int | None,
    pane: Pane | None,
    *,
    left: list[dict[str, t.Any]] | None = None,
    killed: list[dict[str, t.Any]] | None = None,
) -> None:
    free = disk_free(attempt_dir)
    rec: dict[str, t.Any] = {
        "exit_code": exit_code,
        "signal": signum,
        "ended_at": iso(time.time()),
        "ended_ts": round(time.time(), 3),
        "oom_kill": oom_kill_count(),
        "oom_kill_before": record.get("oom_kill"),
        "disk_free": free,
        "disk_full": free is not None and free < DISK_FULL_BYTES,
        # the run's processes still running when the command ended, and those its end had to SIGKILL
        # (the first MAX_NAMED of each: the record must fit the room reserved at start)
        "left": (left or [])[:MAX_NAMED],
        "killed": (killed or [])[:MAX_NAMED],
    }
    if not _record(attempt_dir, EXIT_JSON, EXIT_RESERVED, rec, log_fd, pane):
        how = f"signal {signum}" if signum else f"exit {exit_code}"
        note(None, pane, f"the command ended ({how}) but no exit record could be written")


if __name__ == "__main__":
    sys.exit(main())
