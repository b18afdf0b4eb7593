"""Transports: the one choke point through which every external command runs.

``Transport.run(argv, *, stdin=None, timeout) -> CommandResult``. ``LocalTransport`` runs on this
machine with subprocess; ``SSHTransport`` runs on a host over one paramiko connection.
argv is always a list; where a shell has to parse it (ssh), it is joined with ``shlex.join`` once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import shutil
import signal as signal_mod
import subprocess
import threading
import time
import typing as t
from pathlib import Path

from ops.errors import CommandTimeout

logger = logging.getLogger(__name__)

# What stdin may be: bytes, a binary file, or an iterator of chunks (streamed, never held whole).
Stdin = t.Union[bytes, t.BinaryIO, t.Iterable[bytes], None]

DEFAULT_TIMEOUT = 60.0
CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class CommandResult:
    """What one command did. ``exit_code`` is None when it was killed by a signal (then ``signal``
    holds the number when known; over ssh the number is not always reported)."""

    argv: tuple[str, ...]
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def check(self, what: str | None = None) -> CommandResult:
        """Return self when the command succeeded, else raise ``RemoteCommandError``/``CommandTimeout``."""
        from ops.errors import RemoteCommandError

        if self.timed_out:
            raise CommandTimeout(self.argv, 0.0)
        if self.exit_code != 0:
            raise RemoteCommandError(self.argv, self.exit_code, self.err, what=what)
        return self


class Transport:
    """Where commands run: this machine or a host over ssh."""

    name: str = "transport"

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        raise NotImplementedError

    def put(self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None) -> None:
        """Copy one local file to ``remote`` on the host (written to a temp name, then renamed)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the connection; safe to call twice."""

    def __enter__(self) -> t.Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_stdin(stdin: Stdin) -> t.Iterator[bytes]:
    """Chunks of ``stdin`` whatever its form, so a 20 MB payload never sits in memory twice."""
    if stdin is None:
        return
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        data = memoryview(stdin)
        for i in range(0, len(data), CHUNK):
            yield bytes(data[i : i + CHUNK])
        return
    read = getattr(stdin, "read", None)
    if read is not None:
        while chunk := read(CHUNK):
            yield chunk
        return
    for chunk in t.cast(t.Iterable[bytes], stdin):
        if chunk:
            yield bytes(chunk)


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
        )

    def put(self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None) -> None:
        dest = Path(remote)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        shutil.copyfile(local, tmp)
        if mode is not None:
            tmp.chmod(mode)
        tmp.replace(dest)


def _feed(pipe: t.BinaryIO | None, stdin: Stdin) -> None:
    assert pipe is not None
    try:
        for chunk in iter_stdin(stdin):
            pipe.write(chunk)
        pipe.close()
    except (BrokenPipeError, ValueError, OSError):
        pass  # the command stopped reading; its exit code tells the story


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
