"""The connection keeper: one ssh connection to a host, held by a background process of this user for
``keep_connection`` seconds after its last use, that later dflashctl calls run their commands through
(what OpenSSH's ControlMaster + ControlPersist do for ``ssh``).

Why: a fresh ``dflashctl status`` pays for paramiko and cryptography's imports, a key exchange and a
public-key auth before its one remote command, CPU that a loaded machine multiplies. Through a keeper
the call imports neither (this module is stdlib only until it must connect itself) and does no
handshake: it sends the argv over a Unix socket and reads the result back.

- Opt-in per host: ``keep_connection = <seconds>`` in hosts.toml (``ops/hosts.py``); ``Host`` is hashed
  into the socket's name, so a changed entry never reuses a keeper started for the old one.
- Private: the socket lives in ``$XDG_RUNTIME_DIR/dflashctl-keeper`` (else ``/tmp/dflashctl-keeper-<uid>``),
  a 0700 folder of this user; the socket is 0600. A folder or socket of another owner or a wider mode,
  or a keeper process of another uid (SO_PEERCRED), is refused: the call connects directly.
- Never a second authority on host keys: the keeper connects with ``SSHTransport.connect``, the same
  known_hosts check as a direct call, and connects afresh (checking again) when a known_hosts file or the
  ssh_config changed since; ``trust-host`` and ``doctor`` never use it.
- Down is a state (``KeeperState``): no keeper, a dead one (its socket left behind) or a refused one
  means a direct connection for this call (and, unless refused, a new keeper started beside it).
- One request per Unix connection; the keeper runs it on a channel of its connection. A command whose
  stdin is a stream (deploy's bundle) runs over a direct connection of the caller's, opened on demand.
- It exits after ``keep_connection`` idle seconds, when its ssh connection dies, or on SIGTERM, and
  removes its socket. A lock file, held for its whole life, says whether it lives.
"""

from __future__ import annotations

import binascii
import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import typing as t
from pathlib import Path

from ops import errors
from ops.transport.base import DEFAULT_TIMEOUT, KILL_AFTER, CommandResult, Stdin, Transport

if t.TYPE_CHECKING:
    from ops.hosts import Host
    from ops.transport.ssh import SSHTransport

logger = logging.getLogger(__name__)

PROTOCOL = 1
# stdin sent whole through the keeper; larger or streamed stdin goes over a direct connection
STDIN_MAX = 4 << 20
_HEAD = struct.Struct("!I")
_HEAD_MAX = 1 << 20
# How long a keeper being started may wait for the lock a caller's check holds for an instant
_LOCK_WAIT = 1.0
_ACCEPT_TICK = 0.5


class KeeperState(enum.Enum):
    READY = "ready"  # alive, private, ours: use it
    ABSENT = "absent"  # no socket: start one, connect directly this time
    DOWN = "down"  # a socket but no keeper behind it (it died): start one, connect directly
    STARTING = "starting"  # the lock is held but no socket yet: connect directly
    REFUSED = "refused"  # another owner or a wider mode: never used, never replaced; connect directly


class Reach(t.NamedTuple):
    state: KeeperState
    path: Path
    why: str  # for REFUSED and DOWN: what was found


# --------------------------------------------------------------------------------------------
# Where a host's keeper lives


def keeper_dir() -> Path:
    """The user's private folder of keepers: under $XDG_RUNTIME_DIR (already the user's own) when set."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "dflashctl-keeper"
    return Path(f"/tmp/dflashctl-keeper-{os.getuid()}")


def identity(host: Host) -> str:
    """The keeper's name for ``host``: its name and a checksum of the whole entry, so an edited entry gets a
    keeper of its own. A checksum, not a digest (hashlib's OpenSSL is ~10 ms of start-up): two entries that
    share one are told apart by the keeper, which compares every request's whole entry with its own."""
    return f"{host.name}-{binascii.crc32(repr(host).encode()):08x}"


def socket_path(host: Host) -> Path:
    return keeper_dir() / f"{identity(host)}.sock"


def _lock_path(sock: Path) -> Path:
    return sock.with_suffix(".lock")


def keeper_pid(host: Host) -> int | None:
    """The pid of ``host``'s live keeper (its lock file says it), or None when none lives."""
    lock = _lock_path(socket_path(host))
    if _lock_free(lock):
        return None
    try:
        return int(lock.read_text().strip() or "0") or None
    except (OSError, ValueError):
        return None


def dir_problem(folder: Path) -> str | None:
    """Why ``folder`` may not hold our keepers (None: it may): it must be a real folder of ours, 0700."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{folder}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid != os.getuid():
        return f"{folder} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{folder} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def socket_problem(path: Path) -> str | None:
    """Why the file at ``path`` is no socket of ours (None: it is one, 0600 or narrower)."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
    return None


def _private_dir() -> Path:
    """The keepers' folder, made 0700 when missing; raises ``KeeperRefused`` when it is not private."""
    folder = keeper_dir()
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    why = dir_problem(folder)
    if why is not None:
        raise KeeperRefused(why)
    return folder


class KeeperRefused(Exception):
    """A keeper's folder or socket is not private to this user: it is not used (the call goes direct)."""


def _lock_free(lock: Path) -> bool:
    """True when no keeper holds ``lock`` (taken and let go at once)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the lock
    return True


def reach(host: Host) -> Reach:
    """Where ``host``'s keeper stands, from the files alone (no round trip); never raises."""
    path = socket_path(host)
    why = dir_problem(path.parent)
    if why is not None:
        return Reach(KeeperState.REFUSED, path, why)
    try:
        why = socket_problem(path)
    except FileNotFoundError:
        free = _lock_free(_lock_path(path))
        return Reach(KeeperState.ABSENT if free else KeeperState.STARTING, path, "")
    except OSError as e:
        return Reach(KeeperState.REFUSED, path, f"{path}: {e.strerror}")
    if why is not None:
        return Reach(KeeperState.REFUSED, path, why)
    if _lock_free(_lock_path(path)):
        return Reach(KeeperState.DOWN, path, f"{path} is left from a keeper that is gone")
    return Reach(KeeperState.READY, path, "")


# --------------------------------------------------------------------------------------------
# The caller's side


def connect(host: Host) -> Transport:
    """A transport to ``host`` through its keeper when one is ready; else a direct connection, with a keeper
    started beside it for the next call (unless the keeper's files were refused)."""
    r = reach(host)
    if r.state is KeeperState.READY:
        return KeptTransport(host, r.path)
    if r.state is KeeperState.REFUSED:
        logger.warning("%s: not using the connection keeper: %s", host.name, r.why)
    elif r.state is not KeeperState.STARTING and not _failed_lately(r.path):
        start(host)
    return _direct(host)


# A keeper that could not connect leaves <name>.failed: no new one is started for this long after it (a host
# that is down would otherwise get a keeper, and its imports, at every call).
RETRY_AFTER = 30.0


def _failed_lately(sock: Path) -> bool:
    try:
        return time.time() - os.lstat(sock.with_suffix(".failed")).st_mtime < RETRY_AFTER
    except OSError:
        return False


def _direct(host: Host) -> Transport:
    from ops.transport.ssh import SSHTransport  # here: paramiko only when this call connects itself

    return SSHTransport.connect(host)


# Popen objects of the keepers this process started: kept so that none is collected (and warned about)
# while it runs; a keeper outlives the call that started it.
_started: list[subprocess.Popen[bytes]] = []


def start(host: Host) -> int | None:
    """Start ``host``'s keeper in the background (its own session, nothing of ours inherited); its pid, or
    None when its folder is refused. It connects by itself: this call does not wait for it."""
    try:
        folder = _private_dir()
    except KeeperRefused as e:
        logger.warning("%s: not starting a connection keeper: %s", host.name, e)
        return None
    import pickle  # here: only a call that starts a keeper pays for it

    # appended to, never truncated here: a start that loses the race to a live keeper must not cut its log
    log_path = folder / f"{identity(host)}.log"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-c", "from ops.transport.keeper import main; main()"],  # -P: no cwd on the path
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=fd,
            start_new_session=True,  # no Ctrl-C of the caller's terminal, no wait for it by a caller's pipe
            close_fds=True,
        )
    finally:
        os.close(fd)
    assert proc.stdin is not None
    with contextlib.suppress(OSError):
        proc.stdin.write(pickle.dumps(host))
        proc.stdin.close()
    _started.append(proc)
    logger.debug("%s: started a connection keeper (pid %d)", host.name, proc.pid)
    return proc.pid


class KeptTransport(Transport):
    """Commands through ``host``'s keeper. When the keeper is gone before a command was handed over, that
    command and the ones after it run over a direct connection (nothing ran twice: nothing was sent)."""

    name = "ssh"

    def __init__(self, host: Host, path: Path) -> None:
        self.host = host
        self.path = path
        self.state = KeeperState.READY
        self._direct: Transport | None = None

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        argv = tuple(str(a) for a in argv)
        data = b"" if stdin is None else stdin if isinstance(stdin, bytes) else None
        if self.state is not KeeperState.READY or data is None or len(data) > STDIN_MAX:
            return self._fallback().run(argv, stdin=stdin, timeout=timeout)
        sock = self._open()
        if sock is None:
            return self._fallback().run(argv, stdin=stdin, timeout=timeout)
        with sock:
            # the keeper's own wait is the command's, plus the remote timeout's kill and a margin
            sock.settimeout(timeout + KILL_AFTER + 15)
            head = {
                "protocol": PROTOCOL,
                "host": repr(self.host),
                "argv": list(argv),
                "timeout": timeout,
                "stdin": len(data),
            }
            try:
                _send(sock, head, data)
                reply, body = _receive(sock)
            except TimeoutError:
                return CommandResult(argv, None, b"", b"", timed_out=True, timeout=timeout)
            except (OSError, EOFError, ValueError) as e:
                # the command was handed over: it may have run, so it is not run again
                raise errors.ConnectionLost(
                    self.host.name, f"the connection keeper went away during the command: {e or type(e).__name__}"
                ) from None
        if "refused" in reply:  # nothing ran: another entry's keeper, or another dflashctl's
            self.state = KeeperState.REFUSED
            logger.warning("%s: not using the connection keeper: %s", self.host.name, reply["refused"])
            return self._fallback().run(argv, stdin=stdin, timeout=timeout)
        if "error" in reply:
            raise _error(self.host.name, reply["error"])
        out_len = int(reply["stdout"])
        return CommandResult(
            argv,
            reply["exit_code"],
            body[:out_len],
            body[out_len:],
            timed_out=bool(reply["timed_out"]),
            signal=reply["signal"],
            timeout=timeout,
        )

    def _open(self) -> socket.socket | None:
        """A connection to the keeper, checked to be this user's; None (and the state why) when it cannot be."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.host.connect_timeout)
            sock.connect(str(self.path))
        except OSError as e:
            sock.close()
            self.state = KeeperState.DOWN
            logger.info("%s: the connection keeper is down (%s): connecting directly", self.host.name, e.strerror)
            return None
        uid = _peer_uid(sock)
        if uid is not None and uid != os.getuid():
            sock.close()
            self.state = KeeperState.REFUSED
            logger.warning(
                "%s: not using the connection keeper: %s is served by uid %d, not this user (%d)",
                self.host.name,
                self.path,
                uid,
                os.getuid(),
            )
            return None
        return sock

    def _fallback(self) -> Transport:
        if self._direct is None:
            self._direct = _direct(self.host)
        return self._direct

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
            self._direct = None


def _peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux); None where it cannot be asked."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


# Whole calls a keeper answers in its own process, whose imports (classify's modules, paramiko) are paid once:
# name -> "module:function(host, args, connection)", the connection a callable that may raise UnreachableError.
# Named, not imported: the transport layer does not import the layers above it.
CALLS = {"status": "ops.session:kept_status"}


def ask(host: Host, call: str, args: t.Mapping[str, t.Any], *, timeout: float = 60.0) -> t.Any | None:
    """``call``'s answer from ``host``'s keeper, or None when there is no ready keeper of ours or it did not
    answer (the caller then does the work itself, so a call must be read-only)."""
    r = reach(host)
    if r.state is not KeeperState.READY:
        return None
    kept = KeptTransport(host, r.path)
    sock = kept._open()
    if sock is None:
        return None
    head = {"protocol": PROTOCOL, "host": repr(host), "call": call, "args": dict(args), "timeout": timeout}
    with sock:
        sock.settimeout(timeout + KILL_AFTER + 15)
        try:
            _send(sock, head, b"")
            reply, _ = _receive(sock)
        except (OSError, EOFError, ValueError) as e:
            logger.info("%s: the connection keeper did not answer %s: %s", host.name, call, e)
            return None
    if "answer" not in reply:
        logger.info("%s: the connection keeper refused %s: %s", host.name, call, reply.get("refused"))
        return None
    return reply["answer"]


# The errors a keeper may answer with; anything else reads as a lost connection.
_ERRORS: dict[str, type[errors.UnreachableError]] = {
    cls.__name__: cls
    for cls in (
        errors.ConnectionRefused,
        errors.ConnectTimeout,
        errors.NameResolutionError,
        errors.AuthenticationFailed,
        errors.ConnectionLost,
    )
}
_HOST_KEY_ERRORS: dict[str, type[errors.HostKeyRejected]] = {
    cls.__name__: cls for cls in (errors.HostKeyRejected, errors.HostKeyRevoked)
}


def _error(host: str, e: t.Mapping[str, t.Any]) -> errors.UnreachableError:
    kind, detail = str(e.get("kind")), str(e.get("detail"))
    if kind in _HOST_KEY_ERRORS:
        return _HOST_KEY_ERRORS[kind](
            host,
            detail,
            fingerprint=e.get("fingerprint"),
            changed=bool(e.get("changed")),
            expected=e.get("expected"),
            key_type=e.get("key_type"),
        )
    return _ERRORS.get(kind, errors.ConnectionLost)(host, detail)


def _error_reply(e: errors.UnreachableError) -> dict[str, t.Any]:
    reply: dict[str, t.Any] = {"kind": type(e).__name__, "detail": e.detail}
    if isinstance(e, errors.HostKeyRejected):
        reply.update(fingerprint=e.fingerprint, changed=e.changed, expected=e.expected, key_type=e.key_type)
    return {"error": reply}


# The wire between the two: a 4-byte length, a JSON head, then the head's count of raw bytes.


def _send(sock: socket.socket, head: t.Mapping[str, t.Any], body: bytes) -> None:
    raw = json.dumps(head).encode()
    sock.sendall(_HEAD.pack(len(raw)) + raw + body)


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 16))
        if not chunk:
            raise EOFError("closed before the whole message")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _receive(sock: socket.socket) -> tuple[dict[str, t.Any], bytes]:
    (size,) = _HEAD.unpack(_exactly(sock, _HEAD.size))
    if size > _HEAD_MAX:
        raise ValueError(f"a message head of {size} bytes")
    head = json.loads(_exactly(sock, size))
    if not isinstance(head, dict):
        raise ValueError("a message head that is not an object")
    length = int(head.get("stdin", 0)) + int(head.get("stdout", 0)) + int(head.get("stderr", 0))
    return head, _exactly(sock, length)


# --------------------------------------------------------------------------------------------
# The keeper itself (a process of its own: ``start``)


def _stamp(paths: t.Iterable[str]) -> tuple[tuple[str, int, int, int], ...]:
    """What the files the connection was checked against look like now: a change means connect afresh."""
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((p, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((p, 0, -1, 0))
    return tuple(out)


class Keeper:
    """One host's connection and the socket that hands it out."""

    def __init__(self, host: Host, path: Path) -> None:
        self.host = host
        self.path = path
        self.idle = host.keep_connection
        self.last_used = time.monotonic()
        self.busy = 0
        self.served = 0
        self.stop = threading.Event()
        self._mutex = threading.Lock()
        self.ssh: SSHTransport = self._connect()
        self._checked = self._files()

    def _files(self) -> tuple[tuple[str, int, int, int], ...]:
        target = self.ssh.target
        names = [*target.known_hosts, os.path.expanduser(self.host.ssh_config)]
        if target.proxy_jump is not None:
            names += target.proxy_jump.known_hosts
        return _stamp(names)

    def _connect(self) -> SSHTransport:
        from ops.transport.ssh import SSHTransport

        return SSHTransport.connect(self.host)

    def connection(self) -> SSHTransport:
        """The ssh connection, connected afresh (the same host key check) when what it was checked against
        changed; raises ``UnreachableError`` (and the keeper stops) when that fails."""
        with self._mutex:
            changed = self._files() != self._checked
            if changed or not self.ssh.alive:
                logger.info(
                    "%s: connecting afresh", "known_hosts or ssh_config changed" if changed else "connection lost"
                )
                old = self.ssh
                try:
                    self.ssh = self._connect()
                except errors.UnreachableError:
                    self.stop.set()
                    raise
                finally:
                    old.close()
                self._checked = self._files()
            return self.ssh

    def serve(self, server: socket.socket) -> None:
        server.settimeout(_ACCEPT_TICK)
        while not self.stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                with self._mutex:
                    idle = self.busy == 0 and time.monotonic() - self.last_used > self.idle
                if idle:
                    logger.info("idle for %gs: exiting after %d commands", self.idle, self.served)
                    return
                if not self.ssh.alive:
                    logger.info("the ssh connection closed: exiting")
                    return
                continue
            with self._mutex:
                self.busy += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="keeper-request").start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(30)
                uid = _peer_uid(conn)
                if uid is not None and uid != os.getuid():
                    logger.warning("refused a caller of uid %d", uid)
                    return
                head, stdin = _receive(conn)
                if head.get("protocol") != PROTOCOL:
                    _send(conn, {"refused": f"{self.path} is a keeper of another dflashctl"}, b"")
                    return
                if head.get("host") != repr(self.host):
                    _send(conn, {"refused": f"{self.path} keeps another hosts.toml entry"}, b"")
                    return
                timeout = float(head["timeout"])
                conn.settimeout(timeout + KILL_AFTER + 30)
                if "call" in head:
                    self._call(conn, str(head["call"]), head.get("args") or {})
                    return
                try:
                    res = self.connection().run(head["argv"], stdin=stdin or None, timeout=timeout)
                except errors.UnreachableError as e:
                    _send(conn, _error_reply(e), b"")
                    return
                reply = {
                    "exit_code": res.exit_code,
                    "signal": res.signal,
                    "timed_out": res.timed_out,
                    "stdout": len(res.stdout),
                    "stderr": len(res.stderr),
                }
                # logged before the reply: a caller that reads the log once answered finds its line there
                self.served += 1
                logger.info("served: %s (exit %s)", head["argv"][0], res.exit_code)
                _send(conn, reply, res.stdout + res.stderr)
        except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
            logger.warning("a request failed: %s", e)
        finally:
            with self._mutex:
                self.busy -= 1
                self.last_used = time.monotonic()

    def _call(self, conn: socket.socket, name: str, args: t.Mapping[str, t.Any]) -> None:
        """One of ``CALLS`` with this keeper's connection: its answer, as JSON, or a refusal (the caller then
        does the work itself: every call is read-only)."""
        where = CALLS.get(name)
        if where is None:
            _send(conn, {"refused": f"no call {name!r} here"}, b"")
            return
        import importlib

        module, attr = where.split(":")
        fn = getattr(importlib.import_module(module), attr)
        try:
            answer = fn(self.host, args, self.connection)
        except Exception as e:  # the caller does the work itself, and words what went wrong
            logger.warning("%s failed: %s: %s", name, type(e).__name__, e)
            _send(conn, {"refused": f"{name} failed here"}, b"")
            return
        self.served += 1
        logger.info("served: %s", name)
        _send(conn, {"answer": answer}, b"")


def _take_lock(lock: Path) -> int | None:
    """The keeper's life lock (an fd that holds it), or None when another keeper lives."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())  # who holds it: `kill $(cat NAME.lock)` ends a keeper
            return fd
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.05)  # a caller's reach() holds it for an instant


def _bind(path: Path) -> socket.socket:
    """The listening socket at ``path``, 0600 from the start (umask), never wider."""
    with contextlib.suppress(FileNotFoundError):
        why = socket_problem(path)
        if why is not None:
            raise KeeperRefused(why)
        path.unlink()  # a dead keeper's (we hold the lock: no live one owns it)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        server.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    server.listen(16)
    return server


def keep(host: Host) -> int:
    """Run ``host``'s keeper in this process until it idles out; the exit code."""
    try:
        folder = _private_dir()
    except KeeperRefused as e:
        logger.error("refused: %s", e)
        return 1
    path = folder / f"{identity(host)}.sock"
    lock = _take_lock(_lock_path(path))
    if lock is None:
        logger.info("another keeper lives for this host")
        return 0
    with contextlib.suppress(OSError):
        os.ftruncate(sys.stderr.fileno(), 0)  # the log (append mode) is the lock holder's: begin it afresh
    server = None
    ino = None
    try:
        try:
            keeper = Keeper(host, path)
        except errors.UnreachableError as e:
            logger.error("cannot connect: %s", e)
            with contextlib.suppress(OSError):
                os.close(os.open(path.with_suffix(".failed"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600))
                os.utime(path.with_suffix(".failed"))
            return 1
        with contextlib.suppress(FileNotFoundError):
            path.with_suffix(".failed").unlink()
        try:
            server = _bind(path)
        except (KeeperRefused, OSError) as e:
            logger.error("cannot listen at %s: %s", path, e)
            return 1
        ino = os.lstat(path).st_ino
        logger.info("keeping %s for %gs idle at %s (pid %d)", keeper.ssh.target.where, keeper.idle, path, os.getpid())
        keeper.serve(server)
        keeper.ssh.close()
        return 0
    finally:
        if server is not None:
            server.close()
        if ino is not None:
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == ino:  # only the socket this keeper made
                    path.unlink()
        os.close(lock)


def main() -> None:
    """The keeper process: its Host pickled on stdin by ``start`` (this user's own process, a pipe)."""
    import pickle

    logging.basicConfig(level=logging.INFO, format="%(asctime)s keeper %(levelname)s %(message)s", stream=sys.stderr)
    host = pickle.load(sys.stdin.buffer)
    sys.stdin.close()

    def stop(signum: int, frame: t.Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sys.exit(keep(host))
