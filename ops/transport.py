"""Transports: the one choke point through which every external command runs.

``Transport.run(argv, *, stdin=None, timeout) -> CommandResult``. ``LocalTransport`` runs on this
machine with subprocess; ``SSHTransport`` runs on a host over one paramiko connection.
argv is always a list; where a shell has to parse it (ssh), it is quoted once (``remote_command``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import functools
import getpass
import hashlib
import hmac
import logging
import os
import re
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
    from ops.errors import HostKeyRevoked
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
    hostname = cfg.get("hostname", host.address)
    if jump is None and cfg.get("proxycommand") and cfg["proxycommand"].lower() != "none":
        # The raw value (see _SSHConfig): %p and %r must be OUR port and user, hosts.toml's included.
        proxy_command = expand_proxy_command(cfg["proxycommand"], host=host, hostname=hostname, port=port, user=user)
    return SSHTarget(
        label=host.name,
        hostname=hostname,
        port=port,
        user=user,
        key_files=key_files,
        known_hosts=known_hosts,
        timeout=host.connect_timeout,
        proxy_jump=jump,
        proxy_command=proxy_command,
    )


class _SSHConfig(paramiko.SSHConfig):
    """paramiko's ssh_config, except that ProxyCommand keeps its %-tokens: paramiko would expand %p
    and %r with the config's own Port/User (or 22 and the local user), before hosts.toml's values
    are known. ``expand_proxy_command`` expands them once with the final ones."""

    def _allowed_tokens(self, key: str) -> list[str]:
        return [] if key == "proxycommand" else super()._allowed_tokens(key)


def expand_proxy_command(raw: str, *, host: Host, hostname: str, port: int, user: str) -> str:
    """OpenSSH's ProxyCommand tokens (``%%``, ``%h``, ``%p``, ``%r``, ``%n``, ``%u``, ``%d``, ``%i``,
    ``%L``, ``%l``, ``%C``) with the final host, port and user; ``~`` at the start of a word is HOME
    (ssh hands the line to a shell; paramiko does not, so we do what that shell would)."""
    from ops.errors import ConfigError

    local = socket.gethostname()
    values = {
        "%": "%",
        "h": hostname,
        "p": str(port),
        "r": user,
        "n": str(host.address),
        "u": getpass.getuser(),
        "d": os.path.expanduser("~"),
        "i": str(os.getuid()),
        "L": local.split(".")[0],
        "l": local,
    }
    values["C"] = hashlib.sha1(f"{values['l']}{hostname}{port}{user}".encode()).hexdigest()

    def token(m: re.Match[str]) -> str:
        if m.group(0) == "~":
            return values["d"]
        if m.group(1) not in values:
            raise ConfigError(f"{host.ssh_config} ProxyCommand", f"unknown token %{m.group(1)} in {raw!r}")
        return values[m.group(1)]

    # One pass, so a value put in by a token is never expanded again.
    return re.sub(r"%(.?)|(?<!\S)~(?=/|\s|$)", token, raw, flags=re.DOTALL)


def _ssh_config(path: str) -> paramiko.SSHConfig:
    full = os.path.expanduser(path)
    if not os.path.isfile(full):
        return _SSHConfig()
    try:
        return _SSHConfig.from_path(full)
    except UnicodeDecodeError as e:
        from ops.errors import ConfigError

        raise ConfigError(full, f"cannot read ssh config: not UTF-8 text (byte {e.start})") from e
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


@dataclasses.dataclass(frozen=True)
class KnownHostsEntry:
    """One readable known_hosts line. ``marker`` is None (a host key), "revoked" or "cert-authority"."""

    file: str
    line: int
    hosts: str  # the first field as written: a pattern list, or one hashed name ``|1|salt|hash``
    key: paramiko.PKey
    marker: str | None = None

    def matches(self, name: str) -> bool:
        """OpenSSH's rule: a hashed name matches exactly; else the comma-separated patterns (``*``,
        ``?``, ``!negation``) are matched against the lowercase name, and any negated match wins."""
        name = name.lower()
        if self.hosts.startswith("|"):
            return _hashed_matches(self.hosts, name)
        positive = False
        for pattern in self.hosts.split(","):
            negated = pattern.startswith("!")
            if _pattern_matches(pattern[1:] if negated else pattern, name):
                if negated:
                    return False
                positive = True
        return positive


def _pattern_matches(pattern: str, name: str) -> bool:
    """OpenSSH ``match_pattern``: ``*`` any run, ``?`` one character, all else literal (so ``[host]:*``
    works; ``[`` is not a character class as in fnmatch)."""
    rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern.lower())
    return re.fullmatch(rx, name, re.DOTALL) is not None


def _hashed_matches(field: str, name: str) -> bool:
    parts = field.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        return hmac.compare_digest(paramiko.HostKeys.hash_host(name, parts[2]), field)
    except (binascii.Error, ValueError, AssertionError):
        return False  # a salt we cannot decode never matches (the line was already counted as readable)


MARKERS = {"@revoked": "revoked", "@cert-authority": "cert-authority"}


def parse_known_hosts_line(text: str, *, file: str = "", line: int = 0) -> KnownHostsEntry | None:
    """One known_hosts line like OpenSSH reads it: None for a blank line or a comment; ValueError
    (with the reason) for a line we cannot use: unknown marker, missing fields, bad base64, a key
    type paramiko does not know."""
    fields = text.split()
    if not fields or fields[0].startswith("#"):
        return None
    marker = None
    if fields[0].startswith("@"):
        if fields[0] not in MARKERS:
            raise ValueError(f"unknown marker {fields[0]}")
        marker = MARKERS[fields[0]]
        fields = fields[1:]
    if len(fields) < 3:
        raise ValueError("expected: hosts key-type base64-key")
    hosts, key_type, blob = fields[:3]
    if hosts.startswith("|") and (len(hosts.split("|")) != 4 or hosts.split("|")[1] != "1"):
        raise ValueError("unknown hashed host name format")
    try:
        raw = base64.b64decode(blob, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"bad base64 key ({e})") from e
    try:
        key = paramiko.PKey.from_type_string(key_type, raw)
    except paramiko.UnknownKeyType as e:
        raise ValueError(f"key type {key_type} is not supported") from e
    except Exception as e:  # noqa: BLE001 - any malformed key blob is "cannot read", whatever paramiko raises
        raise ValueError(f"unreadable {key_type} key ({type(e).__name__})") from e
    if key.get_name() != key_type and key_type not in key.identifiers():
        raise ValueError(f"the key is a {key.get_name()}, the line says {key_type}")
    return KnownHostsEntry(file, line, hosts, key, marker)


class KnownHosts:
    """Every known_hosts file we read, checked the way ssh does: a key that matches an entry in
    any file is accepted; entries for the name with no match mean the key CHANGED; a key under a
    matching ``@revoked`` line is refused whatever else says. Lines we cannot read are skipped
    and counted (like OpenSSH), never fatal; ``@cert-authority`` keys are not host keys."""

    def __init__(self, files: t.Sequence[str]) -> None:
        self.files = tuple(files)
        self._entries: list[KnownHostsEntry] = []
        self.skipped: list[tuple[str, int, str]] = []  # (file, line number, why)
        for f in self.files:
            try:
                # surrogateescape: one stray byte must not hide the file's other lines
                text = Path(f).read_text(encoding="utf-8", errors="surrogateescape")
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                logger.warning("cannot read known_hosts %s: %s", f, e)
                self.skipped.append((f, 0, f"cannot read the file: {e}"))
                continue
            for n, line in enumerate(text.splitlines(), 1):
                try:
                    entry = parse_known_hosts_line(line, file=f, line=n)
                except ValueError as e:
                    logger.info("known_hosts %s:%d skipped: %s", f, n, e)
                    self.skipped.append((f, n, str(e)))
                    continue
                if entry is not None:
                    self._entries.append(entry)

    def matching(self, name: str, marker: str | None = None) -> list[KnownHostsEntry]:
        return [e for e in self._entries if e.marker == marker and e.matches(name)]

    def entries(self, name: str) -> list[tuple[str, paramiko.PKey]]:
        """``(file, key)`` for every host key recorded for ``name`` (plain, hashed or by pattern)."""
        return [(e.file, e.key) for e in self.matching(name)]

    def check(self, name: str, key: paramiko.PKey) -> tuple[str, list[tuple[str, paramiko.PKey]]]:
        """``("known" | "unknown" | "changed" | "revoked", the recorded entries)``."""
        entries = self.entries(name)
        if any(e.key == key for e in self.matching(name, "revoked")):
            return "revoked", entries
        if any(k == key for _, k in entries):
            return "known", entries
        return ("changed" if entries else "unknown"), entries

    def revoked_at(self, name: str, key: paramiko.PKey) -> list[str]:
        """``file:line`` of each ``@revoked`` line that revokes ``key`` for ``name``."""
        return [f"{e.file}:{e.line}" for e in self.matching(name, "revoked") if e.key == key]

    def has_cert_authority(self, name: str) -> bool:
        return bool(self.matching(name, "cert-authority"))

    def key_types(self, name: str) -> list[str]:
        return list(dict.fromkeys(k.get_name() for _, k in self.entries(name)))

    def note(self, name: str) -> str:
        """What a host-key message should add: skipped lines, a CA we do not use."""
        parts = []
        if self.skipped:
            where = ", ".join(f"{f}:{n}" if n else f for f, n, _ in self.skipped[:3])
            more = f" and {len(self.skipped) - 3} more" if len(self.skipped) > 3 else ""
            parts.append(f"{len(self.skipped)} unreadable known_hosts line(s) skipped ({where}{more})")
        if self.has_cert_authority(name):
            parts.append("a @cert-authority line matches this host, but host certificates are not supported: pin the host key itself")
        return "; ".join(parts)


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
        note = self.known.note(tgt.known_name)
        note = f" ({note})" if note else ""
        if verdict == "revoked":
            raise revoked_error(tgt, key, self.known.revoked_at(tgt.known_name, key))
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
            f"host key for {tgt.known_name} is not known ({key.get_name()} {fp}; looked in {', '.join(tgt.known_hosts)}{note}). "
            f"Nothing was run. Check the fingerprint, then run: dflashctl --host {tgt.label} trust-host",
            fingerprint=fp,
            key_type=key.get_name(),
        )


def revoked_error(target: SSHTarget, key: paramiko.PKey, where: t.Sequence[str]) -> HostKeyRevoked:
    """The one refusal for a revoked key (connect, doctor and trust-host say the same)."""
    from ops.errors import HostKeyRevoked

    fp = fingerprint(key)
    return HostKeyRevoked(
        target.label,
        f"host key for {target.known_name} is REVOKED ({key.get_name()} {fp}, @revoked in {', '.join(where)}). "
        f"Nothing was run. The server offers a key you marked as never to be trusted; trust-host will not record it.",
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
        return paramiko.ProxyCommand(target.proxy_command)  # tokens expanded once, in resolve_target
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
        # Quoted once; the remote `timeout` kills the command even when our side stops waiting.
        command = remote_command(["timeout", "-k", str(KILL_AFTER), _seconds(timeout), *argv])
        logger.debug("ssh %s: %s", self.target.label, shlex.join(argv))
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
            tokens = [chr(b) if chr(b) in _QUOTED and b != 0x25 and not (j == 0 and b == 0x2D) else f"\\{b:03o}"
                      for j, b in enumerate(data)]
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


def ssh_config_word(value: str) -> str:
    """``value`` as one word of an ssh_config line (``ssh -o``): double-quoted with ``\\`` and ``\"``
    escapes when it has spaces or quotes (OpenSSH's argv_split), ``%`` doubled (ssh expands
    %-tokens in file names whether quoted or not)."""
    value = value.replace("%", "%%")
    if value and not any(c.isspace() or c in "\"'\\#" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    verdict: str  # "known" | "unknown" | "changed" | "revoked"
    recorded: tuple[tuple[str, str, str], ...]  # (file, key type, fingerprint) already on record
    note: str = ""  # skipped unreadable lines, a @cert-authority we do not use (KnownHosts.note)
    revoked_at: tuple[str, ...] = ()  # file:line of the @revoked lines that name this key
    patterns: tuple[str, ...] = ()  # file:line of pattern entries (not this exact name) on record

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
    name = target.known_name
    verdict, entries = known.check(name, key)
    recorded = tuple((f, k.get_name(), fingerprint(k)) for f, k in entries)
    patterns = tuple(f"{e.file}:{e.line} ({e.hosts})" for e in known.matching(name) if not _line_names(e.hosts, name))
    return HostKeyScan(target, key, verdict, recorded, known.note(name), tuple(known.revoked_at(name, key)), patterns)


def record_host_key(scan: HostKeyScan, *, replace: bool = False) -> str:
    """Append the scanned key to ``scan.file`` (created 0600 in a 0700 folder); with ``replace``,
    drop the entries for that name from the file first. Returns the file."""
    path = Path(scan.file)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = scan.target.known_name
    lines: list[str] = []
    if path.exists():
        # surrogateescape: bytes we cannot decode are written back as they were
        lines = path.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    if replace:
        lines = [kept for ln in lines if (kept := _without_name(ln, name)) is not None]
    lines.append(f"{name} {scan.key.get_name()} {scan.key.get_base64()}")
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogateescape")
    tmp.chmod(0o600 if not path.exists() else path.stat().st_mode & 0o777)
    tmp.replace(path)
    return str(path)


def _line_names(hosts: str, name: str) -> bool:
    """True when a known_hosts host field names ``name`` itself (plain or hashed), not by pattern."""
    name = name.lower()
    for h in hosts.split(","):
        if h.lower() == name:
            return True
        if h.startswith("|") and _hashed_matches(h, name):
            return True
    return False


def _without_name(line: str, name: str) -> str | None:
    """``line`` with ``name`` taken out of its host list (None: nothing is left of it). Marker lines
    (``@revoked``, ``@cert-authority``), comments, pattern and unreadable lines stay as they are:
    --replace drops the old key of this host, never a revocation or another host's entry."""
    fields = line.split()
    if not fields or fields[0].startswith(("#", "@")) or not _line_names(fields[0], name):
        return line
    rest = [h for h in fields[0].split(",") if not _line_names(h, name)]
    if not [h for h in rest if not h.startswith("!")]:
        return None
    return line.replace(fields[0], ",".join(rest), 1)
