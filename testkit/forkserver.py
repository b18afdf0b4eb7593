"""`python -m dflash ARGS` or `dflashctl ARGS` as a real child process, without paying its interpreter start
and imports each time.

Most of what a `dflash` command costs in a test is importing torch and transformers (~7 s of CPU on the
2-core CI machine), not the work: tests that run the CLI dozens of times to check one-line errors spent most
of the suite's CPU there; a `dflashctl` command's click, paramiko and ops imports are ~0.3 s of CPU, paid
by hundreds of calls in tests/ops. A ForkServer is a child interpreter that imported the program's package
once and never ran a torch op (so no OpenMP pool exists to break in a fork) nor opened a connection; each
`run` forks it, and the fork is the command: its own pid, cwd, environment, argv and the caller's
stdin/stdout/stderr (passed as file descriptors), leaving through the interpreter's normal exit (atexit,
thread joins, flushed streams) with the exit status the caller gets back.

What differs from a fresh interpreter: modules are imported before the command's environment is set, so
`run` forks a `dflash` command only when its environment is the server's own (but for what pytest sets per
test): HF_HOME or DFLASH_* read at import time stay right. ops reads the environment only when a command
runs, so a `dflashctl` command forks with any environment whose PYTHON* variables are the server's. A
command given stdin, or whose environment differs, runs as a real subprocess.

`spawn` starts a long-lived command the same way (a supervisor a test streams the output of and signals by
pid) on a connection of its own, so the caller's `run` commands still fork meanwhile.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import typing as t
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_LEN = struct.Struct("!I")


def dflashctl_argv() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m ops.cli``."""
    script = Path(sys.executable).parent / "dflashctl"
    return [str(script)] if script.exists() else [sys.executable, "-m", "ops.cli"]


# what each server runs, and what a command that cannot fork runs instead
PROGRAMS: dict[str, list[str]] = {"dflash": [sys.executable, "-m", "dflash"], "dflashctl": dflashctl_argv()}


def _send(sock: socket.socket, obj: t.Any, fds: t.Sequence[int] = ()) -> None:
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [_LEN.pack(len(data)) + data], list(fds))
    else:
        sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket, nfds: int = 0) -> tuple[t.Any, list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, nfds) if nfds else (sock.recv(_LEN.size), [], 0, 0)
    if len(head) < _LEN.size:
        raise EOFError("the fork server closed the connection")
    (size,) = _LEN.unpack(head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the fork server closed the connection")
        data += chunk
    return json.loads(data), fds


class ForkServer:
    """One per test process (`testkit.forkserver.shared()`); `close()` ends it."""

    def __init__(self, program: str = "dflash") -> None:
        if program not in PROGRAMS:
            raise ValueError(f"no fork server for {program!r} (one of {', '.join(PROGRAMS)})")
        self.program = program
        self._dir = tempfile.mkdtemp(prefix="dflash-forkserver-")
        self.socket_path = os.path.join(self._dir, "sock")
        # dflash's checked-file tests run the checkout by PYTHONPATH; dflashctl's callers run the installed
        # console script, whose environment has none (`-m` from REPO finds testkit either way)
        self.env = {**os.environ, "PYTHONPATH": str(REPO)} if program == "dflash" else dict(os.environ)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "testkit.forkserver", program, self.socket_path],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
        )
        self._sock: socket.socket | None = None
        # one command at a time through the one connection; a second caller (a test's thread) meanwhile gets
        # a real subprocess, so commands that a test runs side by side still run side by side
        self._busy = threading.Lock()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if not _ready(self._proc, self.socket_path):
                raise RuntimeError("the fork server did not start")
            sock.connect(self.socket_path)
            self._sock = sock
        return self._sock

    def run(
        self,
        args: t.Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: t.Mapping[str, str] | None = None,
        timeout: float = 300,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """What `subprocess.run([python, -m, PROGRAM, *args], capture_output=True, text=True)` returns."""
        env = dict(env) if env is not None else dict(os.environ)
        same = _same(env, self.env) if self.program == "dflash" else _same_imports(env, self.env)
        off = os.environ.get("DFLASH_TEST_FORK") == "0"  # every command a fresh interpreter (a suspect fork)
        if (
            off
            or not same
            or input is not None
            or self._proc.poll() is not None
            or not self._busy.acquire(blocking=False)
        ):
            return subprocess.run(
                [*PROGRAMS[self.program], *args],
                input=input,
                cwd=cwd or REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        try:
            return self._forked(args, cwd, env, timeout)
        finally:
            self._busy.release()

    def _forked(
        self, args: t.Sequence[str], cwd: str | os.PathLike[str] | None, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as nul:
            sock = self._connect()
            _send(
                sock,
                {"args": list(args), "cwd": str(cwd or REPO), "env": env},
                [nul.fileno(), out.fileno(), err.fileno()],
            )
            (pid,), _ = _recv(sock)
            sock.settimeout(timeout)
            try:
                (status,), _ = _recv(sock)
            except TimeoutError:
                os.kill(pid, 9)
                sock.settimeout(None)
                _recv(sock)
                raise subprocess.TimeoutExpired([self.program, *args], timeout) from None
            finally:
                sock.settimeout(None)
            out.seek(0)
            err.seek(0)
            code = os.waitstatus_to_exitcode(status)
            return subprocess.CompletedProcess(
                [self.program, *args], code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
            )

    def spawn(
        self,
        args: t.Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        env: t.Mapping[str, str] | None = None,
    ) -> Spawned | subprocess.Popen[str]:
        """What `subprocess.Popen([PROGRAM, *args], stdout=PIPE, stderr=PIPE, text=True)` gives (pid, stdout,
        stderr, poll, wait, send_signal, kill, returncode): a fork on a connection of its own, or that Popen
        where a command cannot fork (see `run`)."""
        env = dict(env) if env is not None else dict(os.environ)
        same = _same(env, self.env) if self.program == "dflash" else _same_imports(env, self.env)
        off = os.environ.get("DFLASH_TEST_FORK") == "0"
        if off or not same or self._proc.poll() is not None or not _ready(self._proc, self.socket_path):
            return subprocess.Popen(
                [*PROGRAMS[self.program], *args],
                cwd=cwd or REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        return Spawned(self.program, self.socket_path, list(args), str(cwd or REPO), env)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)


class Spawned:
    """A command forked by the server on a connection of its own: its pid is the command's, its stdout and
    stderr are pipes to this process, and the server says its wait status on the connection when it ends."""

    def __init__(self, program: str, path: str, args: list[str], cwd: str, env: dict[str, str]) -> None:
        self.args = [program, *args]
        self.returncode: int | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with open(os.devnull, "rb") as nul:
                _send(self._sock, {"args": args, "cwd": cwd, "env": env}, [nul.fileno(), out_w, err_w])
            (self.pid,), _ = _recv(self._sock)
            # signals go to this very process (the server reaps it, not us: its pid may be another's later)
            self._pidfd: int | None = os.pidfd_open(self.pid)
        finally:
            os.close(out_w)  # the command holds its own copies: EOF here when it (and what inherited them) ends
            os.close(err_w)
        self.stdout = open(out_r, encoding="utf-8", errors="replace")  # noqa: SIM115 (read by the caller's threads)
        self.stderr = open(err_r, encoding="utf-8", errors="replace")  # noqa: SIM115

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._sock.settimeout(timeout)
            try:
                (status,), _ = _recv(self._sock)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
            finally:
                self._sock.settimeout(None)
            self.returncode = os.waitstatus_to_exitcode(status)
            self._sock.close()
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._sock], [], [], 0)[0]:
            return self.wait()  # the status is there (one short message): read whole
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # it ended meanwhile, as Popen.send_signal allows
                pass

    def kill(self) -> None:
        self.send_signal(9)


# what pytest changes in os.environ around each test (nothing reads it at import time)
_PER_TEST = frozenset({"PYTEST_CURRENT_TEST"})


def _same(env: t.Mapping[str, str], server: t.Mapping[str, str]) -> bool:
    """The command's environment is the server's (then what its modules read at import time is right)."""
    return {k: v for k, v in env.items() if k not in _PER_TEST} == {
        k: v for k, v in server.items() if k not in _PER_TEST
    }


def _same_imports(env: t.Mapping[str, str], server: t.Mapping[str, str]) -> bool:
    """ops reads the environment only when a command runs (HOME, XDG_*, a token's variable), never at
    import: a dflashctl command may fork with any environment but one that changes what Python imports."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON")} == {
        k: v for k, v in server.items() if k.startswith("PYTHON")
    }


def _ready(proc: subprocess.Popen[bytes], path: str) -> bool:
    """The server listens (it says so once its imports are done), or it died."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if os.path.exists(path + ".ready"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


_SHARED: dict[str, ForkServer] = {}


def shared(program: str = "dflash") -> ForkServer:
    """This process's fork server of ``program``, started on first use and ended when the process exits."""
    server = _SHARED.get(program)
    if server is None:
        server = _SHARED[program] = ForkServer(program)
        atexit.register(server.close)
    return server


def serve(program: str, path: str) -> None:
    """The server's loop; a forked child leaves through ``_exit`` with the command's code. The server ends
    on SIGTERM (``ForkServer.close``)."""
    import importlib
    import pkgutil

    # the imports the commands pay (each command imports its modules when it runs): paid once
    if program == "dflash":
        import dflash

        for mod in pkgutil.walk_packages(dflash.__path__, "dflash."):
            if mod.name != "dflash.__main__":
                importlib.import_module(mod.name)
    else:
        import ops

        for mod in pkgutil.walk_packages(ops.__path__, "ops."):
            try:
                importlib.import_module(mod.name)
            except ImportError:  # an optional extra this venv lacks: the command imports it (and fails) itself
                pass

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    Path(path + ".ready").touch()
    # each connection runs one command at a time; several connections (a `spawn` each) run side by side,
    # their commands' ends seen through pidfds
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    while True:
        for key, _ in sel.select():
            if key.data is None:
                conn, _ = listener.accept()
                sel.register(conn, selectors.EVENT_READ, ("conn", conn))
                continue
            if key.data[0] == "child":
                _, pid, conn = key.data
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    _send(conn, [status])
                except OSError:  # the caller went away first
                    pass
                continue
            conn = key.data[1]
            try:
                req, fds = _recv(conn, 3)
            except (EOFError, OSError):
                sel.unregister(conn)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                for other in list(sel.get_map().values()):  # the server's sockets and pidfds are not the command's
                    if other.data is not None and other.data[0] == "child":
                        os.close(other.fd)
                    else:
                        t.cast(socket.socket, other.fileobj).close()
                sel.close()
                _child(program, req, fds)
            for fd in fds:
                os.close(fd)
            _send(conn, [pid])
            sel.register(os.pidfd_open(pid), selectors.EVENT_READ, ("child", pid, conn))


def _child(program: str, req: dict[str, t.Any], fds: list[int]) -> t.NoReturn:
    """The forked command: the caller's stdin/stdout/stderr, cwd, environment and argv; its exit code."""
    import runpy

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    code = 0
    try:
        if program == "dflash":
            sys.argv = ["python -m dflash", *req["args"]]  # runpy puts __main__.py's path first
            runpy.run_module("dflash", run_name="__main__", alter_sys=True)
        else:
            from ops.console import main

            sys.argv = ["dflashctl", *req["args"]]
            main()  # the console script's entry: it ends with sys.exit (status: os._exit)
    except SystemExit as e:
        code = _code(e.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit(code)


def _exit(code: int) -> t.NoReturn:
    """What an interpreter's exit does that a command can see (its threads joined, atexit run, streams
    flushed), without tearing down torch's and transformers' modules: that alone took seconds."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
