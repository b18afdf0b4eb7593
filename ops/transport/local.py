"""``LocalTransport``: commands on this machine with subprocess (stdlib only)."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import signal as signal_mod
import subprocess
import threading
import time
import typing as t

from ops.transport.base import CHUNK, DEFAULT_TIMEOUT, CommandResult, Stdin, Transport, iter_stdin

logger = logging.getLogger(__name__)


class LocalTransport(Transport):
    """This machine, no ssh and no container: the embedded default a new user runs first."""

    name = "local"

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        argv = tuple(str(a) for a in argv)
        logger.debug("local: %s", shlex.join(argv))
        try:
            # A new session so a timeout kills the whole process group, not only the leader.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            return CommandResult(argv, 127, b"", f"{argv[0]}: {e.strerror}\n".encode())
        except PermissionError as e:
            return CommandResult(argv, 126, b"", f"{argv[0]}: {e.strerror}\n".encode())

        out: list[bytes] = []
        err: list[bytes] = []
        assert proc.stdout is not None and proc.stderr is not None
        workers = [
            threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, err), daemon=True),
        ]
        if stdin is not None:
            # A writer thread, so a command that never reads cannot block us past the timeout.
            workers.append(threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True))
        for w in workers:
            w.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        for w in workers:
            w.join(timeout=5)
        rc = proc.returncode
        sig = -rc if rc is not None and rc < 0 else None
        return CommandResult(
            argv,
            None if sig is not None else rc,
            b"".join(out),
            b"".join(err),
            timed_out=timed_out,
            signal=sig,
            timeout=timeout,
        )


def _feed(pipe: t.BinaryIO | None, stdin: Stdin) -> None:
    assert pipe is not None
    try:
        for chunk in iter_stdin(stdin):
            pipe.write(chunk)
    except (BrokenPipeError, ValueError, OSError):
        pass  # the command stopped reading; its exit code tells the story
    finally:
        # Always close, even when the stdin iterator itself failed: the command must see EOF.
        with contextlib.suppress(OSError, ValueError):
            pipe.close()


def _drain(stream: t.BinaryIO, sink: list[bytes]) -> None:
    while chunk := stream.read(CHUNK):
        sink.append(chunk)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM the command's process group, then KILL what is left after a short grace."""
    for sig, grace in ((signal_mod.SIGTERM, 2.0), (signal_mod.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            time.sleep(0.02)
