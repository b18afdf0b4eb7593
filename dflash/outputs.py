"""Where dflash writes: every output path checked before the long work, one writer per output, and a write
that fails (a full disk, a read-only folder) said in one line.

- ``check_out``: the one output-path check of every command that writes (prepare-data's store, regen's
  JSONL, export's folder, eval's ``--json`` and ``--plot``): the path is not the working directory nor a
  folder above it, does not hold (nor equal) what the command reads, is of the right kind, and its folder
  takes a new file (a real probe: root passes every permission check, not a read-only mount);
- ``OutputLock``: ``OUT.lock`` next to the output, flocked for the whole run, so a second run into the same
  output refuses at once (``another prepare-data (pid N) is writing OUT``, exit 2) instead of mixing its
  parts into the first one's; the kernel drops the lock of a killed run;
- ``WriteFailed``: an OSError met while writing, as one line that names the file and says what is kept;
- ``fsync_file``, ``fsync_dir``: a file's bytes, and the folder entry naming it, on disk (checkpoints, best).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
import typing as t
from pathlib import Path

from dflash.errors import BadInput, Failed

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class OutputError(BadInput, ValueError):
    """An output path a command refuses before any work: one line (it names the command), exit 2."""


class OutputBusy(OutputError):
    """Another process is writing the same output (exit 2)."""


class WriteFailed(Failed):
    """Writing an output failed midway (a full disk, an I/O error): one line, exit 1."""


def _holds(outer: Path, inner: Path) -> bool:
    return inner == outer or outer in inner.parents


def _probe(folder: Path) -> str | None:
    """Why ``folder`` (an existing folder) does not take a new file, or None."""
    probe = folder / f".dflash-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def check_out(
    path: str | os.PathLike[str],
    *,
    what: str,
    kind: str,
    sources: t.Sequence[str | os.PathLike[str]] = (),
    may_exist: bool = True,
) -> Path:
    """Refuse (OutputError, one line starting with ``what``, e.g. "prepare-data: --out X") an output that
    cannot be written; returns the path. ``kind``: "file" (a file is written; an existing folder is refused)
    or "dir" (a folder is written by renaming a sibling onto it). ``sources``: what the command reads (an
    output that equals or holds one would destroy it). ``may_exist`` False: an existing path is refused."""
    out = Path(path).expanduser()
    absolute = Path(os.path.abspath(out))
    real = out.resolve()
    cwd = Path.cwd().resolve()
    if _holds(real, cwd):
        here = "the working directory" if real == cwd else f"a folder above the working directory ({cwd})"
        raise OutputError(f"{what} {out} is {here}: give the name of a new folder")
    for src in sources:
        s = Path(src).expanduser().resolve()
        if _holds(real, s):
            raise OutputError(f"{what} {out} {'is' if real == s else 'holds'} the input {src}: nothing is written")
    try:
        st = os.stat(out)
    except FileNotFoundError:
        st = None
    except OSError as e:  # ENOTDIR: a file where a folder should be, ELOOP, EACCES ...
        raise OutputError(f"{what} {out}: {e.strerror}") from None
    if st is not None:
        if not may_exist:
            raise OutputError(f"{what} {out} is already there; remove it or choose another {kind_word(kind)}")
        if kind == "file" and stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{what} {out} is a folder; expected a file name")
        if kind == "dir" and not stat.S_ISDIR(st.st_mode):
            raise OutputError(f"{what} {out} is a file; expected a folder")
        if kind == "file" and not stat.S_ISREG(st.st_mode):
            return out  # /dev/stdout, a FIFO: the user's choice, written as it is
    # the nearest folder that exists takes the new file (or the folders leading to it)
    folder = absolute.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"{what} {out}: {folder} is not a folder")
    problem = _probe(folder)
    if problem:
        raise OutputError(f"{what} {out}: cannot write into {folder}: {problem}")
    return out


def kind_word(kind: str) -> str:
    return "folder" if kind == "dir" else "file"


class OutputLock:
    """``with OutputLock(out, command="prepare-data"):`` -- an exclusive flock on ``OUT.lock`` (next to the
    output, so it outlives the renames inside), or OutputBusy naming the holder's pid. The file is removed
    on release; a run killed before that leaves it behind, unlocked (the kernel drops a dead holder's lock)."""

    def __init__(self, out: str | os.PathLike[str], *, command: str) -> None:
        self.out = Path(out)
        self.path = Path(str(self.out) + ".lock")
        self.command = command
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_pid(fd)
                os.close(fd)
                named = f" (pid {holder})" if holder else ""
                raise OutputBusy(
                    f"{self.command}: another {self.command}{named} is writing {self.out}; "
                    f"wait for it, or stop it (its lock: {self.path})"
                ) from None
            try:  # the file we locked must still be the one at the path (a releasing holder unlinks it)
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)  # while still holding it: a waiting opener then sees another inode
            os.close(self.fd)
            self.fd = None


def _holder_pid(fd: int, wait: float = 2.0) -> str:
    """The lock holder's pid as it wrote it, '' when it says nothing: it writes it just AFTER taking the lock,
    so a loser that looks in between waits for it (``wait`` seconds at most)."""
    deadline = time.monotonic() + wait
    while True:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit() or time.monotonic() >= deadline:
            return text if text.isdigit() else ""
        time.sleep(0.05)


def write_failed(e: OSError, *, command: str, where: str | os.PathLike[str], kept: str = "") -> WriteFailed:
    """An OSError met while writing, as one line: the file, the system's words and what is kept."""
    target = e.filename or where
    hint = " (the disk is full)" if e.errno in FULL else ""
    return WriteFailed(f"{command}: {target}: {e.strerror or e}{hint}{'; ' + kept if kept else ''}")


@contextlib.contextmanager
def writing(*, command: str, where: str | os.PathLike[str], kept: str = "") -> t.Iterator[None]:
    """An OSError raised while a command writes ``where`` -> WriteFailed (one line, exit 1)."""
    try:
        yield
    except OSError as e:
        raise write_failed(e, command=command, where=where, kept=kept) from None


def write_json(path: str, data: t.Any, *, command: str) -> None:
    """A command's report as JSON; a failed write (a full disk) is one line, exit 1."""
    with writing(command=command, where=path), open(path, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = [
    "OutputBusy",
    "OutputError",
    "OutputLock",
    "WriteFailed",
    "check_out",
    "fsync_dir",
    "fsync_file",
    "write_failed",
    "write_json",
    "writing",
]
