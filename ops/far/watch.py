"""Who watches a run: the supervisor's heartbeat, ``<run_dir>/<session>/supervisor.json``. stdlib only.

Every probe of a supervisor (restart-on-crash, on the operator's machine or installed on the Proxmox host
by `dflashctl supervise install`) carries a heartbeat; the agent writes it here, next to the run's own
records, so `dflashctl status` from anywhere reads who watches in the same call that reads the run, on the
container's one clock. The record is also a lease: a supervisor with another ``id`` is refused while the
holder is live (not stopped, and heard from within ``STALE_AFTER`` of its intervals), so two supervisors,
on two machines, never restart one run twice. A supervisor that stops on purpose says so (``stopped``):
its lease ends at once. A supervisor that proved the holder dead (its heartbeat came from the same machine,
and its pid is gone there: only that machine can tell) names the lease it breaks (``breaks``: the holder's
``id``); the record then says whose it broke (``took_over``). (docs/design.md sections 4 and 18.)
"""

from __future__ import annotations

import json
import math
import os
import typing as t

from ops.far import lock, records
from ops.far.atomic import write_json_atomic

HEARTBEAT = "supervisor.json"
LOCK = ".supervisor.lock"
STALE_AFTER = 3  # intervals without a heartbeat before a supervisor is called stale (and its lease ends)
# The agent writes ``at`` and reads it on the same clock: a heartbeat from further ahead than this was
# written before the clock stepped back (or by hand), and would hold the lease for as long as the step.
FUTURE_SLACK = 5.0
MAX_INTERVAL = 86400.0  # a supervisor probes at least once a day
MAX_TIME = 253402300800.0  # 10000-01-01: past it no clock and no time formatting goes

# The heartbeat's keys and their types: anything else in a request is dropped (nothing unbounded lands on disk).
_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "by": (str,),
    "where": (str,),
    "mode": (str,),
    "pid": (int,),
    "interval": (int, float),
    "started_at": (int, float),
    "stopped": (bool,),
    "last_action": (dict,),
}
MAX_TEXT = 400  # characters of one string value
MAX_ACTION = 4096  # bytes of last_action as JSON


def clean(beat: t.Any) -> dict[str, t.Any] | None:
    """The heartbeat of a request, reduced to the known keys; None when it is not one (no ``id``)."""
    if not isinstance(beat, dict) or not isinstance(beat.get("id"), str) or not beat["id"]:
        return None
    out: dict[str, t.Any] = {}
    for key, types in _FIELDS.items():
        value = beat.get(key)
        if isinstance(value, bool) and bool not in types:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and number(value, 0.0, MAX_TIME) is None:
            continue  # NaN, Infinity, negative or beyond any clock: never written, never a lease
        if isinstance(value, types):
            out[key] = value[:MAX_TEXT] if isinstance(value, str) else value
    if "last_action" in out:
        try:
            size = len(json.dumps(out["last_action"], allow_nan=False))
        except (ValueError, RecursionError):
            size = MAX_ACTION + 1
        if size > MAX_ACTION or records.depth(out["last_action"]) > records.MAX_DEPTH:
            out["last_action"] = {"note": "last action too large to keep"}
    return out


def read(session_dir: str) -> dict[str, t.Any] | None:
    """The heartbeat record, None when there is none; ``{"unreadable": why}`` when it cannot be read
    (such a record holds no lease, and `status` shows why)."""
    rec, err = records.read_json(os.path.join(session_dir, HEARTBEAT), limit=records.MAX_SMALL)
    return {"unreadable": err} if err is not None else rec


def number(value: t.Any, low: float, high: float) -> float | None:
    """``value`` as a float when it is a finite number in [low, high] (never a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return x if math.isfinite(x) and low <= x <= high else None


def unreadable(rec: t.Mapping[str, t.Any], now: float | None) -> str | None:
    """Why ``rec``'s lease cannot be read (``at`` or ``interval`` not a usable number, ``at`` ahead of
    the container's clock), else None. Such a record holds no lease."""
    if isinstance(rec.get("unreadable"), str):
        return str(rec["unreadable"])[:300]
    at, interval = number(rec.get("at"), 0.0, MAX_TIME), number(rec.get("interval"), 0.0, MAX_INTERVAL)
    if at is None:
        return f"at: {json.dumps(rec.get('at'))[:40]} is not a time"
    if not interval:
        return f"interval: {json.dumps(rec.get('interval'))[:40]} is not a number of seconds in (0, {MAX_INTERVAL:g}]"
    if now is not None and at > now + FUTURE_SLACK:
        return f"at is {at - now:.0f} s ahead of the container's clock"
    return None


def silent_for(rec: t.Mapping[str, t.Any], now: float) -> float | None:
    at = number(rec.get("at"), 0.0, MAX_TIME)
    return None if at is None or at > now + FUTURE_SLACK else max(0.0, now - at)


def live(rec: t.Mapping[str, t.Any] | None, now: float) -> bool:
    """Whether the supervisor of ``rec`` still holds its lease: not stopped, its numbers readable, heard
    from within STALE_AFTER intervals."""
    if not rec or rec.get("stopped") or unreadable(rec, now) is not None:
        return False
    quiet = silent_for(rec, now)
    return quiet is not None and quiet <= STALE_AFTER * float(rec["interval"])


def beat(session_dir: str, heartbeat: t.Any, now: float) -> dict[str, t.Any]:
    """Write ``heartbeat`` unless another live supervisor holds the lease; never raises.

    Returns ``{"written": bool, "refused": bool, "holder": the live record that refused it | None,
    "error": why it could not be written | None}``."""
    hb = clean(heartbeat)
    if hb is None:
        return {"written": False, "refused": False, "holder": None, "error": "not a heartbeat (no id)"}
    try:
        os.makedirs(session_dir, exist_ok=True)
        with lock.Lock(os.path.join(session_dir, LOCK), wait=5.0, holder=f"heartbeat by pid {os.getpid()}"):
            prev = read(session_dir)
            breaks = heartbeat.get("breaks")
            if prev is not None and prev.get("id") != hb["id"] and live(prev, now):
                if not isinstance(breaks, str) or breaks != prev.get("id"):
                    return {"written": False, "refused": True, "holder": prev, "error": None}
                hb["took_over"] = {k: prev.get(k) for k in ("id", "by", "where", "pid")}
            write_json_atomic(os.path.join(session_dir, HEARTBEAT), {**hb, "at": now}, mode=0o644)
    except (OSError, lock.Busy) as e:
        return {"written": False, "refused": False, "holder": None, "error": str(e)}
    return {"written": True, "refused": False, "holder": None, "error": None}
