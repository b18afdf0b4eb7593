"""The run's processes: every process its command started, found and ended as one (docs/design.md
section 5). stdlib only.

A run is every process its command started, whatever the command is: a script, torchrun (whose workers
run in sessions of their own), a pipeline, a program that calls setsid or forks into the background.
They are found two ways, so that neither a setsid, a double fork nor the keeper's own death hides one:

- the tree: the keeper is a child subreaper (``PR_SET_CHILD_SUBREAPER``), so an orphan of the command's
  tree (its parent died, it double-forked away) is re-parented to the keeper, not to the container's
  init: while the keeper lives, every member is one of its descendants, environment or not;
- the tag: every process of the run carries ``DFLASH_RUN_TAG=<session>/<attempt>/<nonce>`` and
  ``DFLASH_RUN_DIR=<attempt dir>`` in its environment, inherited by whatever it starts, so a scan of
  ``/proc/*/environ`` finds them after the keeper died (and the agent finds them without the keeper).
  A tag counts only as its attempt's run.json records it, nonce and all: anyone can set those two
  variables, and a process that merely names the session is not the run's (nor is it ours to end).

The known limit: a process that starts with an emptied environment (``env -i``, an exec with a fresh
environment) or overwrites its own (setproctitle) carries no tag; it is found through the tree only,
that is while the keeper lives (or while a tagged parent of it does).

A member is named by (pid, start ticks); a signal reaches that process only (through a pidfd where
the kernel has them, else its start time is checked just before the kill): never a stranger that reused
the pid.
"""

from __future__ import annotations

import os
import re
import signal
import typing as t

from ops.far import records
from ops.far.procfs import Stat, alive, stat
from ops.far.protocol import MemberFacts

TAG = "DFLASH_RUN_TAG"
RUN_DIR = "DFLASH_RUN_DIR"
ARGV_KEEP = 6  # argv words kept per member (records and messages name a process, they do not archive it)
ARGV_CHARS = 200
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


class Member(t.NamedTuple):
    pid: int
    start: int  # clock ticks since boot: (pid, start) is the process
    ppid: int
    pgid: int
    sid: int
    state: str
    attempt: int | None  # from its tag (None: found through the tree only)
    argv: list[str]

    def record(self) -> dict[str, t.Any]:
        """How records and answers name it: {pid, start, argv}."""
        return {"pid": self.pid, "start": self.start, "argv": self.argv}


def new_tag(session: str, attempt: int) -> str:
    return f"{session}/{attempt}/{os.urandom(6).hex()}"


def tag_attempt(tag: str | None) -> int | None:
    parts = (tag or "").split("/")
    if len(parts) != 3 or not re.fullmatch(r"[0-9]{1,9}", parts[1]):
        return None  # anyone can set a tag: no 5,000-digit attempt number
    return int(parts[1])


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` through libc; False where there is none (not Linux) or it refused."""
    try:
        import ctypes  # here: only the keeper and a torchrun worker call it; the agent must start fast

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphans of this process's tree re-parent to it (Linux >= 3.4), whatever sessions they made."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


# --------------------------------------------------------------------------------------------
# Finding them


def _env_facts(pid: int) -> tuple[str | None, str | None]:
    """(DFLASH_RUN_TAG, DFLASH_RUN_DIR) of a process; (None, None) when unreadable (another user's)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None, None
    if b"DFLASH_RUN_TAG=" not in raw:
        return None, None  # the common case, decided without splitting
    tag = run_dir = None
    for item in raw.split(b"\0"):
        if item.startswith(b"DFLASH_RUN_TAG="):
            tag = item[len(b"DFLASH_RUN_TAG=") :].decode("utf-8", "replace")
        elif item.startswith(b"DFLASH_RUN_DIR="):
            run_dir = item[len(b"DFLASH_RUN_DIR=") :].decode("utf-8", "replace")
    return tag, run_dir


def argv_of(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(4096)
    except OSError:
        return []
    words = [w.decode("utf-8", "replace") for w in raw.split(b"\0") if w][:ARGV_KEEP]
    return [w if len(w) <= ARGV_CHARS else w[: ARGV_CHARS - 3] + "..." for w in words]


def _table() -> dict[int, Stat]:
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if name.isdigit():
            st = stat(int(name))
            if st is not None:
                out[st.pid] = st
    return out


def scan(
    *, tag: str | None = None, session: str | None = None, session_dir: str | None = None, keepers: t.Sequence[int] = ()
) -> list[Member]:
    """The live members of a run: the processes tagged ``tag`` (or, without it, with any tag of
    ``session`` whose DFLASH_RUN_DIR lies in ``session_dir``: every attempt of the session), every
    descendant of those, and every descendant of the live ``keepers`` (the keepers themselves are not
    members). Zombies are dead already: not members. Sorted by start, the command first."""
    table = _table()
    here = os.path.realpath(session_dir) if session_dir else None
    prefix = (session + "/") if session else None
    roots: dict[int, int | None] = {}  # pid -> the attempt its tag names
    recorded: dict[int, str | None] = {}  # attempt -> the tag its run.json holds
    for pid in table:
        if pid == os.getpid():
            continue
        found, run_dir = _env_facts(pid)
        if found is None:
            continue
        if tag is not None:
            if found != tag:
                continue
        elif prefix is None or not found.startswith(prefix):
            continue
        elif here is not None and (run_dir is None or os.path.realpath(os.path.dirname(run_dir)) != here):
            continue  # another run_dir's session of the same name
        elif here is not None and not _recorded(found, here, recorded):
            continue  # a tag no attempt of the session recorded: not the run's
        roots[pid] = tag_attempt(found)
    children: dict[int, list[int]] = {}
    for st in table.values():
        children.setdefault(st.ppid, []).append(st.pid)
    keep = set(keepers)
    members: dict[int, int | None] = {}
    todo = [(pid, attempt) for pid, attempt in roots.items()]
    todo += [(kid, None) for k in keep for kid in children.get(k, [])]
    while todo:
        pid, attempt = todo.pop()
        if pid in keep or pid == os.getpid():
            continue
        if pid in members:
            if members[pid] is None and attempt is not None:
                members[pid] = attempt
            continue
        members[pid] = roots.get(pid, attempt)
        todo += [(kid, members[pid]) for kid in children.get(pid, [])]
    out = []
    for pid, attempt in members.items():
        st = table[pid]
        if st.state in ("Z", "X"):
            continue
        out.append(Member(pid, st.start, st.ppid, st.pgid, st.sid, st.state, attempt, argv_of(pid)))
    return sorted(out, key=lambda m: (m.start, m.pid))


def _recorded(tag: str, session_dir: str, cache: dict[int, str | None]) -> bool:
    """Whether ``tag`` is the one its attempt's run.json holds (the keeper's nonce, not just the names)."""
    n = tag_attempt(tag)
    if n is None or n < 1:
        return False
    if n not in cache:
        run, _ = records.read_json(os.path.join(session_dir, records.attempt_name(n), records.RUN_JSON))
        cache[n] = run.get("tag") if run is not None and isinstance(run.get("tag"), str) else None
    return cache[n] == tag


def foreign_run(pane: t.Mapping[str, t.Any] | None, session_dir: str) -> str | None:
    """The attempt dir of the runner in a pane when it lies outside ``session_dir``: the run of another
    host entry (same container, socket and session, another run_dir), not one started by hand."""
    try:
        with open(f"/proc/{int((pane or {}).get('pane_pid') or 0)}/cmdline", "rb") as f:
            argv = [w.decode("utf-8", "replace") for w in f.read(65536).split(b"\0")]
    except (OSError, ValueError):
        return None
    if "ops.far.runner" not in argv[:3] or "--attempt-dir" not in argv[:-1]:
        return None
    adir = argv[argv.index("--attempt-dir") + 1]
    here = os.path.realpath(session_dir)
    return None if os.path.realpath(os.path.dirname(adir)) == here else adir[: records.MAX_TEXT]


def keeper_alive(run: t.Mapping[str, t.Any]) -> bool:
    """Whether the keeper run.json names is alive (its pid AND its start time)."""
    return alive(run.get("keeper_pid"), run.get("keeper_start"))


def of_session(session: str, session_dir: str, run: t.Mapping[str, t.Any] | None = None) -> list[Member]:
    """Every live process of a session's runs, any attempt: by their tags, and below the keeper of
    ``run`` (the current attempt's run.json) while it lives."""
    keepers = [run["keeper_pid"]] if run and keeper_alive(run) else []
    return scan(session=session, session_dir=session_dir, keepers=keepers)


def facts(found: t.Sequence[Member]) -> list[MemberFacts]:
    """The probe's view of them (``ops.far.protocol.MemberFacts``)."""
    return [
        {
            "pid": m.pid,
            "start": m.start,
            "ppid": m.ppid,
            "pgid": m.pgid,
            "sid": m.sid,
            "state": m.state,
            "attempt": m.attempt,
            "argv": m.argv,
        }
        for m in found
    ]


def describe(found: t.Sequence[Member] | t.Sequence[t.Mapping[str, t.Any]], limit: int = 4) -> str:
    """``pid 12 (python train.py --config), pid 13 (tee log)``: how messages name members (records too)."""
    parts = []
    for m in found[:limit]:
        pid, argv = (m.pid, m.argv) if isinstance(m, Member) else (m.get("pid"), m.get("argv") or [])
        words = " ".join(os.path.basename(w) if "/" in w and not w.startswith("-") else w for w in map(str, argv[:3]))
        parts.append(f"pid {pid}" + (f" ({words})" if words else ""))
    more = len(found) - limit
    return ", ".join(parts) + (f" and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------------------------
# Ending them


def send(pid: int, start: int | None, sig: int) -> bool:
    """Signal the process (pid, start) and no other; False when it is gone (or the pid is another's)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    send_fd = getattr(signal, "pidfd_send_signal", None)
    fd = None
    if pidfd_open is not None and send_fd is not None:
        try:
            fd = pidfd_open(pid)  # from here on the fd IS that process, whatever happens to the pid
        except OSError:
            fd = None  # gone already, or a kernel before 5.3: the start check below still holds
    try:
        st = stat(pid)
        if st is None or st.state in ("Z", "X") or (start is not None and st.start != start):
            return False
        if fd is not None and send_fd is not None:
            send_fd(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def gentle_due(members: t.Sequence[Member], command_pid: int | None) -> list[Member]:
    """Who an interrupt or a TERM goes to: the command's process group (the command leads its own, as
    a shell's job does: what a terminal's Ctrl-C reaches), and every member no other member would pass
    it to (its parent is the keeper, init, or gone). A member in a group of its own under a live member
    (torchrun's worker under its agent) gets it from that parent, once: a second signal would make
    ``dflash train`` exit without its checkpoint. Should that parent die, the member is due next round."""
    pids = {m.pid for m in members}
    return [m for m in members if (command_pid is not None and m.pgid == command_pid) or m.ppid not in pids]


class Ending:
    """One end of a run, step by step (interrupt, TERM, KILL): each step's signal reaches each member
    due it once, including members that become due later (a member whose parent died meanwhile).
    The keeper uses it, and the agent when the keeper is gone; ``killed`` names who had to be SIGKILLed."""

    def __init__(self, command_pid: int | None) -> None:
        self.command_pid = command_pid
        self.step: int | None = None
        self.sent: dict[tuple[int, int], set[int]] = {}
        self.killed: list[Member] = []

    def ask(self, sig: int) -> None:
        self.step = sig

    def deliver(self, members: t.Sequence[Member]) -> list[Member]:
        """Send the current step's signal to the due members that have not had it; returns them."""
        if self.step is None:
            return []
        due = list(members) if self.step == signal.SIGKILL else gentle_due(members, self.command_pid)
        done = []
        for m in due:
            got = self.sent.setdefault((m.pid, m.start), set())
            if self.step in got:
                continue
            if send(m.pid, m.start, self.step):
                got.add(self.step)
                done.append(m)
                if self.step == signal.SIGKILL:
                    self.killed.append(m)
        return done
