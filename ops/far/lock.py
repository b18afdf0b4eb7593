"""The far side's one lock: an flock on a file, with a bounded wait and the holder's name in it. stdlib only.

``<workdir>/.deploy.lock`` (one deploy at a time) and ``<run_dir>/<session>/.lock`` (start, stop and
replace of one session) are both this; each caller words its own refusal from ``Busy``.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
import typing as t


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


def holder_json(fd: int, *, wait: float = 2.0) -> dict[str, t.Any]:
    """What the holder of the flock on ``fd`` wrote about itself (a JSON object with its ``pid``); {} when it
    says nothing. A holder writes that just AFTER taking the lock, so a loser that reads in between waits for
    it (``wait`` seconds at most) rather than name no one (a "(pid None)" a CI run saw)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (OSError, ValueError, RecursionError):
            data = {}
        if isinstance(data, dict) and "pid" in data:
            return data
        if time.monotonic() >= deadline:
            return data if isinstance(data, dict) else {}
        time.sleep(0.05)
