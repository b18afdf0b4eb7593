"""Transports: the one choke point through which every external command runs.

``Transport.run(argv, *, stdin=None, timeout) -> CommandResult``. ``LocalTransport`` runs on this
machine with subprocess; ``SSHTransport`` runs on a host over one paramiko connection.
argv is always a list; where a shell has to parse it (ssh), it is joined with ``shlex.join`` once.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import getpass
import hashlib
import logging
import os
import secrets
import select
import shlex
import shutil
import signal as signal_mod
import socket
import subprocess
import sys
import threading
import time
import typing as t
from pathlib import Path

from ops.errors import CommandTimeout


class _InvokeOnDemand:
    """Stands in for the `invoke` module inside paramiko.config until a `Match exec` line needs it."""

    def __getattr__(self, name: str) -> t.Any:
        import invoke
        import paramiko.config

        paramiko.config.invoke = invoke
        return getattr(invoke, name)


def _import_paramiko_without_invoke() -> None:
    """paramiko imports `invoke` at start-up only to run ssh_config `Match exec` lines; that import is a
    third of paramiko's (~120 ms of every `dflashctl status`, bench/status_vs_raw.py). Import paramiko
    without it, and hand paramiko.config a stand-in that imports invoke on first use."""
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        return
    import importlib.util

    if importlib.util.find_spec("invoke") is None:
        return
    sys.modules["invoke"] = None  # type: ignore[assignment]  # `import invoke` raises ImportError
    try:
        import paramiko.config
    finally:
        del sys.modules["invoke"]
    paramiko.config.invoke = _InvokeOnDemand()  # type: ignore[attr-defined]
    paramiko.config.invoke_import_error = None  # type: ignore[attr-defined]


_import_paramiko_without_invoke()
import paramiko  # noqa: E402  (after the invoke stand-in above)


if t.TYPE_CHECKING:
    from ops.hosts import Host

logger = logging.getLogger(__name__)

# What stdin may be: bytes, a binary file, or an iterator of chunks (streamed, never held whole).
Stdin = t.Union[bytes, t.BinaryIO, t.Iterable[bytes], None]

DEFAULT_TIMEOUT = 60.0
CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True, slots=True)
class CommandResult:
    """What one command did. ``exit_code`` is None when it was killed by a signal (then ``signal``
    holds the number when known; over ssh the number is not always reported)."""

    argv: tuple[str, ...]
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    signal: int | None = None
    timeout: float | None = None  # the limit it ran under (for messages)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def out(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def err(self) -> str:
        return self.stderr.decode("utf-8", "replace")

    def check(self, what: str | None = None) -> CommandResult:
        """Return self when the command succeeded, else raise ``RemoteCommandError``/``CommandTimeout``."""
        from ops.errors import RemoteCommandError

        if self.timed_out:
            raise CommandTimeout(self.argv, self.timeout or 0.0)
        if self.exit_code != 0:
            raise RemoteCommandError(self.argv, self.exit_code, self.err, what=what)
        return self


class Transport:
    """Where commands run: this machine or a host over ssh."""

    name: str = "transport"

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        raise NotImplementedError

    def put(self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None) -> None:
        """Copy one local file to ``remote`` on the host (written to a temp name, then renamed)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the connection; safe to call twice."""

    def __enter__(self) -> t.Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_stdin(stdin: Stdin) -> t.Iterator[bytes]:
    """Chunks of ``stdin`` whatever its form, so a 20 MB payload never sits in memory twice."""
    if stdin is None:
        return
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        data = memoryview(stdin)
        for i in range(0, len(data), CHUNK):
            yield bytes(data[i : i + CHUNK])
        return
    read = getattr(stdin, "read", None)
    if read is not None:
        while chunk := read(CHUNK):
            yield chunk
        return
    for chunk in t.cast(t.Iterable[bytes], stdin):
        if chunk:
            yield bytes(chunk)


class LocalTransport(Transport):
    """This machine, no ssh and no container: the embedded default a new user runs first."""

    name = "local"

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        argv = tuple(str(a) for a in argv)
        logger.debug("local: %s", shlex.join(argv))
        try:
            # A new session so a timeout kills the whole process group, not only the leader.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except FileNotFoundError as e:
            return CommandResult(argv, 127, b"", f"{argv[0]}: {e.strerror}\n".encode())
        except PermissionError as e:
            return CommandResult(argv, 126, b"", f"{argv[0]}: {e.strerror}\n".encode())

        out: list[bytes] = []
        err: list[bytes] = []
        assert proc.stdout is not None and proc.stderr is not None
        workers = [
            threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True),
            threading.Thread(target=_drain, args=(proc.stderr, err), daemon=True),
        ]
        if stdin is not None:
            # A writer thread, so a command that never reads cannot block us past the timeout.
            workers.append(threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True))
        for w in workers:
            w.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
        for w in workers:
            w.join(timeout=5)
        rc = proc.returncode
        sig = -rc if rc is not None and rc < 0 else None
        return CommandResult(
            argv,
            None if sig is not None else rc,
            b"".join(out),
            b"".join(err),
            timed_out=timed_out,
            signal=sig,
            timeout=timeout,
        )

    def put(self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None) -> None:
        dest = Path(remote)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.part")
        shutil.copyfile(local, tmp)
        if mode is not None:
            tmp.chmod(mode)
        tmp.replace(dest)


def _feed(pipe: t.BinaryIO | None, stdin: Stdin) -> None:
    assert pipe is not None
    try:
        for chunk in iter_stdin(stdin):
            pipe.write(chunk)
    except (BrokenPipeError, ValueError, OSError):
        pass  # the command stopped reading; its exit code tells the story
    finally:
        # Always close, even when the stdin iterator itself failed: the command must see EOF.
        with contextlib.suppress(OSError, ValueError):
            pipe.close()


def _drain(stream: t.BinaryIO, sink: list[bytes]) -> None:
    while chunk := stream.read(CHUNK):
        sink.append(chunk)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """TERM the command's process group, then KILL what is left after a short grace."""
    for sig, grace in ((signal_mod.SIGTERM, 2.0), (signal_mod.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            time.sleep(0.02)


# --------------------------------------------------------------------------------------------
# SSH (paramiko)

KILL_AFTER = 5  # seconds between the remote timeout's TERM and its KILL
KEEPALIVE = 15
# A remote `timeout` that fired exits 124 (TERM was enough) or 137 (it had to KILL).
TIMEOUT_EXITS = (124, 137)


@dataclasses.dataclass(frozen=True)
class SSHTarget:
    """Where and as whom to connect, after ``~/.ssh/config`` (hosts.toml values win when set)."""

    label: str  # the host's name in hosts.toml, for messages
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...]
    known_hosts: tuple[str, ...]  # every file read; the first one is where trust-host writes
    timeout: float
    proxy_jump: SSHTarget | None = None
    proxy_command: str | None = None

    @property
    def known_name(self) -> str:
        """The name known_hosts files use: ``host`` on port 22, else ``[host]:port``."""
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    @property
    def where(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"


def resolve_target(host: Host) -> SSHTarget:
    """The host's ssh endpoint: hosts.toml first, then ``~/.ssh/config`` (HostName, User, Port,
    IdentityFile, ProxyJump one hop, ProxyCommand), then ssh's defaults."""
    from ops.errors import ConfigError

    assert host.address is not None, "an ssh host always has an address"
    cfg = _ssh_config(host.ssh_config).lookup(host.address)
    if host.identity_file:
        key = os.path.expanduser(host.identity_file)
        if not os.path.isfile(key):
            raise ConfigError(f"hosts.{host.name}.identity_file", f"no such file: {key}")
        key_files: tuple[str, ...] = (key,)
    else:
        # Like ssh: IdentityFile entries that do not exist are skipped.
        key_files = tuple(p for p in (os.path.expanduser(k) for k in cfg.get("identityfile", [])) if os.path.isfile(p))
    known = []
    if host.known_hosts:
        known.append(os.path.expanduser(host.known_hosts))
    known.append(os.path.expanduser("~/.ssh/known_hosts"))
    known_hosts = tuple(dict.fromkeys(known))
    user = host.user or cfg.get("user") or getpass.getuser()
    try:
        port = host.port or int(cfg.get("port", 22))
    except ValueError as e:
        raise ConfigError(f"{host.ssh_config} Port", f"not a port number: {cfg.get('port')!r}") from e
    jump = None
    proxy_command = None
    if cfg.get("proxyjump") and cfg["proxyjump"].lower() != "none":
        jump = _jump_target(host, cfg["proxyjump"], key_files, known_hosts)
    elif cfg.get("proxycommand") and cfg["proxycommand"].lower() != "none":
        proxy_command = cfg["proxycommand"]
    return SSHTarget(
        label=host.name,
        hostname=cfg.get("hostname", host.address),
        port=port,
        user=user,
        key_files=key_files,
        known_hosts=known_hosts,
        timeout=host.connect_timeout,
        proxy_jump=jump,
        proxy_command=proxy_command,
    )


def _ssh_config(path: str) -> paramiko.SSHConfig:
    full = os.path.expanduser(path)
    if not os.path.isfile(full):
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(full)
    except (OSError, paramiko.ConfigParseError) as e:
        from ops.errors import ConfigError

        raise ConfigError(full, f"cannot read ssh config: {e}") from e


def _jump_target(host: Host, spec: str, key_files: tuple[str, ...], known_hosts: tuple[str, ...]) -> SSHTarget:
    """One ProxyJump hop, ``[user@]host[:port]`` or a Host alias of ~/.ssh/config."""
    from ops.errors import ConfigError

    if "," in spec:
        raise ConfigError(f"{host.ssh_config} ProxyJump", f"only one hop is supported, got {spec!r}")
    user, _, rest = spec.rpartition("@")
    name, port_text = rest, ""
    if rest.startswith("["):  # [v6addr]:port
        name, _, tail = rest[1:].partition("]")
        port_text = tail.lstrip(":")
    elif rest.count(":") == 1:
        name, port_text = rest.split(":")
    cfg = _ssh_config(host.ssh_config).lookup(name)
    jump_keys = tuple(p for p in (os.path.expanduser(k) for k in cfg.get("identityfile", [])) if os.path.isfile(p))
    try:
        port = int(port_text or cfg.get("port", 22))
    except ValueError as e:
        raise ConfigError(f"{host.ssh_config} ProxyJump", f"bad port in {spec!r}") from e
    return SSHTarget(
        label=f"{host.name} (jump host {name})",
        hostname=cfg.get("hostname", name),
        port=port,
        user=user or cfg.get("user") or getpass.getuser(),
        key_files=jump_keys or key_files,
        known_hosts=known_hosts,
        timeout=host.connect_timeout,
    )


class KnownHosts:
    """Every known_hosts file we read, checked the way ssh does: a key that matches an entry in
    any file is accepted; entries for the name with no match mean the key CHANGED."""

    def __init__(self, files: t.Sequence[str]) -> None:
        self.files = tuple(files)
        self._loaded: list[tuple[str, paramiko.HostKeys]] = []
        for f in self.files:
            keys = paramiko.HostKeys()
            if os.path.isfile(f):
                try:
                    keys.load(f)
                except (OSError, paramiko.SSHException) as e:
                    logger.warning("cannot read known_hosts %s: %s", f, e)
            self._loaded.append((f, keys))

    def entries(self, name: str) -> list[tuple[str, paramiko.PKey]]:
        """``(file, key)`` for every key recorded for ``name``."""
        found = []
        for f, keys in self._loaded:
            sub = keys.lookup(name)
            if sub is not None:
                found += [(f, k) for k in sub.values()]
        return found

    def check(self, name: str, key: paramiko.PKey) -> tuple[str, list[tuple[str, paramiko.PKey]]]:
        """``("known" | "unknown" | "changed", the recorded entries)``."""
        entries = self.entries(name)
        if any(k == key for _, k in entries):
            return "known", entries
        return ("changed" if entries else "unknown"), entries

    def key_types(self, name: str) -> list[str]:
        return list(dict.fromkeys(k.get_name() for _, k in self.entries(name)))


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's ``SHA256:...`` fingerprint."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _HostKeyCheck(paramiko.MissingHostKeyPolicy):
    """Our own known_hosts check in the place of paramiko's (nothing is loaded into the client, so
    paramiko asks us about every key): unknown or changed -> ``HostKeyRejected``, nothing runs."""

    def __init__(self, target: SSHTarget, known: KnownHosts) -> None:
        self.target = target
        self.known = known

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        from ops.errors import HostKeyRejected

        verdict, entries = self.known.check(self.target.known_name, key)
        if verdict == "known":
            return
        fp = fingerprint(key)
        tgt = self.target
        if verdict == "changed":
            same_type = [k for _, k in entries if k.get_name() == key.get_name()] or [k for _, k in entries]
            old = fingerprint(same_type[0])
            files = ", ".join(sorted({f for f, _ in entries}))
            raise HostKeyRejected(
                tgt.label,
                f"HOST KEY CHANGED for {tgt.known_name}: known_hosts ({files}) has {old}, the server now offers "
                f"{key.get_name()} {fp}. Nothing was run. This can be an attack; if the change is expected "
                f"(host reinstalled), check the new fingerprint and run: dflashctl --host {tgt.label} trust-host --replace",
                fingerprint=fp,
                changed=True,
                expected=old,
                key_type=key.get_name(),
            )
        raise HostKeyRejected(
            tgt.label,
            f"host key for {tgt.known_name} is not known ({key.get_name()} {fp}; looked in {', '.join(tgt.known_hosts)}). "
            f"Nothing was run. Check the fingerprint, then run: dflashctl --host {tgt.label} trust-host",
            fingerprint=fp,
            key_type=key.get_name(),
        )


def _exit_signal_aware(chan: paramiko.Channel, m: paramiko.Message) -> None:
    """paramiko ignores ``exit-signal`` (a signalled remote process reads as exit status -1): note
    the signal's name on the channel, hand every other request to paramiko."""
    start = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply: always false for exit-signal
        chan.dflash_exit_signal = m.get_text()  # type: ignore[attr-defined]
        return
    m.packet.seek(start)
    paramiko.Channel._handle_request(chan, m)


# paramiko internals (5.x): where a channel request is dispatched. If they move, we only lose the
# signal's number (the result still says "signalled": exit_code None).
_BASE_HANDLERS = getattr(paramiko.Transport, "_channel_handler_table", None)


class _Transport(paramiko.Transport):
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


def _unreachable(target: SSHTarget, exc: BaseException) -> Exception:
    """Turn what paramiko/socket raised while connecting into our typed error (or return it as is)."""
    from ops import errors

    where = f"{target.hostname}:{target.port}"
    if isinstance(exc, errors.OpsError):
        return exc
    if isinstance(exc, socket.gaierror):
        return errors.NameResolutionError(target.label, f"cannot resolve {target.hostname!r}: {exc.strerror or exc}")
    if isinstance(exc, paramiko.BadHostKeyException):  # only if paramiko checked a key itself
        return errors.HostKeyRejected(target.label, f"HOST KEY CHANGED for {target.known_name}", fingerprint=fingerprint(exc.key), changed=True)
    if isinstance(exc, paramiko.AuthenticationException):
        keys = ", ".join(target.key_files) or "ssh-agent and default keys"
        return errors.AuthenticationFailed(target.label, f"authentication failed for {target.where} (tried {keys}): {exc}")
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        inner = next(iter(exc.errors.values()), None)
        if isinstance(inner, (socket.timeout, TimeoutError)):
            return errors.ConnectTimeout(target.label, f"no answer from {where} within {target.timeout:g}s")
        reason = getattr(inner, "strerror", None) or "connection refused"
        return errors.ConnectionRefused(target.label, f"cannot connect to {where}: {reason} (is sshd running there?)")
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return errors.ConnectTimeout(target.label, f"no answer from {where} within {target.timeout:g}s")
    if isinstance(exc, ConnectionRefusedError):
        return errors.ConnectionRefused(target.label, f"cannot connect to {where}: connection refused (is sshd running there?)")
    if isinstance(exc, paramiko.ChannelException):
        return errors.ConnectionRefused(target.label, f"the jump host could not open a connection to {where}: {exc.text}")
    if isinstance(exc, paramiko.SSHException):
        text = str(exc)
        if "banner" in text or "No existing session" in text:
            return errors.ConnectTimeout(target.label, f"{where} accepted the connection but sent no SSH banner within {target.timeout:g}s")
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
        cmd = target.proxy_command.replace("%h", target.hostname).replace("%p", str(target.port)).replace("%r", target.user)
        return paramiko.ProxyCommand(cmd)
    return socket.create_connection((target.hostname, target.port), timeout=target.timeout)


def _client(target: SSHTarget, sock: t.Any) -> paramiko.SSHClient:
    """An authenticated client for ``target`` over ``sock`` (or a fresh TCP connection)."""
    known = KnownHosts(target.known_hosts)
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(_HostKeyCheck(target, known))
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
        self._sftp: paramiko.SFTPClient | None = None

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
        from ops.errors import ConnectionLost

        tr = self._client.get_transport() if self._client is not None else None
        if tr is None or not tr.is_active():
            raise ConnectionLost(self.target.label, f"the ssh connection to {self.target.hostname}:{self.target.port} is closed")
        return tr

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        argv = tuple(str(a) for a in argv)
        # Joined once; the remote `timeout` kills the command even when our side stops waiting.
        command = shlex.join(["timeout", "-k", str(KILL_AFTER), _seconds(timeout), *argv])
        logger.debug("ssh %s: %s", self.target.label, command)
        started = time.monotonic()
        try:
            chan = self._transport().open_session(timeout=self.target.timeout)
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

    def put(self, local: str | os.PathLike[str], remote: str, *, mode: int | None = None) -> None:
        """SFTP to a temp name next to ``remote``, then an atomic rename."""
        from ops.errors import RemoteCommandError

        sftp = self._sftp_client()
        parent, _, name = remote.rstrip("/").rpartition("/")
        tmp = f"{parent}/.{name}.part-{secrets.token_hex(4)}"
        try:
            _sftp_makedirs(sftp, parent or "/")
            sftp.put(os.fspath(local), tmp, confirm=True)
            if mode is not None:
                sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, remote)
        except (OSError, paramiko.SSHException) as e:
            with contextlib.suppress(OSError, paramiko.SSHException):
                sftp.remove(tmp)
            raise RemoteCommandError(["sftp", "put", os.fspath(local), remote], None, str(e), what=f"sftp put {remote}") from e

    def _sftp_client(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            try:
                self._sftp = paramiko.SFTPClient.from_transport(self._transport(), window_size=None)
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise _lost(self.target, e) from e
            assert self._sftp is not None
        return self._sftp

    def close(self) -> None:
        for thing in (self._sftp, self._client, self._jump):
            if thing is not None:
                with contextlib.suppress(Exception):
                    thing.close()
        self._sftp = None
        self._client = None
        self._jump = None


def _lost(target: SSHTarget, exc: BaseException) -> Exception:
    from ops.errors import ConnectionLost

    return ConnectionLost(target.label, f"the ssh connection to {target.hostname}:{target.port} broke: {exc or type(exc).__name__}")


def _seconds(timeout: float) -> str:
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return f"{timeout:.3f}".rstrip("0").rstrip(".")


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


def _sftp_makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = [p for p in path.split("/") if p]
    cur = ""
    for p in parts:
        cur += "/" + p
        try:
            sftp.stat(cur)
        except FileNotFoundError:
            sftp.mkdir(cur)


# --------------------------------------------------------------------------------------------
# trust-host: show the server's key and record it only when the user says so


@dataclasses.dataclass(frozen=True)
class HostKeyScan:
    target: SSHTarget
    key: paramiko.PKey
    verdict: str  # "known" | "unknown" | "changed"
    recorded: tuple[tuple[str, str, str], ...]  # (file, key type, fingerprint) already on record

    @property
    def key_type(self) -> str:
        return self.key.get_name()

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def file(self) -> str:
        """Where trust-host writes: the configured known_hosts, else ~/.ssh/known_hosts."""
        return self.target.known_hosts[0]


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
    verdict, entries = known.check(target.known_name, key)
    recorded = tuple((f, k.get_name(), fingerprint(k)) for f, k in entries)
    return HostKeyScan(target, key, verdict, recorded)


def record_host_key(scan: HostKeyScan, *, replace: bool = False) -> str:
    """Append the scanned key to ``scan.file`` (created 0600 in a 0700 folder); with ``replace``,
    drop the entries for that name from the file first. Returns the file."""
    path = Path(scan.file)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = scan.target.known_name
    lines: list[str] = []
    if path.exists():
        lines = path.read_text().splitlines()
    if replace:
        lines = [ln for ln in lines if not _line_names(ln, name)]
    lines.append(f"{name} {scan.key.get_name()} {scan.key.get_base64()}")
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.chmod(0o600 if not path.exists() else path.stat().st_mode & 0o777)
    tmp.replace(path)
    return str(path)


def _line_names(line: str, name: str) -> bool:
    """True when a known_hosts line is about ``name`` (plain or hashed)."""
    fields = line.split()
    if not fields or line.lstrip().startswith("#"):
        return False
    for h in fields[0].split(","):
        if h == name:
            return True
        if h.startswith("|1|"):
            salt = h.split("|")[2]
            if paramiko.HostKeys.hash_host(name, salt) == h:
                return True
    return False
