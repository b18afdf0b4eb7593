"""``SSHTransport``: one paramiko connection per host, a channel per command, the argv quoted once
for whatever login shell the remote user has; paramiko workarounds (exit signals, host key types)."""

from __future__ import annotations

import contextlib
import functools
import logging
import select
import shlex
import signal as signal_mod
import socket
import threading
import time
import typing as t

from ops import errors
from ops.errors import ConnectionLost
from ops.transport._paramiko import paramiko
from ops.transport.base import (
    CHUNK,
    DEFAULT_TIMEOUT,
    KILL_AFTER,
    TIMEOUT_EXITS,
    CommandResult,
    Stdin,
    Transport,
    iter_stdin,
    timeout_arg,
)
from ops.transport.host_keys import HostKeyCheck, HostKeyScan, KnownHosts, fingerprint, line_names
from ops.transport.ssh_config import SSHTarget, resolve_target

if t.TYPE_CHECKING:
    from ops.hosts import Host

logger = logging.getLogger(__name__)

KEEPALIVE = 15


def _exit_signal_aware(chan: paramiko.Channel, m: paramiko.Message) -> None:
    """paramiko ignores ``exit-signal`` (a signalled remote process reads as exit status -1): note
    the signal's name on the channel, hand every other request to paramiko."""
    start = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply: always false for exit-signal
        chan.dflash_exit_signal = m.get_text()
        return
    m.packet.seek(start)
    paramiko.Channel._handle_request(chan, m)


# paramiko internals (5.x): where a channel request is dispatched. If they move, we only lose the
# signal's number (the result still says "signalled": exit_code None).
_BASE_HANDLERS = getattr(paramiko.Transport, "_channel_handler_table", None)


class _Transport(paramiko.Transport):  # type: ignore[misc]  # paramiko ships no types
    """A paramiko Transport that records exit signals and prefers the host key types we know."""

    if isinstance(_BASE_HANDLERS, dict) and hasattr(paramiko.Channel, "_handle_request"):
        _channel_handler_table = {**_BASE_HANDLERS, paramiko.common.MSG_CHANNEL_REQUEST: _exit_signal_aware}

    def __init__(self, sock: t.Any, *, preferred_key_types: t.Sequence[str] = (), **kw: t.Any) -> None:
        super().__init__(sock, **kw)
        if preferred_key_types:
            opts = self.get_security_options()
            wanted = []
            for kt in preferred_key_types:
                wanted += ["rsa-sha2-512", "rsa-sha2-256", "ssh-rsa"] if kt == "ssh-rsa" else [kt]
            first = [k for k in wanted if k in opts.key_types]
            opts.key_types = first + [k for k in opts.key_types if k not in first]


def _unreachable(target: SSHTarget, exc: BaseException) -> BaseException:
    """Turn what paramiko/socket raised while connecting into our typed error (or return it as is)."""
    where = f"{target.hostname}:{target.port}"
    if isinstance(exc, errors.OpsError):
        return exc
    if isinstance(exc, socket.gaierror):
        return errors.NameResolutionError(target.label, f"cannot resolve {target.hostname!r}: {exc.strerror or exc}")
    if isinstance(exc, paramiko.BadHostKeyException):  # only if paramiko checked a key itself
        return errors.HostKeyRejected(
            target.label, f"HOST KEY CHANGED for {target.known_name}", fingerprint=fingerprint(exc.key), changed=True
        )
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(target.key_files) or "ssh-agent and default keys"
        return errors.AuthenticationFailed(
            target.label, f"authentication failed for {target.where} (tried {keys}): {exc}"
        )
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        inner = next(iter(exc.errors.values()), None)
        if isinstance(inner, (socket.timeout, TimeoutError)):
            return errors.ConnectTimeout(target.label, f"no answer from {where} within {target.timeout:g}s")
        reason = getattr(inner, "strerror", None) or "connection refused"
        return errors.ConnectionRefused(target.label, f"cannot connect to {where}: {reason} (is sshd running there?)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return errors.ConnectTimeout(target.label, f"no answer from {where} within {target.timeout:g}s")
    if isinstance(exc, ConnectionRefusedError):
        return errors.ConnectionRefused(
            target.label, f"cannot connect to {where}: connection refused (is sshd running there?)"
        )
    if isinstance(exc, paramiko.ChannelException):
        return errors.ConnectionRefused(
            target.label, f"the jump host could not open a connection to {where}: {exc.text}"
        )
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "banner" in text or "No existing session" in text:
            return errors.ConnectTimeout(
                target.label, f"{where} accepted the connection but sent no SSH banner within {target.timeout:g}s"
            )
        return errors.ConnectionLost(target.label, f"ssh to {where} failed: {text}")
    if isinstance(exc, (EOFError, ConnectionError)):
        return errors.ConnectionLost(target.label, f"{where} closed the connection: {exc or type(exc).__name__}")
    if isinstance(exc, OSError):
        return errors.ConnectionRefused(target.label, f"cannot connect to {where}: {exc.strerror or exc}")
    return exc  # a bug of ours: let it show with its traceback


def _open_socket(target: SSHTarget, jump_client: paramiko.SSHClient | None) -> t.Any:
    """The byte stream to the target: a TCP socket, a direct-tcpip channel through the jump host,
    or a ProxyCommand."""
    if jump_client is not None:
        jt = jump_client.get_transport()
        assert jt is not None
        return jt.open_channel("direct-tcpip", (target.hostname, target.port), ("127.0.0.1", 0), timeout=target.timeout)
    if target.proxy_command:
        return paramiko.ProxyCommand(target.proxy_command)  # tokens expanded once, in resolve_target
    sock = socket.create_connection((target.hostname, target.port), timeout=target.timeout)
    # paramiko sends a request and its follow-up as two small writes before it reads: under Nagle's
    # algorithm the second waited for the server's delayed ACK (public-key auth: 51 -> 10 ms a status)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _ack_at_once(sock: t.Any) -> None:
    """Quick-ACK mode on the connection's TCP socket before a channel opens (Linux only; the mode lapses by
    itself). sshd keeps Nagle on for a command without a tty, so its channel-open confirmation waited until
    our kernel's delayed ACK of what sshd had sent just before (up to 40 ms): every remote exec of a
    status waited it (open a channel: 49 -> 2 ms). A channel through a jump host or a ProxyCommand has no
    socket of ours to set."""
    flag = getattr(socket, "TCP_QUICKACK", None)
    if flag is not None and isinstance(sock, socket.socket):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, flag, 1)
        except OSError:  # a socket the kernel no longer holds: the open that follows says so
            pass


def _client(target: SSHTarget, sock: t.Any) -> paramiko.SSHClient:
    """An authenticated client for ``target`` over ``sock`` (or a fresh TCP connection)."""
    known = KnownHosts(target.known_hosts)
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(HostKeyCheck(target, known))
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=list(target.key_files) or None,
            allow_agent=True,
            look_for_keys=not target.key_files,  # like ssh: IdentityFile replaces the default keys
            timeout=target.timeout,
            banner_timeout=target.timeout,
            auth_timeout=target.timeout,
            channel_timeout=target.timeout,
            sock=sock,
            transport_factory=functools.partial(_Transport, preferred_key_types=known.key_types(target.known_name)),
        )
    except BaseException as e:
        client.close()
        err = _unreachable(target, e)
        if err is e:
            raise
        raise err from e
    tr = client.get_transport()
    assert tr is not None
    tr.set_keepalive(KEEPALIVE)
    return client


class SSHTransport(Transport):
    """One paramiko connection per host for a CLI call; a new channel per command."""

    name = "ssh"

    def __init__(self, target: SSHTarget, client: paramiko.SSHClient, jump: paramiko.SSHClient | None = None) -> None:
        self.target = target
        self._client: paramiko.SSHClient | None = client
        self._jump = jump

    @classmethod
    def connect(cls, host: Host) -> SSHTransport:
        """Connect and authenticate; raises ``UnreachableError`` subclasses (refused, timeout, dns,
        auth, host-key) that name the host and port."""
        target = resolve_target(host)
        jump = None
        try:
            if target.proxy_jump is not None:
                jump = _client(target.proxy_jump, None)
            try:
                sock = _open_socket(target, jump)
            except BaseException as e:
                err = _unreachable(target, e)
                if err is e:
                    raise
                raise err from e
            client = _client(target, sock)
        except BaseException:
            if jump is not None:
                jump.close()
            raise
        logger.debug("ssh: connected to %s", target.where)
        return cls(target, client, jump)

    @property
    def alive(self) -> bool:
        tr = self._client.get_transport() if self._client is not None else None
        return bool(tr is not None and tr.is_active() and tr.is_authenticated())

    def _transport(self) -> paramiko.Transport:
        tr = self._client.get_transport() if self._client is not None else None
        if tr is None or not tr.is_active():
            raise ConnectionLost(
                self.target.label, f"the ssh connection to {self.target.hostname}:{self.target.port} is closed"
            )
        return tr

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        argv = tuple(str(a) for a in argv)
        # Quoted once; the remote `timeout` kills the command even when our side stops waiting.
        command = remote_command(["timeout", "-k", str(KILL_AFTER), timeout_arg(timeout), *argv])
        logger.debug("ssh %s: %s", self.target.label, shlex.join(argv))
        started = time.monotonic()
        try:
            tr = self._transport()
            _ack_at_once(tr.sock)
            jump = self._jump.get_transport() if self._jump is not None else None
            if jump is not None:  # the TCP socket is the jump host's, and so is the delayed ACK
                _ack_at_once(jump.sock)
            chan = tr.open_session(timeout=self.target.timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, EOFError, OSError) as e:
            raise _lost(self.target, e) from e
        out: list[bytes] = []
        err: list[bytes] = []
        writer = None
        if stdin is None:
            chan.shutdown_write()
        else:
            # Fed from a thread: a command that writes before it reads must not deadlock us.
            writer = threading.Thread(target=_feed_channel, args=(chan, stdin), daemon=True, name="ssh-stdin")
            writer.start()
        deadline = started + timeout + KILL_AFTER + 5
        timed_out = _drain_channel(chan, out, err, deadline)
        exit_status = chan.recv_exit_status() if chan.exit_status_ready() else None
        sig_name = getattr(chan, "dflash_exit_signal", None)
        chan.close()
        if writer is not None:
            writer.join(timeout=5)
        elapsed = time.monotonic() - started
        code: int | None = exit_status
        sig: int | None = None
        if exit_status == -1 or sig_name is not None:
            code = None
            sig = _signal_number(sig_name)
        # The remote `timeout` exits 124/137 when it fired, or dies of its own group-wide KILL.
        if elapsed >= timeout and (code in TIMEOUT_EXITS or sig == signal_mod.SIGKILL):
            timed_out = True
        return CommandResult(argv, code, b"".join(out), b"".join(err), timed_out=timed_out, signal=sig, timeout=timeout)

    def close(self) -> None:
        for thing in (self._client, self._jump):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()
        self._client = None
        self._jump = None


# Characters that every login shell we may meet (sh, bash, zsh, fish, csh/tcsh) keeps literally
# inside "double quotes": printable ASCII less ' \\ ! " $ `. Inside 'single quotes' they also keep
# " $ ` (_QUOTED); fish still reads \\\\ and \\' there, csh still expands ! and refuses a newline.
_PLAIN = frozenset(chr(c) for c in range(0x20, 0x7F)) - set("'\\!\"$`")
_QUOTED = _PLAIN | set('"$`')
# csh refuses a word longer than about 8 KiB ("Word too long."): no word we send is longer than this.
_WORD_MAX = 4000
# A constant sh program that rebuilds the argv from its positional parameters: "+chunk" words
# are concatenated; "." ends an argument as it is, "," ends one that is a printf format (octal
# escapes for the bytes no shell keeps literally). Then it execs that argv.
_REBUILD = (
    'f=; for w do shift; case $w in .) set -- "$@" "$f"; f=;; ,) a=$(printf "${f}x"); set -- "$@" "${a%x}"; f=;; '
    '*) f=$f${w#+};; esac; done; exec "$@"'
)


def remote_command(argv: t.Sequence[str]) -> str:
    """The exec string for ``argv``, the same for every login shell.

    sshd hands it to ``$SHELL -c`` of the remote user, and fish or csh parse quotes differently
    from sh. When every word is plain (the usual case), it is ``exec "w1" "w2" ...``, which all of
    them read alike. Else it is ``exec /bin/sh -c '<_REBUILD>' sh '+chunk' . ...``: the program is a
    constant, every other word is single-quoted and holds only characters each of those shells
    keeps literally there (a backslash only as ``\\ooo``, which no shell rewrites), and no word is
    longer than csh allows.
    """
    if all(len(a) <= _WORD_MAX and all(c in _PLAIN for c in a) for a in argv):
        return "exec " + " ".join(f'"{a}"' for a in argv)
    words: list[str] = []
    for arg in argv:
        if all(c in _QUOTED for c in arg):
            tokens, end = list(arg), "."
        else:
            # printf's format: plain characters as they are (less %), every other byte as \ooo;
            # a leading '-' too, or printf would read the format as an option.
            data = arg.encode("utf-8", "surrogateescape")
            tokens = [
                chr(b) if chr(b) in _QUOTED and b != 0x25 and not (j == 0 and b == 0x2D) else f"\\{b:03o}"
                for j, b in enumerate(data)
            ]
            end = ","
        chunk = ""
        for tok in tokens:  # an escape is never cut in two: no word ends with a backslash
            if len(chunk) + len(tok) > _WORD_MAX:
                words.append(f"'+{chunk}'")
                chunk = ""
            chunk += tok
        if chunk:
            words.append(f"'+{chunk}'")
        words.append(end)
    return f"exec /bin/sh -c '{_REBUILD}' sh " + " ".join(words)


def _lost(target: SSHTarget, exc: BaseException) -> Exception:
    return ConnectionLost(
        target.label, f"the ssh connection to {target.hostname}:{target.port} broke: {exc or type(exc).__name__}"
    )


def _signal_number(name: str | None) -> int | None:
    if not name:
        return None
    try:
        return int(signal_mod.Signals[f"SIG{name}"])
    except KeyError:
        return None


def _feed_channel(chan: paramiko.Channel, stdin: Stdin) -> None:
    try:
        for chunk in iter_stdin(stdin):
            chan.sendall(chunk)
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the command stopped reading or the channel closed; the exit code tells
    finally:
        with contextlib.suppress(Exception):
            chan.shutdown_write()


def _drain_channel(chan: paramiko.Channel, out: list[bytes], err: list[bytes], deadline: float) -> bool:
    """Read stdout and stderr until the channel is done; True when ``deadline`` passed first.

    Never ``recv_exit_status()`` without a deadline: paramiko waits on it forever.
    """
    status_at: float | None = None
    while True:
        while chan.recv_ready():
            out.append(chan.recv(CHUNK))
        while chan.recv_stderr_ready():
            err.append(chan.recv_stderr(CHUNK))
        if chan.closed or (chan.eof_received and chan.exit_status_ready()):
            while chan.recv_ready():
                out.append(chan.recv(CHUNK))
            while chan.recv_stderr_ready():
                err.append(chan.recv_stderr(CHUNK))
            return False
        now = time.monotonic()
        if chan.exit_status_ready():
            # Exited, but something it left behind still holds stdout open: do not wait for it long.
            status_at = status_at or now
            if now - status_at > 2.0:
                return False
        if now >= deadline:
            return True
        wait = min(deadline - now, 0.5)
        if chan.eof_received:
            chan.status_event.wait(wait)  # the fd stays readable after EOF: wait for the status instead
        else:
            select.select([chan], [], [], wait)


# trust-host's scan: the server's key, fetched without logging in


def scan_host_key(host: Host) -> HostKeyScan:
    """Connect without trusting and without logging in: fetch the server's host key, compare it
    with known_hosts. Raises ``UnreachableError`` subclasses when the host cannot be reached."""
    target = resolve_target(host)
    known = KnownHosts(target.known_hosts)
    jump = _client(target.proxy_jump, None) if target.proxy_jump is not None else None
    tr = None
    try:
        sock = _open_socket(target, jump)
        tr = _Transport(sock, preferred_key_types=known.key_types(target.known_name))
        tr.banner_timeout = target.timeout
        tr.start_client(timeout=target.timeout)
        key = tr.get_remote_server_key()
    except BaseException as e:
        err = _unreachable(target, e)
        if err is e:
            raise
        raise err from e
    finally:
        if tr is not None:
            tr.close()
        if jump is not None:
            jump.close()
    name = target.known_name
    verdict, entries = known.check(name, key)
    recorded = tuple((f, k.get_name(), fingerprint(k)) for f, k in entries)
    patterns = tuple(f"{e.file}:{e.line} ({e.hosts})" for e in known.matching(name) if not line_names(e.hosts, name))
    return HostKeyScan(target, key, verdict, recorded, known.note(name), tuple(known.revoked_at(name, key)), patterns)
