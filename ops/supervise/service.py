"""The supervisor installed on the Proxmox host, and the verbs `dflashctl supervise` calls there.

Runs ON THE HOST (not in the container) from dflashctl's own release in ``<dir>/current``, with the host's
python and the stdlib only (nothing is installed there: no click, no paramiko; the local transport is
subprocess + ``pct``)::

    <python> -I -c BOOT <dir>/current <install|status|stop|uninstall|logs>   < request.json  -> one JSON answer
    <dir>/bin/dflashctl-supervise run|loop <session> [restart-on-crash options]       the supervisor itself

The files are ops/supervise/unit.py's; what a user sees is docs/overnight.md; the contract is
docs/design.md section 18. Secrets (the API token's value, --notify URLs) arrive in the JSON request on
stdin and are kept in ``env.json`` (0600), never on a command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import importlib.util
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
import typing as t
from pathlib import Path

from ops import errors
from ops.far import refusal, request, tmux
from ops.far.atomic import create_new, write_json_atomic
from ops.far.lock import holder_json
from ops.hosts import Host, load_inventory, supervise_dir_problem
from ops.state_dir import private_dir
from ops.supervise import exclusions, record, unit
from ops.supervise.exclusions import Exclusions
from ops.supervise.heartbeat import Heartbeat
from ops.supervise.loop import Supervisor
from ops.supervise.policy import Options
from ops.supervise.state import slug
from ops.transport import CommandResult, LocalTransport

VERBS = ("install", "status", "stop", "uninstall", "logs", "gpus")
START_WAIT = 60.0  # seconds install waits for the new supervisor's first probe
STOP_WAIT = 30.0  # seconds stop waits for the supervisor to let go of its lock
LOG_WINDOW = 1 << 20  # `logs` reads at most this many bytes from the log's end
LOG_ROTATE = 16 << 20  # a log bigger than this is moved to supervisor.log.1 when a supervisor starts
INCIDENTS_SHOWN = 10


class Failed(Exception):
    """A verb's refusal: ``kind`` for the operator's side, the message for the user (one line)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class BadConfig(Failed):
    """A value the user gave is wrong (``key``: what names it): the operator's side raises a ConfigError."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(refusal.BAD_CONFIG, message)
        self.key = key


def _run(argv: list[str], timeout: float = 60.0) -> CommandResult:
    """Every command of the service (systemctl, tmux): through the local transport."""
    return LocalTransport().run(argv, timeout=timeout)


def systemd_runs() -> bool:
    """systemd is PID 1 (sd_booted(3): the folder /run/systemd/system exists)."""
    return os.path.isdir("/run/systemd/system")


# --------------------------------------------------------------------------------------------
# The session's files


@dataclasses.dataclass(frozen=True)
class Place:
    root: str
    session: str

    @property
    def dir(self) -> str:
        return unit.session_dir(self.root, self.session)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def lock_path(self, by: str) -> str:
        # the Supervisor's own lock (ops/supervise/loop.py): <state>/supervise/<host>.<session>.lock
        return os.path.join(self.dir, "supervise", f"{slug(by)}.{slug(self.session)}.lock")

    def read(self, name: str) -> dict[str, t.Any] | None:
        """A record the supervisor writes (status.json): None when missing or unreadable (the next write mends it)."""
        try:
            return record.load(self.path(name))
        except record.BadRecord:
            return None

    def service(self) -> dict[str, t.Any] | None:
        """service.json, checked (BadRecord: one line naming the file and the key); None: not installed."""
        path = self.path(unit.SERVICE_JSON)
        doc = record.load(path)
        if doc is None:
            return None
        for key in ("id", "by", "mode", "tmux_socket"):
            record.field(doc, path, key, str)
        if doc["mode"] not in ("systemd", "tmux"):
            raise record.BadRecord(f'{path}: mode: expected "systemd" or "tmux", got {doc["mode"][:40]!r}')
        record.field(doc, path, "container", int, required=False)
        for key in ("installed_at", "release", "python"):
            record.field(doc, path, key, str, required=False)
        opts = record.field(doc, path, "options", dict)
        try:
            Options(**opts)
        except (TypeError, ValueError, errors.ConfigError) as e:
            raise record.BadRecord(f"{path}: options: {str(e)[:200]}") from None
        return doc

    def secrets(self) -> tuple[dict[str, str], list[str]]:
        """env.json, checked: the environment the supervisor needs (the API token) and the --notify URLs."""
        path = self.path(unit.ENV_JSON)
        doc = record.load(path) or {}
        return record.string_map(doc, path, "env"), record.strings(doc, path, "notify")


def lock_holder(path: str) -> dict[str, t.Any] | None:
    """Who holds the supervisor's lock (its JSON: pid, since, argv), None when nobody does. The lock is
    an flock: a dead supervisor holds nothing, whatever its file says."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                return None
            return holder_json(fd) or {"pid": None}
        return None  # we got it: nobody holds it (closing the fd lets go)
    finally:
        os.close(fd)


def ours(holder: t.Mapping[str, t.Any], place: Place) -> bool:
    """Whether the lock's holder is this session's installed supervisor (its argv says so)."""
    argv = holder.get("argv")
    return (
        isinstance(argv, list)
        and len(argv) >= 4
        and argv[0] == unit.MARK
        and argv[2] == place.root
        and argv[3] == place.session
    )


# --------------------------------------------------------------------------------------------
# Starting and stopping, by mode


def _tmux_alive(socket: str, session: str) -> bool:
    res = _run([*tmux.base(socket), "has-session", "-t", tmux.exact(session)], timeout=15)
    return bool(res.exit_code == 0)


def _start(place: Place, mode: str, socket: str, opts: Options) -> None:
    if mode == "systemd":
        name = unit.unit_name(place.session)
        path = os.path.join(unit.UNIT_DIR, name)
        _write_text(path, unit.unit_text(place.root, place.session, opts), 0o644)
        for argv in (["systemctl", "daemon-reload"], ["systemctl", "enable", name], ["systemctl", "restart", name]):
            res = _run(argv)
            if res.exit_code != 0:
                raise Failed("systemd", f"{' '.join(argv)} failed: {(res.err.strip() or res.out.strip())[-300:]}")
        return
    if shutil.which("tmux") is None:
        raise Failed(refusal.NO_TMUX, "systemd is not PID 1 here and tmux is not installed: apt-get install tmux")
    command = unit.supervisor_argv(place.root, place.session, opts, loop=True)
    # One invocation (options before the command can end); tmux's shell is /bin/sh, the start dir constant.
    argv = [
        *tmux.base(socket),
        "start-server",
        ";",
        "set-option",
        "-g",
        "default-shell",
        tmux.SHELL,
        ";",
        "new-session",
        "-d",
        "-s",
        place.session,
        "-x",
        "200",
        "-y",
        "50",
        "-c",
        tmux.SAFE_CWD,
        shlex.join(["exec", *command]),
    ]
    res = _run(argv, timeout=30)
    if res.exit_code != 0:
        raise Failed("tmux", f"tmux -L {socket} new-session failed: {res.err.strip()[-300:]}")


def _stop(place: Place, mode: str | None, socket: str, by: str) -> dict[str, t.Any]:
    """Stop the session's supervisor (the run is never touched); waits for its lock to be let go."""
    holder = lock_holder(place.lock_path(by))
    if mode == "systemd":
        _run(["systemctl", "stop", unit.unit_name(place.session)], timeout=STOP_WAIT + 100)
    elif _tmux_alive(socket, place.session):
        # SIGHUP to the loop and the supervisor: it stops like on SIGTERM (its heartbeat says `stopped`)
        _run([*tmux.base(socket), "kill-session", "-t", tmux.exact(place.session)], timeout=15)
    deadline = time.monotonic() + STOP_WAIT
    while (h := lock_holder(place.lock_path(by))) is not None and time.monotonic() < deadline:
        if time.monotonic() > deadline - STOP_WAIT / 2 and ours(h, place) and isinstance(h.get("pid"), int):
            try:  # still there after half the wait: our own supervisor, by the pid its lock names
                os.kill(h["pid"], signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    left = lock_holder(place.lock_path(by))
    return {"was_running": holder is not None, "pid": (holder or {}).get("pid"), "stopped": left is None}


# --------------------------------------------------------------------------------------------
# Verbs


def install(req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    place = Place(str(req["dir"]), str(req["session"]))
    if not os.path.isfile(os.path.join(place.root, unit.MARKER)):
        raise Failed(refusal.NOT_OURS, f"{place.root} is not dflashctl's (no {unit.MARKER} in it): nothing was written")
    by, socket = str(req["by"]), str(req.get("tmux_socket") or "dflashctl-supervise")
    entry = dict(req["entry"])
    notes: list[str] = []
    before = place.service()
    if before and (before.get("by"), before.get("container")) != (by, entry.get("container")):
        raise Failed(
            refusal.TAKEN,
            f"session {place.session} on this host is already supervised for {before.get('by')} "
            f"(ct {before.get('container')}): use another --session, or uninstall that one first",
        )
    holder = lock_holder(place.lock_path(by))
    if holder is not None and not ours(holder, place):
        raise Failed(
            refusal.LOCKED,
            f"another supervisor holds the lock of session {place.session} on this host: pid {holder.get('pid')}"
            f"{' since ' + str(holder['since']) if holder.get('since') else ''} ({' '.join(map(str, holder.get('argv') or []))[:200]}); "
            "stop it first",
        )
    mode = str(req.get("mode") or "auto")
    if mode == "auto":
        mode = "systemd" if systemd_runs() else "tmux"
    if mode == "systemd" and not systemd_runs():
        raise Failed("no-systemd", "mode = systemd, but systemd is not PID 1 on this host (no /run/systemd/system)")
    opts = Options(**{**dict(req.get("options") or {}), "once": False})

    proxmox = req.get("proxmox")
    if proxmox and importlib.util.find_spec("proxmoxer") is None:
        notes.append(
            f"{sys.executable} here cannot import proxmoxer: the supervisor uses pct for the container's status "
            "and start (it is local here; the API token is not needed)"
        )
        proxmox = None
    env = {k: v for k, v in dict(req.get("env") or {}).items() if proxmox and k == proxmox.get("token_value_env")}
    if req.get("notify") and importlib.util.find_spec("apprise") is None:
        # refused now, not found out at the first incident of the night
        raise Failed(
            "no-apprise",
            f"--notify: {sys.executable} on this host cannot import apprise: install it for that python "
            "(apt install python3-apprise, or pip install apprise), or install without --notify",
        )
    _check_notify(list(req.get("notify") or []))

    replaced = _stop(place, (before or {}).get("mode"), socket, by) if before else None
    if before and before.get("mode") != mode and before.get("mode") == "systemd":
        _disable_unit(place)
    private_dir(Path(place.dir))
    ident = (before or {}).get("id") or secrets.token_hex(8)
    _write_text(place.path(unit.HOSTS_TOML), unit.hosts_text(by, entry, proxmox), 0o600)
    try:
        host = load_inventory(place.path(unit.HOSTS_TOML)).get(by)  # the very code the supervisor reads it with
    except errors.ConfigError as e:
        raise Failed("bad-entry", f"the host entry written for the supervisor does not parse: {e}") from None
    write_json_atomic(place.path(unit.ENV_JSON), {"env": env, "notify": list(req.get("notify") or [])}, mode=0o600)
    service = {
        "id": ident,
        "by": by,
        "container": host.container,
        "mode": mode,
        "tmux_socket": socket,
        "options": dataclasses.asdict(opts),
        "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "release": os.path.basename(os.path.realpath(os.path.join(place.root, "current"))),
        "python": sys.executable,
    }
    write_json_atomic(place.path(unit.SERVICE_JSON), service, mode=0o600)
    os.makedirs(os.path.join(place.root, "bin"), exist_ok=True)
    _write_text(os.path.join(place.root, unit.LAUNCHER), unit.launcher_text(place.root, sys.executable), 0o755)
    try:
        os.unlink(place.path(unit.STATUS_JSON))  # what the last supervisor said: the new one's first probe decides
    except FileNotFoundError:
        pass
    _start(place, mode, socket, opts)
    first = _first_probe(place, by)
    if first.get("error"):
        _stop(place, mode, socket, by)
        if mode == "systemd":
            _disable_unit(place)
        raise Failed(refusal.REFUSED, f"the supervisor did not start watching: {first['error']}")
    runs = lock_holder(place.lock_path(by)) or {}  # the supervisor that holds the lock now is the one reported
    return {
        "mode": mode,
        "unit": unit.unit_name(place.session) if mode == "systemd" else None,
        "tmux_socket": socket if mode == "tmux" else None,
        "id": ident,
        "pid": runs.get("pid") if isinstance(runs.get("pid"), int) else first.get("pid"),
        "first_probe": first.get("last_probe"),
        "replaced": replaced,
        "updated": before is not None,
        "notes": notes,
        "dir": place.dir,
        "log": place.path(unit.LOG),
        "command": unit.supervisor_argv(place.root, place.session, opts, loop=mode == "tmux"),
    }


def _check_notify(urls: list[str]) -> None:
    """The supervisor's notifier is built from these URLs: what it would refuse is refused now, in one line."""
    if not urls:
        return
    from ops.notify import check_url  # apprise is the host's optional extra

    for i, url in enumerate(urls, 1):
        try:
            check_url(url, i)
        except errors.ConfigError as e:
            raise BadConfig(e.path, e.message) from None


def _first_probe(place: Place, by: str) -> dict[str, t.Any]:
    """The new supervisor's status file once it probed (or failed); a note when it did not in time."""
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        st = place.read(unit.STATUS_JSON)
        if st and (st.get("error") or st.get("probes")):
            return st
        time.sleep(0.1)
    holder = lock_holder(place.lock_path(by)) or {}
    return {"pid": holder.get("pid"), "last_probe": None, "error": None, "note": "no probe yet"}


def _disable_unit(place: Place) -> None:
    name = unit.unit_name(place.session)
    _run(["systemctl", "disable", "--now", name], timeout=STOP_WAIT + 100)
    try:
        os.unlink(os.path.join(unit.UNIT_DIR, name))
    except FileNotFoundError:
        pass
    _run(["systemctl", "daemon-reload"])


def status(req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    place = Place(str(req["dir"]), str(req["session"]))
    service = place.service()
    if service is None:
        return {"installed": False, "dir": place.dir}
    by = str(service.get("by"))
    holder = lock_holder(place.lock_path(by))
    mode = service.get("mode")
    facts: dict[str, t.Any] = {}
    if mode == "systemd":
        res = _run(
            [
                "systemctl",
                "show",
                unit.unit_name(place.session),
                "-p",
                "ActiveState,SubState,ActiveEnterTimestamp,MainPID,NRestarts,UnitFileState",
            ],
            timeout=15,
        )
        facts = dict(line.split("=", 1) for line in res.out.splitlines() if "=" in line)
    else:
        facts = {"tmux_session": "alive" if _tmux_alive(str(service.get("tmux_socket")), place.session) else "missing"}
    return {
        "installed": True,
        "running": holder is not None,
        "pid": (holder or {}).get("pid"),
        "since": (holder or {}).get("since"),
        "service": service,
        "unit": facts,
        "status": place.read(unit.STATUS_JSON),
        "incidents": _incidents(place, int(req.get("incidents", INCIDENTS_SHOWN))),
        "log": place.path(unit.LOG),
        "dir": place.dir,
    }


def _incidents(place: Place, n: int) -> dict[str, t.Any]:
    folder = Path(place.dir) / "incidents"
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    shown = []
    for f in files[-n:] if n > 0 else []:
        try:
            inc = record.load(str(f)) or {}
        except record.BadRecord:
            continue  # one unreadable incident hides none of the others
        keep = ("time", "attempt", "state", "cause", "detail", "action", "outcome", "next_attempt", "reason", "done_at")
        shown.append({k: inc.get(k) for k in keep})
    return {"count": len(files), "newest": shown}


def stop(req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    place = Place(str(req["dir"]), str(req["session"]))
    service = place.service()
    if service is None:
        raise Failed(refusal.NOT_INSTALLED, f"no supervisor is installed for session {place.session} in {place.root}")
    out = _stop(place, service.get("mode"), str(service.get("tmux_socket")), str(service.get("by")))
    return {**out, "mode": service.get("mode")}


def uninstall(req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    place = Place(str(req["dir"]), str(req["session"]))
    service = place.service()
    if service is None:
        raise Failed(refusal.NOT_INSTALLED, f"no supervisor is installed for session {place.session} in {place.root}")
    out = _stop(place, service.get("mode"), str(service.get("tmux_socket")), str(service.get("by")))
    if not out["stopped"]:
        raise Failed(refusal.BUSY, f"the supervisor (pid {out.get('pid')}) did not stop; nothing was removed")
    if service.get("mode") == "systemd":
        _disable_unit(place)
    removed = []
    for name in (unit.ENV_JSON, unit.HOSTS_TOML, unit.SERVICE_JSON, unit.STATUS_JSON):
        try:
            os.unlink(place.path(name))
            removed.append(place.path(name))
        except FileNotFoundError:
            pass
    others = [p for p in Path(place.root, "sessions").glob(f"*/{unit.SERVICE_JSON}")]
    if not others:  # the last session: dflashctl's code goes too (the incidents and logs stay)
        removed += _remove_code(place.root)
    return {**out, "removed": removed, "kept": place.dir, "mode": service.get("mode")}


def _remove_code(root: str) -> list[str]:
    """What deploy and install wrote at the folder's top, and nothing else: the launcher, deploy's releases
    (a folder with its manifest), the current/previous links into them, deploy's lock; each folder only once
    it is empty; the marker last, when nothing but the sessions (incidents, logs) is left."""
    removed: list[str] = []

    def unlink(path: str) -> None:
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass

    def rmdir(path: str) -> None:
        try:
            os.rmdir(path)  # only an empty folder: whatever else is there stays
            removed.append(path)
        except OSError:
            pass

    for name in ("current", "previous"):
        link = os.path.join(root, name)
        if os.path.islink(link) and os.readlink(link).startswith("releases/"):
            unlink(link)
    launcher = os.path.join(root, unit.LAUNCHER)
    if os.path.isfile(launcher) and not os.path.islink(launcher):
        unlink(launcher)
    rmdir(os.path.join(root, "bin"))
    releases = Path(root, "releases")
    for rel in sorted(releases.iterdir()) if releases.is_dir() and not releases.is_symlink() else []:
        if rel.is_dir() and not rel.is_symlink() and (rel / ".release.json").is_file():
            shutil.rmtree(rel, ignore_errors=True)
            removed.append(str(rel))
    rmdir(str(releases))
    for name in (".deploy.lock", unit.INSTALL_LOCK):
        lock = os.path.join(root, name)
        if os.path.isfile(lock) and not os.path.islink(lock):
            unlink(lock)
    rmdir(os.path.join(root, "runs"))
    left = [n for n in os.listdir(root) if n not in ("sessions", unit.MARKER)] if os.path.isdir(root) else []
    if not left and not os.path.isdir(os.path.join(root, "sessions")):
        unlink(os.path.join(root, unit.MARKER))
        rmdir(root)
    return removed


def logs(req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    place = Place(str(req["dir"]), str(req["session"]))
    n = max(1, min(int(req.get("lines", 50)), 10_000))
    path = place.path(unit.LOG)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - LOG_WINDOW))
            data = f.read()
    except FileNotFoundError:
        if place.service() is None:
            raise Failed(
                refusal.NOT_INSTALLED, f"no supervisor is installed for session {place.session} in {place.root}"
            ) from None
        return {"log": path, "lines": []}
    lines = data.decode("utf-8", "replace").splitlines()
    return {"log": path, "lines": lines[-n:]}


def gpus(req: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The session's excluded GPUs (ops/supervise/exclusions.py); ``include``: bus ids to put back."""
    place = Place(str(req["dir"]), str(req["session"]))
    service = place.service()
    if service is None:
        raise Failed(refusal.NOT_INSTALLED, f"no supervisor is installed for session {place.session} in {place.root}")
    by = str(service["by"])
    include = req.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise BadConfig("--include", "expected PCI bus ids")
    store = Exclusions(Path(place.dir) / "supervise" / f"{slug(by)}.{slug(place.session)}", by, place.session)
    try:
        return exclusions.answer(store, include, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    except ValueError as e:
        raise BadConfig("--include", str(e)) from None


class _install_lock:  # noqa: N801 (a context manager, named as it is used)
    """install and uninstall one at a time: a second one at once is refused, never run beside the first
    (both would report success, and the supervisor left would be the last one's)."""

    def __init__(self, root: str, verb: str) -> None:
        self.path = os.path.join(root, unit.INSTALL_LOCK)
        self.verb, self.fd = verb, -1

    def __enter__(self) -> None:
        if self.verb not in ("install", "uninstall") or not os.path.isfile(
            os.path.join(os.path.dirname(self.path), unit.MARKER)
        ):
            return  # the other verbs only read; a folder that is not ours gets no lock file (install refuses it)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            who = holder_json(self.fd)
            os.close(self.fd)
            self.fd = -1
            pid = who.get("pid")
            named = f" (pid {pid})" if isinstance(pid, int) and not isinstance(pid, bool) else ""
            raise Failed(
                refusal.BUSY,
                f"another `supervise {who.get('verb', 'install')}` runs on this host now{named}: "
                "nothing was changed; run it again once that one is done",
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "verb": self.verb}).encode(), 0)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the flock goes with it


def _write_text(path: str, text: str, mode: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = create_new(tmp, mode)
    with open(fd, "w", encoding="utf-8") as f:
        os.fchmod(fd, mode)
        f.write(text)
    os.replace(tmp, path)


HANDLERS: dict[str, t.Callable[[t.Mapping[str, t.Any]], dict[str, t.Any]]] = {
    "install": install,
    "status": status,
    "stop": stop,
    "uninstall": uninstall,
    "logs": logs,
    "gpus": gpus,
}


# --------------------------------------------------------------------------------------------
# The supervisor itself: `dflashctl-supervise run <dir> <session> [options]`


def options_parser() -> argparse.ArgumentParser:
    """restart-on-crash's options, from ``Options`` itself (the launcher's command line: ops/supervise/unit.py)."""
    p = argparse.ArgumentParser(prog=unit.MARK, add_help=False)
    for f in dataclasses.fields(Options):
        if f.name in unit.NOT_FORWARDED:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, dest=f.name, action="store_true")
        elif f.type in ("str", str):
            p.add_argument(flag, dest=f.name, default=f.default)
        else:
            p.add_argument(flag, dest=f.name, type=int if f.type in ("int", int) else float, default=f.default)
    return p


class LogFile:
    """The supervisor's own log: every event line, appended and flushed; also on stdout (the journal, the pane)."""

    def __init__(self, path: str) -> None:
        try:
            if os.path.getsize(path) > LOG_ROTATE:
                os.replace(path, f"{path}.1")
        except OSError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self.f = os.fdopen(fd, "a", encoding="utf-8", buffering=1)

    def __call__(self, line: str) -> None:
        try:
            self.f.write(line + "\n")
        except OSError:
            pass  # a full disk must not end the watch
        print(line, flush=True)


def serve(root: str, session: str, argv: list[str]) -> int:
    try:
        return _serve(root, session, argv)
    except record.BadRecord as e:  # its own files, mangled: one line (the journal, the pane), then exit 1
        print(f"{unit.MARK}: {e}", file=sys.stderr)
        return 1


def _serve(root: str, session: str, argv: list[str]) -> int:
    place = Place(root, session)
    service = place.service()
    if service is None:
        print(f"{unit.MARK}: no supervisor is installed for session {session} in {root}", file=sys.stderr)
        return 1
    by = str(service["by"])
    log = LogFile(place.path(unit.LOG))
    try:
        opts = Options(**vars(options_parser().parse_args(argv)))
    except (SystemExit, errors.ConfigError) as e:
        log(f"{unit.MARK}: bad options {' '.join(argv)}: {e}")
        return 2
    env, urls = place.secrets()
    os.environ.update(env)
    # The lock file names its holder by argv: install tells its own supervisor from a stranger by this.
    sys.argv = [unit.MARK, "run", root, session, *argv]
    heartbeat = Heartbeat(
        interval=opts.interval,
        by=by,
        mode=str(service.get("mode")),
        id=str(service.get("id")),
        status_file=Path(place.path(unit.STATUS_JSON)),
    )
    newest = _incidents(place, 1)["newest"]
    if newest:  # its last action survives its own restarts (supervise status, the heartbeat status shows)
        heartbeat.acted(newest[-1])
    try:
        inventory = load_inventory(place.path(unit.HOSTS_TOML))
        host = inventory.get(by)
        sup = Supervisor(
            host,
            session,
            opts,
            state_dir=Path(place.dir),
            emit=log,
            hide_env=inventory.secret_env,
            heartbeat=heartbeat,
            keep_watching=True,
            **notify_options(urls, log, [host, *inventory.hosts.values()]),
        )
        log(f"{unit.MARK}: supervisor of {by}/{session} started (pid {os.getpid()}, {service.get('mode')} mode)")
        outcome = sup.run()
    except errors.OpsError as e:
        heartbeat.failed(str(e))
        log(f"{unit.MARK}: {e}")
        return 1
    log(f"{unit.MARK}: supervisor of {by}/{session} ended ({outcome.kind})")
    return 0


def notify_options(urls: list[str], log: t.Callable[[str], None], hosts: list[Host]) -> dict[str, t.Any]:
    """Where `supervise install --notify URL` reaches the supervisor: a Notifier for its Supervisor
    keyword. The URLs come from env.json, never from argv; what is scrubbed from messages is what
    restart-on-crash scrubs (``notifier_for``): the host entry's env values and the API token's value."""
    if not urls:
        return {}
    from ops.notify import notifier_for  # only with --notify: apprise is the host's optional extra

    try:
        return {"notifier": notifier_for(urls, hosts, os.environ, log)}
    except errors.ConfigError as e:  # apprise gone since install: the supervisor watches on, unannounced
        log(f"{unit.MARK}: note: {e}; no notifications are sent")
        return {}


# --------------------------------------------------------------------------------------------


def main(argv: t.Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for key in ("TMUX", "TMUX_PANE"):  # an operator's tmux must not leak into the tmux calls made here
        os.environ.pop(key, None)
    if len(args) >= 3 and args[0] == "run":
        return serve(args[1], args[2], args[3:])
    if len(args) != 1 or args[0] not in HANDLERS:
        usage = f"usage: {{{','.join(VERBS)}}} < request.json"
        return request.answer({"ok": False, "error": refusal.USAGE, "message": usage}, 2)
    verb = args[0]
    try:
        req = request.read_request()
        for key in ("dir", "session"):
            if not isinstance(req.get(key), str):
                raise ValueError(f"{key}: expected a string")
        problem = supervise_dir_problem(req["dir"], resolve=True)
        if problem:
            raise ValueError(f"dir: {problem}")
        if not all(c.isalnum() or c in "-_" for c in req["session"]) or not req["session"]:
            raise ValueError("session: letters, digits, '-', '_' only")
    except ValueError as e:
        bad = {"ok": False, "verb": verb, "error": refusal.BAD_REQUEST, "message": f"{verb}: bad request: {e}"}
        return request.answer(bad, 2)
    try:
        with _install_lock(req["dir"], verb):
            answer = {"ok": True, "verb": verb, **HANDLERS[verb](req)}
    except record.BadRecord as e:
        answer = {"ok": False, "verb": verb, "error": refusal.BAD_RECORD, "message": f"{verb}: {e} (mend or remove it)"}
    except Failed as e:
        answer = {"ok": False, "verb": verb, "error": e.kind, "message": str(e)}
        if isinstance(e, BadConfig):
            answer["key"] = e.key
    except (OSError, errors.OpsError) as e:
        answer = {"ok": False, "verb": verb, "error": refusal.FAILED, "message": f"{verb}: {e}"}
    return request.answer(answer)


if __name__ == "__main__":
    sys.exit(main())
