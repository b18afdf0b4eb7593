"""`python -m dflash ARGS` as a real child process, without paying its interpreter start and imports each time.

Most of what a `dflash` command costs in a test is importing torch and transformers (~7 s of CPU on the
2-core CI machine), not the work: tests that run the CLI dozens of times to check one-line errors spent most
of the suite's CPU there. A ForkServer is a child interpreter that imported `dflash.__main__` once and
never ran a torch op (so no OpenMP pool exists to break in a fork); each `run` forks it, and the fork is
the command: its own pid, cwd, environment, argv and the caller's stdin/stdout/stderr (passed as file
descriptors), leaving through the interpreter's normal exit (atexit, thread joins, flushed streams) with
the exit status the caller gets back.

What differs from a fresh interpreter: modules are imported before the command's environment is set, so
`run` takes the fork only when the command's environment is the server's own (but for what pytest sets per
test) and falls back to a real `python -m dflash` otherwise: anything read at import time, HF_HOME or
DFLASH_* alike, stays right.
"""

from __future__ import annotations

import atexit
import json
import os
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

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="dflash-forkserver-")
        self.socket_path = os.path.join(self._dir, "sock")
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "testkit.forkserver", self.socket_path],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
        )
        self._sock: socket.socket | None = None

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
        """What `subprocess.run([python, -m, dflash, *args], capture_output=True, text=True)` returns."""
        env = dict(env) if env is not None else dict(os.environ)
        if not _same(env, self.env) or input is not None or self._proc.poll() is not None:
            return subprocess.run(
                [sys.executable, "-m", "dflash", *args],
                cwd=cwd or REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
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
                raise subprocess.TimeoutExpired(["dflash", *args], timeout) from None
            finally:
                sock.settimeout(None)
            out.seek(0)
            err.seek(0)
            code = os.waitstatus_to_exitcode(status)
            return subprocess.CompletedProcess(
                ["dflash", *args], code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
            )

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


# what pytest changes in os.environ around each test (nothing reads it at import time)
_PER_TEST = frozenset({"PYTEST_CURRENT_TEST"})


def _same(env: t.Mapping[str, str], server: t.Mapping[str, str]) -> bool:
    """The command's environment is the server's (then what its modules read at import time is right)."""
    return {k: v for k, v in env.items() if k not in _PER_TEST} == {
        k: v for k, v in server.items() if k not in _PER_TEST
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


_SHARED: ForkServer | None = None


def shared() -> ForkServer:
    """This process's fork server, started on first use and ended when the process exits."""
    global _SHARED
    if _SHARED is None:
        _SHARED = ForkServer()
        atexit.register(_SHARED.close)
    return _SHARED


def serve(path: str) -> None:
    """The server's loop; a forked child leaves through ``_exit`` with the command's code. The server ends
    on SIGTERM (``ForkServer.close``)."""
    import importlib
    import pkgutil
    import runpy

    import dflash

    # the imports the commands pay (each command imports its modules when it runs): paid once
    for mod in pkgutil.walk_packages(dflash.__path__, "dflash."):
        if mod.name != "dflash.__main__":
            importlib.import_module(mod.name)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    Path(path + ".ready").touch()
    while True:
        conn, _ = listener.accept()
        while True:
            try:
                req, fds = _recv(conn, 3)
            except (EOFError, OSError):
                conn.close()
                break
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                sys.argv = ["python -m dflash", *req["args"]]  # runpy puts __main__.py's path first
                code = 0
                try:
                    runpy.run_module("dflash", run_name="__main__", alter_sys=True)
                except SystemExit as e:
                    code = _code(e.code)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                _exit(code)
            for fd in fds:
                os.close(fd)
            _send(conn, [pid])
            _, status = os.waitpid(pid, 0)
            _send(conn, [status])


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
    serve(sys.argv[1])
