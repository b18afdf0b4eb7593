"""What a start or a stop of a session passes before it acts: the start request's checks (everything it
could trip over later, checked before anything changes on disk or in tmux), the session's lock (one start
or stop at a time), and the marks of starts their dflashctl took back (Ctrl-C). Stdlib only, Python 3.8 syntax.
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
import typing as t

from ops.far import lock, refusal
from ops.far.refusal import Refused

LOCK = ".lock"  # <run_dir>/<session>/.lock: start, stop and replace of one session, one at a time
LOCK_WAIT = 30.0  # seconds a start or stop waits for another one on the same session
START_ID = re.compile(r"[0-9a-f]{8,32}")
CANCELLED = ".cancelled-"  # <run_dir>/<session>/.cancelled-<start id>: a start its dflashctl took back
CANCELLED_KEEP = 86400.0  # a day: longer than any start request can wait to be run
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
STARTED_BY_MAX = 2048  # run.json's room (RESERVE_BYTES) holds it beside a long command line


class SessionLock:
    """``<run_dir>/<session>/.lock`` (flock, 0600): held across check -> attempt dir -> tmux -> run.json,
    so two starts (a person and restart-on-crash) cannot both pass the check. A bounded wait: a
    caller that cannot get it in ``wait`` seconds is refused, never hung."""

    def __init__(self, sdir: str, req: t.Mapping[str, t.Any], verb: str, *, optional: bool = False) -> None:
        self.sdir = sdir
        self.path = os.path.join(self.sdir, LOCK)
        self.optional = optional  # stop: no session folder can be made (read-only) = no attempt to guard
        self.wait = float(req.get("lock_wait", LOCK_WAIT))
        self.lock = lock.Lock(self.path, wait=self.wait, holder=f"{verb} by pid {os.getpid()}")

    def __enter__(self) -> SessionLock:
        try:
            os.makedirs(self.sdir, exist_ok=True)
            self.lock.__enter__()
        except lock.Busy as e:
            raise Refused(
                refusal.BUSY,
                f"another start or stop of this session is still running ({e.holder or 'another process'}); "
                f"waited {self.wait:g}s for {self.path}: try again",
            ) from None
        except OSError as e:
            if self.optional:
                return self
            raise disk_refusal(e, f"cannot create the lock {self.path}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.__exit__()


def disk_refusal(e: OSError, what: str) -> Refused:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return Refused(refusal.DISK_FULL, f"{what}: the disk is full ({e.strerror})")
    return Refused(refusal.RUN_DIR, f"{what}: {e.strerror or e}")


def validate_start(req: t.Mapping[str, t.Any]) -> None:
    """Everything a start could trip over later, checked before anything changes on disk or in tmux."""
    command = req.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise Refused(refusal.BAD_REQUEST, "command: expected a non-empty list of strings")
    if not command[0]:
        raise Refused(refusal.BAD_REQUEST, "command: the program name is empty")
    for i, arg in enumerate(command):
        if "\0" in arg:
            raise Refused(refusal.BAD_REQUEST, f"command: argument {i} holds a NUL byte, which no program can be given")
    env = req.get("env") or {}
    if not isinstance(env, dict):
        raise Refused(refusal.BAD_REQUEST, 'env: expected a table of NAME = "value"')
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            raise Refused(
                refusal.BAD_REQUEST,
                f"env: {key!r} is not a variable name (letters, digits, '_', not starting with a digit)",
            )
        if not isinstance(value, str) or "\0" in value:
            raise Refused(refusal.BAD_REQUEST, f"env.{key}: expected a string without NUL bytes")
    by = req.get("started_by")
    if by is not None and (not isinstance(by, dict) or len(json.dumps(by)) > STARTED_BY_MAX):
        raise Refused(refusal.BAD_REQUEST, f"started_by: expected an object of at most {STARTED_BY_MAX} bytes as JSON")
    start_id(req)


def start_id(req: t.Mapping[str, t.Any]) -> str | None:
    """The id a dflashctl gives one start (``--group start``: what its Ctrl-C may stop, and only that)."""
    sid = req.get("start_id")
    if sid is not None and not (isinstance(sid, str) and START_ID.fullmatch(sid)):
        raise Refused(refusal.BAD_REQUEST, "start_id: expected 8 to 32 hex digits")
    return sid


def cancel_mark(sdir: str, sid: str) -> str:
    """A cancelled start's mark (``<run_dir>/<session>/.cancelled-<id>``): its stop came first."""
    return os.path.join(sdir, f"{CANCELLED}{sid}")


def prune_cancelled(sdir: str) -> None:
    try:
        names = [n for n in os.listdir(sdir) if n.startswith(CANCELLED)]
    except OSError:
        return
    for name in names:
        path = os.path.join(sdir, name)
        try:
            if time.time() - os.path.getmtime(path) > CANCELLED_KEEP:
                os.unlink(path)
        except OSError:
            pass
