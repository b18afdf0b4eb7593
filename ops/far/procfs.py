"""Processes and the machine as /proc tells them: stat, boot time, and THE liveness verdict. stdlib only.

Used by the runner, the agent and the release program (which reaches the far side by value, so this
module keeps to Python 3.7 at run time). dflash/checkpoint/checkpoints.py keeps its own small copy: the
training core does not import ``ops``.
"""

from __future__ import annotations

import datetime
import os
import time
import typing as t

# A record without its start ticks (older runners) names a process born at most this long after it.
STARTED_AT_SLACK = 120.0


if t.TYPE_CHECKING or hasattr(t, "TypedDict"):

    class ProcessFacts(t.TypedDict):
        pid: int
        alive: bool
        state: str | None  # the /proc state letter, None when there is no such process
        same: bool | None  # the recorded start matches (None: nothing recorded to compare)

else:  # Python 3.7 has no TypedDict: the release program must still run there, to say it is too old
    ProcessFacts = dict


def boot_time() -> float | None:
    """When this machine booted, in seconds since the epoch. From CLOCK_BOOTTIME rather than
    /proc/stat's btime, which is cut to whole seconds (a start time would read up to 1 s early);
    not from /proc/uptime either, which lxcfs rewrites to the container's age inside LXC."""
    try:
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a pid, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # comm may hold spaces and parentheses: the fields start after the LAST ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[19])
    except (IndexError, ValueError):
        return None


class Stat(t.NamedTuple):
    """The fields of ``/proc/<pid>/stat`` the run's membership needs (see ops/far/members.py)."""

    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start: int  # clock ticks since boot: with the pid, the process's identity


def stat(pid: int) -> Stat | None:
    """``/proc/<pid>/stat`` as a ``Stat``, or None when there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
    try:
        return Stat(pid, rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def start_epoch(ticks: int | None) -> float | None:
    """Clock ticks since boot -> seconds since the epoch (on this machine's clock)."""
    bt = boot_time()
    if ticks is None or bt is None:
        return None
    return round(bt + ticks / os.sysconf("SC_CLK_TCK"), 2)


def pid1_start() -> tuple[float | None, int | None]:
    """When PID 1 as seen here started: the container's boot, as (epoch seconds, clock ticks since
    the host booted). The ticks are its identity: a restarted container has a new PID 1, new ticks."""
    st = proc_stat(1)
    return (start_epoch(st[1]), st[1]) if st else (None, None)


def oom_kill_count() -> int | None:
    """cgroup v2 ``memory.events`` oom_kill (v1 ``memory.oom_control``) of our cgroup, or None."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0":
                    candidates.append("/sys/fs/cgroup{}/memory.events".format(parts[2].rstrip("/")))
    except OSError:
        pass
    candidates += ["/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"]
    for path in candidates:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def _epoch(iso_text: object) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(iso_text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def process_facts(pid: object, start: object, started_at: object = None) -> ProcessFacts | None:
    """Is the recorded pid still OUR process? The one verdict: a live (non-zombie) process whose start
    is the recorded one (``start``: clock ticks since boot, as the runner records them); without
    ticks, one not born well after ``started_at`` (ISO time); without either, any live process."""
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    st = proc_stat(pid)
    if st is None:
        return {"pid": pid, "alive": False, "state": None, "same": None}
    state, ticks = st
    same: bool | None = None
    if isinstance(start, int) and not isinstance(start, bool):
        same = ticks == start
    elif started_at is not None:
        began, recorded = start_epoch(ticks), _epoch(started_at)
        if began is not None and recorded is not None:
            same = began <= recorded + STARTED_AT_SLACK  # a process born well after the record reuses the pid
    alive = state not in ("Z", "X") and same is not False
    return {"pid": pid, "alive": alive, "state": state, "same": same}


def alive(pid: object, start: object, started_at: object = None) -> bool:
    p = process_facts(pid, start, started_at)
    return bool(p and p["alive"])
