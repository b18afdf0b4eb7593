"""The runner: the wrapper tmux runs around the training command (DESIGN.md section 5). stdlib only.

    python -m ops.runner --attempt-dir DIR --session S --attempt N [--python P] [--release ID]
                         [--env K=V ...] -- COMMAND ARGS...

It survives what kills panes (SIGHUP from a dying tmux server or a killed session is ignored, a dead
pane never stops the log), tees every byte the command prints to ``train.log`` and to the pane, and
leaves two records the probe trusts before any tmux text: ``run.json`` at start and ``exit.json``
(written then renamed) at the end. SIGTERM/SIGINT are forwarded to the command.
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

RUN_JSON = "run.json"
EXIT_JSON = "exit.json"
STOP_JSON = "stop.json"
LOG = "train.log"
METRICS = "metrics.jsonl"

# After the command exits, grandchildren may still hold the pipe open: drain for this long at most.
DRAIN_AFTER_EXIT = 2.0


# --------------------------------------------------------------------------------------------
# Small facts about processes and the machine (also used by the agent)


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _boot_time() -> float | None:
    """When this machine booted, in seconds since the epoch. From CLOCK_BOOTTIME rather than
    /proc/stat's btime, which is cut to whole seconds (a start time would read up to 1 s early);
    not from /proc/uptime either, which lxcfs rewrites to the container's age inside LXC."""
    try:
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # comm may hold spaces and parentheses: the fields start after the LAST ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


def start_epoch(ticks: int | None) -> float | None:
    """Clock ticks since boot -> seconds since the epoch (on this machine's clock)."""
    bt = _boot_time()
    if ticks is None or bt is None:
        return None
    return round(bt + ticks / os.sysconf("SC_CLK_TCK"), 2)


def pid1_start() -> tuple[float | None, int | None]:
    """When PID 1 as seen here started: the container's boot, as (epoch seconds, clock ticks since
    the host booted). The ticks are its identity: a restarted container has a new PID 1, new ticks."""
    st = proc_stat(1)
    return (start_epoch(st[1]), st[1]) if st else (None, None)


def oom_kill_count() -> int | None:
    """cgroup v2 ``memory.events`` oom_kill (v1 ``memory.oom_control``) of our cgroup, or None."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    candidates.append(f"/sys/fs/cgroup{parts[2].rstrip('/')}/memory.events")
    except OSError:
        pass
    candidates += ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]
    for path in candidates:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def write_json_atomic(path: str | os.PathLike[str], data: dict[str, t.Any]) -> None:
    """Write then rename, so a reader never sees half a record."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# The tee


class Tee:
    """Every byte to the log (unbuffered: on disk as soon as read) and, best effort, to the pane.

    The pane side is non-blocking and forgiving: a stopped or dead tmux server must never stop the
    log or the command, so EAGAIN drops pane output and EIO/EPIPE turn the pane side off for good."""

    def __init__(self, log_path: str, pane_fd: int = 1) -> None:
        self.log = open(log_path, "ab", buffering=0)
        self.pane_fd: int | None = pane_fd
        self.pane_dropped = 0
        self.log_error: str | None = None
        try:
            flags = fcntl.fcntl(pane_fd, fcntl.F_GETFL)
            fcntl.fcntl(pane_fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
        except OSError:
            self.pane_fd = None

    def write(self, data: bytes) -> None:
        try:
            self.log.write(data)
        except OSError as e:  # disk full: keep the command alive, say it once on the pane
            if self.log_error is None:
                self.log_error = e.strerror or str(e)
                self._pane(f"\n[dflash runner] cannot write {self.log.name}: {self.log_error}\n".encode())
        self._pane(data)

    def _pane(self, data: bytes) -> None:
        if self.pane_fd is None:
            return
        try:
            n = os.write(self.pane_fd, data)
            self.pane_dropped += len(data) - n
        except BlockingIOError:
            self.pane_dropped += len(data)
        except OSError as e:
            if e.errno in (errno.EIO, errno.EPIPE, errno.EBADF, errno.ENXIO):
                self.pane_fd = None  # the pane is gone; the log goes on
            else:
                self.pane_dropped += len(data)

    def note(self, text: str) -> None:
        self.write(f"[dflash runner] {text}\n".encode())

    def close(self) -> None:
        self.log.close()


# --------------------------------------------------------------------------------------------


def parse_args(argv: t.Sequence[str]) -> t.Any:
    import argparse  # here: the agent imports this module too, and must start fast

    p = argparse.ArgumentParser(prog="python -m ops.runner", description=__doc__.split("\n\n")[0])
    p.add_argument("--attempt-dir", required=True)
    p.add_argument("--session", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--python", default=None, help="the configured interpreter; its folder goes first on PATH")
    p.add_argument("--release", default=None)
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(list(argv))
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("no command after --")
    for item in args.env:
        if "=" not in item:
            p.error(f"--env expects K=V, got {item!r}")
    return args


def child_env(args: t.Any) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TMUX", None)  # the command is not a tmux client
    env.pop("TMUX_PANE", None)
    if args.python and "/" in args.python:
        # so `command = "python -m dflash ..."` runs the configured interpreter
        env["PATH"] = os.path.dirname(os.path.abspath(args.python)) + os.pathsep + env.get("PATH", os.defpath)
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    env["DFLASH_RUN_DIR"] = os.path.abspath(args.attempt_dir)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def main(argv: t.Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # A dying tmux server or a killed session hangs up the pty: that must not end training.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # Ctrl-Z in an attached pane would stop the tee, and a stopped tee stalls training on a full pipe.
    for sig in (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU):
        signal.signal(sig, signal.SIG_IGN)
    attempt_dir = os.path.abspath(args.attempt_dir)
    os.makedirs(attempt_dir, exist_ok=True)
    tee = Tee(os.path.join(attempt_dir, LOG))
    me = proc_stat(os.getpid())
    boot = pid1_start()
    record: dict[str, t.Any] = {
        "session": args.session,
        "attempt": args.attempt,
        "pid": os.getpid(),
        "pid_start": me[1] if me else None,
        "child_pid": None,
        "child_start": None,
        "started_at": iso(time.time()),
        "started_ts": round(time.time(), 3),
        "command": list(args.command),
        "cwd": os.getcwd(),
        "release": args.release,
        "container_boot": boot[0],
        "container_boot_ticks": boot[1],
        "oom_kill": oom_kill_count(),
        "hostname": os.uname().nodename,
        "python": args.python or sys.executable,
    }
    env = child_env(args)
    # A stop signal that lands before the child exists is held, then passed on: it must neither kill
    # the runner (no exit.json, an orphaned command) nor be lost.
    held: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        # Its own session: no controlling tty, so a pty hangup cannot reach it even if it resets
        # SIGHUP; stdin from /dev/null (nobody types into a training run).
        child = subprocess.Popen(
            args.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    except OSError as e:
        code = 127 if e.errno == errno.ENOENT else 126
        tee.note(f"cannot run {args.command[0]}: {e.strerror}")
        write_json_atomic(os.path.join(attempt_dir, RUN_JSON), record)
        _write_exit(attempt_dir, code, None, record)
        tee.close()
        return code

    cst = proc_stat(child.pid)
    record["child_pid"] = child.pid
    record["child_start"] = cst[1] if cst else None
    write_json_atomic(os.path.join(attempt_dir, RUN_JSON), record)

    def forward(signum: int, _frame: t.Any) -> None:
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for signum in held:
        forward(signum, None)

    assert child.stdout is not None
    _pump(child, child.stdout.fileno(), tee)
    rc = child.wait()
    signum = -rc if rc < 0 else None
    _write_exit(attempt_dir, None if signum else rc, signum, record)
    tee.close()
    return 128 + signum if signum else rc


def _pump(child: subprocess.Popen[bytes], fd: int, tee: Tee) -> None:
    """Copy the command's output until EOF, or until it has exited and the pipe stays quiet."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline: float | None = None
    try:
        while True:
            if deadline is None and child.poll() is not None:
                deadline = time.monotonic() + DRAIN_AFTER_EXIT
            timeout = 0.5 if deadline is None else max(0.0, deadline - time.monotonic())
            if not sel.select(timeout):
                if deadline is not None:
                    return  # exited, and a grandchild keeps the pipe open: do not wait for it
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            tee.write(chunk)
    finally:
        sel.close()


def _write_exit(attempt_dir: str, exit_code: int | None, signum: int | None, record: dict[str, t.Any]) -> None:
    write_json_atomic(
        os.path.join(attempt_dir, EXIT_JSON),
        {
            "exit_code": exit_code,
            "signal": signum,
            "ended_at": iso(time.time()),
            "ended_ts": round(time.time(), 3),
            "oom_kill": oom_kill_count(),
            "oom_kill_before": record.get("oom_kill"),
        },
    )


if __name__ == "__main__":
    sys.exit(main())
