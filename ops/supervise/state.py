"""restart-on-crash's files: the state dir (0700), the per-session lock, incidents (0600 JSON files,
one per incident) and the --on-event hook that receives them."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import re
import shlex
import sys
import time
import typing as t
from pathlib import Path

from ops import errors
from ops.far.atomic import write_json_atomic
from ops.far.lock import holder_json
from ops.probe import Status, iso
from ops.state_dir import private_dir
from ops.states import RECOVERY
from ops.supervise.policy import Decision, Options
from ops.transport import LocalTransport

HOOK_TIMEOUT = 60.0


# --------------------------------------------------------------------------------------------
# The state dir: incidents, memory, lock


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


class Lock:
    """One supervisor per host+session: an flock'ed file holding the owner's pid. The kernel drops
    the lock when the owner dies, so a stale file never blocks."""

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self.fd: int | None = None

    def acquire(self) -> Lock:
        private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
            holder = holder_json(fd)
            os.close(fd)
            raise errors.SupervisorLocked(
                f"restart-on-crash is already watching {self.what}: pid {holder.get('pid', '?')}"
                f"{' since ' + holder['since'] if holder.get('since') else ''} holds {self.path}; "
                "stop that one first (Ctrl-C or kill <pid>)"
            ) from None
        info = {"pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv}
        os.fchmod(fd, 0o600)  # a lock file left by an older dflashctl was 0644
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class IncidentLog:
    """One JSON file per incident under ``<state dir>/incidents/``; an incident that goes on (a
    restart after its backoff) is rewritten in place, atomically."""

    def __init__(self, state_dir: Path, host: str, session: str) -> None:
        self.dir = state_dir / "incidents"
        self.host, self.session = host, session
        self.count = 0

    def path_for(self, incident: dict[str, t.Any], now: float) -> Path:
        self.count += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now * 1000) % 1000:03d}Z"
        att = f"attempt{incident['attempt']}" if incident.get("attempt") is not None else "noattempt"
        name = (
            f"{stamp}-{slug(self.host)}-{slug(self.session)}-{att}-{incident['state']}-{os.getpid()}-{self.count}.json"
        )
        return self.dir / name

    def write(self, path: Path, incident: dict[str, t.Any]) -> None:
        private_dir(self.dir)
        write_json_atomic(path, incident, mode=0o600)


def incident_for(st: Status, d: Decision, now: float, *, restarts: int, opts: Options) -> dict[str, t.Any]:
    """The facts of one incident (the keys are stable: hooks read them)."""
    return {
        "time": iso(now),
        "host": st.host,
        "session": st.session,
        "attempt": st.attempt,
        "state": st.state,
        "cause": st.cause,
        "detail": st.detail,
        "exit_code": st.exit_code,
        "signal": st.signal,
        "gpu": st.gpu,
        "gpu_bus_id": st.gpu_bus_id,
        "xid": st.xid,
        "fingerprint": st.fingerprint,
        "started_at": st.started_at,
        "ended_at": st.ended_at,
        "progress": dataclasses.asdict(st.progress) if st.progress else None,
        "evidence": list(st.evidence),
        "log": st.log,
        "log_tail": list(st.tail),
        "action": d.action,
        "reason": d.reason,
        "delay": round(d.delay, 3),
        "outcome": "pending" if d.action in RECOVERY else "noted",
        "next_attempt": None,
        "done_at": None,
        "error": None,
        "restarts_in_window": restarts,
        "options": dataclasses.asdict(opts),
        "supervisor_pid": os.getpid(),
        "hook": None,
    }


def run_hook(
    argv: t.Sequence[str], incident: dict[str, t.Any], path: Path | None, hide_env: t.Sequence[str] = ()
) -> dict[str, t.Any]:
    """``--on-event``: the incident as JSON on stdin, its gist in DFLASHCTL_* variables, without the
    secret variables named in ``hide_env`` (the inventory's API tokens). Through LocalTransport
    (its own session: a Ctrl-C meant for us does not reach it); never raises."""
    env = {
        "DFLASHCTL_STATE": incident.get("state") or "",
        "DFLASHCTL_CAUSE": incident.get("cause") or "",
        "DFLASHCTL_HOST": incident.get("host") or "",
        "DFLASHCTL_SESSION": incident.get("session") or "",
        "DFLASHCTL_ACTION": incident.get("action") or "",
        "DFLASHCTL_ATTEMPT": "" if incident.get("attempt") is None else str(incident["attempt"]),
        "DFLASHCTL_INCIDENT": str(path) if path else "",
    }
    # `env NAME=VALUE... cmd`: the variables travel as argv items, no shell, nothing to quote.
    unset = [a for name in hide_env for a in ("-u", name)]
    full = ["env", *unset, "--", *(f"{k}={v}" for k, v in env.items()), *argv]
    try:
        res = LocalTransport().run(full, stdin=json.dumps(incident).encode(), timeout=HOOK_TIMEOUT)
    except OSError as e:
        return {"ok": False, "exit_code": None, "error": f"cannot run {shlex.join(argv)}: {e}"}
    if res.timed_out:
        return {
            "ok": False,
            "exit_code": None,
            "error": f"{shlex.join(argv)}: no exit within {HOOK_TIMEOUT:g}s (killed)",
        }
    if res.exit_code != 0:
        last = (res.err.strip().splitlines() or res.out.strip().splitlines() or [""])[-1]
        how = f"signal {res.signal}" if res.exit_code is None else f"exit {res.exit_code}"
        return {
            "ok": False,
            "exit_code": res.exit_code,
            "error": f"{shlex.join(argv)}: {how}" + (f": {last}" if last else ""),
        }
    return {"ok": True, "exit_code": 0, "error": None}


def parse_hook(cmd: str | None) -> list[str] | None:
    if cmd is None:
        return None
    try:
        argv = shlex.split(cmd)
    except ValueError as e:
        raise errors.ConfigError("--on-event", f"cannot split {cmd!r} like a shell would: {e}") from None
    if not argv:
        raise errors.ConfigError("--on-event", "empty command")
    return argv
