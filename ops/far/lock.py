"""The far side's one lock: an flock on a file, with a bounded wait and the holder's name in it. stdlib only.

``<workdir>/.deploy.lock`` (one deploy at a time) and ``<run_dir>/<session>/.lock`` (start, stop and
replace of one session) are both this; each caller words its own refusal from ``Busy``.
"""

from __future__ import annotations

import fcntl
import os
import time


class Busy(Exception):
    """Someone else holds the lock; ``holder`` is what they wrote into it ('' when nothing)."""

    def __init__(self, path: str, holder: str) -> None:
        super().__init__("{} is held by {}".format(path, holder or "another process"))
        self.path = path
        self.holder = holder


class Lock:
    """``with Lock(path, wait=30, holder="start by pid 12"):`` -- flock(LOCK_EX), waiting at most
    ``wait`` seconds (0: one try), else ``Busy``. Opening the file may raise OSError (the caller's
    to word: a full disk, a read-only folder). Closing the file drops the lock."""

    def __init__(self, path: str, *, wait: float = 0.0, holder: str | None = None, mode: int = 0o600) -> None:
        self.path = path
        self.wait = wait
        self.holder = holder
        self.mode = mode
        self.fd: int | None = None

    def __enter__(self) -> Lock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, self.mode)
        deadline = time.monotonic() + self.wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    try:
                        holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
                    except OSError:
                        holder = ""
                    os.close(fd)
                    raise Busy(self.path, holder) from None
                time.sleep(0.05)
        if self.holder is not None:
            try:  # who holds it, for the message above (best effort: a full disk must not stop a stop)
                os.ftruncate(fd, 0)
                os.pwrite(fd, self.holder.encode(), 0)
            except OSError:
                pass
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None
