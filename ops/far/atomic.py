"""Atomic writes on the far side: a JSON record written then renamed, a symlink switched by rename. stdlib only."""

from __future__ import annotations

import json
import os
import typing as t


def create_new(path: str, mode: int) -> int:
    """A file of ours, for writing: whatever a killed writer of our pid left there goes first, then it is
    created O_EXCL|O_NOFOLLOW, so a link planted under its name (by the run, in a folder it can write) is
    never followed, nor anything put there meanwhile written into."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def write_json_atomic(path: str | os.PathLike[str], data: t.Mapping[str, t.Any], *, mode: int | None = None) -> None:
    """Write then rename, so a reader never sees half a record; a failed write (a full disk)
    leaves no ``<path>.tmp<pid>`` behind. ``mode``: the new file's permissions (e.g. 0o600)."""
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        fd = create_new(tmp, 0o666 if mode is None else mode)
        with open(fd, "w") as f:
            if mode is not None:
                os.fchmod(fd, mode)  # an older tmp file keeps its mode through O_CREAT
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def switch_link(folder: str, name: str, target: str, *, tmp_prefix: str = ".link-") -> None:
    """``<folder>/<name> -> target`` switched atomically: a new symlink beside it, renamed over the old one.
    A reader sees the old target or the new one, never no link. Temp links start with ``tmp_prefix``."""
    tmp = os.path.join(folder, f"{tmp_prefix}{name}-{os.getpid()}")
    try:
        os.unlink(tmp)  # left by a killed switch with our pid
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(folder, name))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
