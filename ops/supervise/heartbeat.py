"""A supervisor's heartbeat, from its side: who it is, what it last did, and its lease on the session.

Every probe of a supervisor carries ``request()``; the agent writes it to ``<run_dir>/<session>/supervisor.json``
(ops/far/watch.py) unless another live supervisor holds the lease, and `dflashctl status` shows who
watches from it. ``check()`` reads the agent's answer: refused is ``SupervisorLocked`` (one line: who holds
it), so two supervisors on two machines never both restart a run. The installed supervisor also keeps
its own status file on the host (``status_file``) for `dflashctl supervise status`. (docs/design.md section 18.)
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import typing as t
from pathlib import Path

from ops import errors
from ops.far import watch
from ops.far.atomic import write_json_atomic
from ops.probe import Status, iso
from ops.supervise.policy import Decision
from ops.times import duration

FOREGROUND = "foreground"  # restart-on-crash run by hand (a terminal, cron, a unit of the user's own)


def dead_here(holder: t.Mapping[str, t.Any]) -> bool:
    """Whether the lease's holder is provably dead: its heartbeat came from this machine and its pid is
    gone here. Anywhere else, or a pid that lives (whatever it runs now), proves nothing."""
    pid = holder.get("pid")
    if holder.get("where") != socket.gethostname() or isinstance(pid, bool) or not isinstance(pid, int):
        return False
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def holder_text(rec: t.Mapping[str, t.Any], now: float | None) -> str:
    """``pve (systemd, pid 812 on pve1), last probe 4 s ago``."""
    where = f" on {rec['where']}" if rec.get("where") else ""
    quiet = watch.silent_for(rec, now) if now is not None else None
    ago = f", last probe {duration(quiet)} ago" if quiet is not None else ""
    return f"{rec.get('by') or '?'} ({rec.get('mode') or '?'}, pid {rec.get('pid', '?')}{where}){ago}"


class Heartbeat:
    """One supervisor's identity. ``id`` is stable for an installed supervisor (it survives its own restarts,
    so a supervisor restarted by systemd takes its lease back at once) and random for one run by hand."""

    def __init__(
        self,
        *,
        interval: float,
        by: str | None = None,
        mode: str = FOREGROUND,
        id: str | None = None,
        status_file: Path | None = None,
        clock: t.Callable[[], float] = time.time,
    ) -> None:
        self.id = id or secrets.token_hex(8)
        self.where = socket.gethostname()
        self.by = by or self.where
        self.mode = mode
        self.interval = interval
        self.clock = clock
        self.started_at = clock()
        self.status_file = status_file
        self.last_action: dict[str, t.Any] | None = None
        self.probes = 0
        self._last_probe: dict[str, t.Any] | None = None
        self.error: str | None = None  # why it ended, when it ended on an error
        self.breaks: str | None = None  # the id of a dead holder's lease the next heartbeat breaks
        self.unsupported = False  # the deployed agent predates heartbeats

    def request(self, *, stopped: bool = False) -> dict[str, t.Any]:
        beat: dict[str, t.Any] = {
            "id": self.id,
            "by": self.by,
            "where": self.where,
            "mode": self.mode,
            "pid": os.getpid(),
            "interval": self.interval,
            "started_at": self.started_at,
        }
        if self.last_action is not None:
            beat["last_action"] = self.last_action
        if stopped:
            beat["stopped"] = True
        if self.breaks is not None:
            beat["breaks"] = self.breaks
        return beat

    def check(self, facts: t.Mapping[str, t.Any], what: str, *, wrote: bool) -> str | None:
        """The agent's answer to a probe: raises ``SupervisorLocked`` when another live supervisor watches
        ``what``; returns a note to say once (an agent that cannot take heartbeats)."""
        agent = facts.get("agent")
        if not isinstance(agent, dict):
            return None  # the agent was not reached: nothing is known about the lease
        if "supervisor" not in agent:
            if self.unsupported:
                return None
            self.unsupported = True
            return (
                "the deployed agent predates supervisor heartbeats: `dflashctl status` cannot show who watches, "
                "and two supervisors are not kept apart; run `dflashctl deploy`"
            )
        now = agent.get("now") if isinstance(agent.get("now"), (int, float)) else None
        hb = agent.get("heartbeat") or {}
        holder = hb.get("holder") if wrote else agent.get("supervisor")
        if wrote and hb.get("written"):
            self.breaks = None
        refused = wrote and hb.get("refused") and isinstance(holder, dict)
        if not wrote and isinstance(holder, dict) and holder.get("id") != self.id and now and watch.live(holder, now):
            refused = True
        if refused and isinstance(holder, dict) and dead_here(holder) and isinstance(holder.get("id"), str):
            # its lease would lock every other supervisor out for 3 of its intervals: broken, and said whose
            self.breaks = holder["id"]
            return (
                f"the lease on {what} of {holder_text(holder, now)} is void: pid {holder.get('pid')} is gone from "
                f"this machine ({self.where}); taking it over"
            )
        if refused and isinstance(holder, dict):
            raise self._locked(what, holder, now)
        if wrote and hb.get("error"):
            return f"note: the heartbeat could not be written ({hb['error']}): `dflashctl status` will call this supervisor stale"
        return None

    def _locked(self, what: str, holder: t.Mapping[str, t.Any], now: float | None) -> errors.SupervisorLocked:
        interval = watch.number(holder.get("interval"), 0.0, watch.MAX_INTERVAL)
        wait = (
            f", or wait until it is stale ({watch.STALE_AFTER} x its {duration(interval)} interval)"
            if interval is not None
            else ""
        )
        how = "`dflashctl supervise stop`" if holder.get("mode") in ("systemd", "tmux") else "Ctrl-C or kill <pid>"
        return errors.SupervisorLocked(
            f"another supervisor watches {what}: {holder_text(holder, now)}; stop it first ({how}){wait}"
        )

    def acted(self, incident: t.Mapping[str, t.Any]) -> None:
        """An incident was announced: it is the supervisor's last action (shown by status and supervise status)."""
        self.last_action = {
            "at": incident.get("done_at") or incident.get("time"),
            "action": incident.get("action"),
            "outcome": incident.get("outcome"),
            "state": incident.get("state"),
            "cause": incident.get("cause"),
            "attempt": incident.get("attempt"),
            "next_attempt": incident.get("next_attempt"),
            "reason": str(incident.get("reason") or "")[:300],
        }

    def probed(self, st: Status, d: Decision) -> None:
        """After each probe: the host-side status file of an installed supervisor (never raises)."""
        self.probes += 1
        self._last_probe = {
            "at": iso(self.clock()),
            "state": st.state,
            "cause": st.cause,
            "attempt": st.attempt,
            "headline": st.headline(),
            "decision": d.action,
            "reason": d.reason,
        }
        self._write(self.error)

    def ended(self) -> None:
        self._write(self.error, ended=True)

    def failed(self, message: str) -> None:
        """The supervisor ends on an error (a refused lease, nothing deployed): said in its status file."""
        self.error = message
        self._write(message, ended=True)

    def _write(self, error: str | None, *, ended: bool = False) -> None:
        if self.status_file is None:
            return
        try:
            write_json_atomic(
                self.status_file,
                {
                    "id": self.id,
                    "pid": os.getpid(),
                    "by": self.by,
                    "mode": self.mode,
                    "interval": self.interval,
                    "started_at": iso(self.started_at),
                    "probes": self.probes,
                    "last_probe": self._last_probe,
                    "last_action": self.last_action,
                    "error": error,
                    "ended_at": iso(self.clock()) if ended else None,
                },
                mode=0o600,
            )
        except OSError:
            pass  # a full disk must not end the watch; `supervise status` then shows the older file
