"""The transport contract: ``Transport.run(argv, *, stdin=None, timeout) -> CommandResult``.

Stdlib only (and ops.errors), so code that runs inside the container can share ``CommandResult``.
"""

from __future__ import annotations

import dataclasses
import typing as t

from ops.errors import CommandTimeout, RemoteCommandError

# What stdin may be: bytes, a binary file, or an iterator of chunks (streamed, never held whole).
Stdin = bytes | t.BinaryIO | t.Iterable[bytes] | None

DEFAULT_TIMEOUT = 60.0
CHUNK = 1 << 16
# Remote commands run under `timeout -k KILL_AFTER <N>` (ssh, pct exec).
KILL_AFTER = 5  # seconds between the remote timeout's TERM and its KILL
# A remote `timeout` that fired exits 124 (TERM was enough) or 137 (it had to KILL).
TIMEOUT_EXITS = (124, 137)


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
    timeout: float | None = None  # the limit it ran under (for messages)

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
        if self.timed_out:
            raise CommandTimeout(self.argv, self.timeout or 0.0)
        if self.exit_code != 0:
            raise RemoteCommandError(self.argv, self.exit_code, self.err, what=what)
        return self


class Transport:
    """Where commands run: this machine or a host over ssh."""

    name: str = "transport"

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
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
    for chunk in stdin:
        if chunk:
            yield bytes(chunk)


def timeout_arg(timeout: float) -> str:
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return f"{timeout:.3f}".rstrip("0").rstrip(".")
