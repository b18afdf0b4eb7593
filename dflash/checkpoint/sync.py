"""Copies of the checkpoints off the box: ``[checkpoint] sync``, a command run after each checkpoint and
each switch of ``best``, in the background: the trainer never waits for it.

The template (``"rclone copy {dir} remote:bucket/run"``) is split once like a shell would (``shlex``), and
``{dir}`` (the checkpoints folder) and ``{step}`` are substituted inside its words: each word stays one
argv item, whatever the path holds; no shell ever reads it. Stdlib only.

One sync at a time: a request while one runs is remembered (the newest only) and starts when the running
one ends, so a slow copy never runs twice at once and the newest checkpoint is always the one copied next.
A sync that exits non-zero or runs past ``timeout`` (then its process group is killed: TERM, then KILL) is a
failed one (``SyncResult``); nothing retries it by itself: the next request syncs again (copying the whole
folder, which rclone and rsync do incrementally). Its output goes to ``sync.log`` in the run dir.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
import typing as t
import urllib.parse
from pathlib import Path

from dflash.config import SYNC_FIELD

logger = logging.getLogger("dflash.sync")  # the name train.log has always shown

LOG_FILE = "sync.log"  # in the run dir: the sync command's stdout and stderr
KILL_GRACE = 10.0  # seconds between the TERM and the KILL of a sync past its timeout
REDACTED = "[redacted]"
LINE_CHARS = 200  # the sync's last output line in its failure's one line
_VERB = re.compile(r"[a-z]+")  # copy, sync, cp: a word of the command that is no secret


def command(words: t.Sequence[str], *, folder: Path, step: int) -> list[str]:
    """The argv of one sync: the fields replaced in one pass (a path holding "{step}" stays as it is)."""
    values = {"dir": str(folder), "step": str(step)}
    return [SYNC_FIELD.sub(lambda m: values.get(m.group(1), m.group(0)), w) for w in words]


def command_secrets(words: t.Sequence[str]) -> list[str]:
    """The sync command's own words are secrets: a tool repeats them when it fails (rclone prints an inline
    remote ``:s3,access_key_id=...,secret_access_key=...:bucket`` whole). Each argument but a lowercase
    verb, a bare flag and the words we fill in ({dir}, {step}), and each value of a ``key=value`` in one."""
    out: list[str] = []
    for w in words[1:]:
        if SYNC_FIELD.search(w) or _VERB.fullmatch(w) or (w.startswith("-") and "=" not in w):
            continue
        out.append(w)
        for piece in re.split(r"[,:]", w):
            value = piece.partition("=")[2]
            if len(value) >= 4:
                out.append(value)
    return [x for x in out if len(x) >= 4]


def scrub(text: str, secrets: t.Sequence[str]) -> str:
    """``text`` with each secret replaced, as printed plain, percent-encoded, JSON- or repr-escaped."""
    for s in sorted(secrets, key=len, reverse=True):
        for form in (s, urllib.parse.quote(s, safe=""), urllib.parse.quote(s), json.dumps(s)[1:-1], repr(s)[1:-1]):
            text = text.replace(form, REDACTED)
    return text


@dataclasses.dataclass(frozen=True)
class SyncResult:
    step: int
    why: str  # "checkpoint" or "best"
    ok: bool
    exit_code: int | None  # None: it could not start, or was killed past its timeout
    timed_out: bool
    error: str | None  # one line: what failed (the command's name only: its arguments may hold secrets)
    seconds: float

    def record(self) -> dict[str, t.Any]:
        """The metrics.jsonl record: ``{"event": "synced" | "sync-failed", ...}``."""
        rec = dataclasses.asdict(self)
        rec.pop("ok")
        return {"event": "synced" if self.ok else "sync-failed", **rec, "seconds": round(self.seconds, 3)}


class CheckpointSync:
    """Runs the sync command in one background thread, one process at a time (see the module text)."""

    def __init__(
        self,
        words: t.Sequence[str],
        folder: Path,
        *,
        timeout: float,
        log_path: Path | None,
        on_end: t.Callable[[SyncResult], None],
    ) -> None:
        self.words = tuple(words)
        self.folder = folder
        self.timeout = timeout
        self.log_path = log_path
        self.on_end = on_end
        self._cond = threading.Condition()
        self._pending: tuple[int, str] | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return os.path.basename(self.words[0])

    def request(self, step: int, why: str) -> None:
        """Sync now, or when the running sync ends (the newest request wins); never blocks."""
        with self._cond:
            if self._closed:
                return
            self._pending = (step, why)
            if self._thread is None:
                # a daemon: a run that dies does not wait for its copy (close() waits, bounded, on a normal end)
                self._thread = threading.Thread(target=self._work, name="checkpoint-sync", daemon=True)
                self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cond:
            return self._thread is not None

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._pending is None or self._closed:
                    self._thread = None
                    self._cond.notify_all()
                    return
                step, why = self._pending
                self._pending = None
            result = self._run(step, why)
            try:
                self.on_end(result)
            except Exception:  # reporting must never end the sync thread: the next request would hang
                logger.exception("sync: reporting the result of step %d failed", step)

    def _run(self, step: int, why: str) -> SyncResult:
        argv = command(self.words, folder=self.folder, step=step)
        started = time.monotonic()
        offset = 0
        out: t.Any = subprocess.DEVNULL
        try:
            if self.log_path is not None:
                out = open(self.log_path, "ab")
                offset = out.tell()
        except OSError as e:  # a full disk: the sync may still free the box of its only copy
            logger.warning("sync: cannot write %s (%s): its output is dropped", self.log_path, e.strerror)
            out = subprocess.DEVNULL
        try:
            try:
                proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            except OSError as e:
                return self._result(step, why, started, None, False, f"cannot run {self.name}: {e.strerror}")
            with self._cond:
                self._proc = proc
            try:
                code: int | None = proc.wait(timeout=self.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_group(proc)
                code, timed_out = None, True
            with self._cond:
                self._proc = None
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        if timed_out:
            error = f"{self.name} ran past checkpoint.sync_timeout ({self.timeout:g} s): killed"
        elif code != 0:
            how = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
            last = last_line(self.log_path, offset, command_secrets(self.words)) if self.log_path is not None else None
            error = f"{self.name} failed ({how})" + (f": {last}" if last else "")
        else:
            error = None
        return self._result(step, why, started, code, timed_out, error)

    @staticmethod
    def _result(
        step: int, why: str, started: float, code: int | None, timed_out: bool, error: str | None
    ) -> SyncResult:
        return SyncResult(
            step=step,
            why=why,
            ok=error is None,
            exit_code=code,
            timed_out=timed_out,
            error=error,
            seconds=time.monotonic() - started,
        )

    def close(self, wait: float) -> bool:
        """At the run's end: let the running (and a pending) sync end within ``wait`` seconds, then kill
        what still runs. True when nothing was left running."""
        deadline = time.monotonic() + wait
        with self._cond:
            done = self._cond.wait_for(lambda: self._thread is None, timeout=max(0.0, wait))
            self._closed = True
            proc = self._proc
        if done:
            return True
        if proc is not None:
            logger.warning("sync: %s still runs after %.0f s at the run's end: killed", self.name, wait)
            kill_group(proc)
        with self._cond:
            self._cond.wait_for(lambda: self._thread is None, timeout=max(1.0, deadline - time.monotonic()))
        return False


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM the sync's process group (its own session: pgid = its pid), KILL it after ``KILL_GRACE``."""
    for sig, grace in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def last_line(path: Path | None, offset: int, secrets: t.Sequence[str] = ()) -> str | None:
    """The last non-empty line the sync wrote into its log (from ``offset``; its last 4 KiB), scrubbed of
    ``secrets`` and THEN cut to ``LINE_CHARS`` (a secret cut first would leave its head)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(offset, size - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return scrub(lines[-1], secrets)[:LINE_CHARS] if lines else None


__all__ = ["LOG_FILE", "CheckpointSync", "SyncResult", "command", "command_secrets"]
