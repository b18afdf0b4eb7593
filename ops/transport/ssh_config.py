"""Where to connect: hosts.toml, then ``~/.ssh/config`` (HostName, User, Port, IdentityFile, one
ProxyJump hop, ProxyCommand with OpenSSH's %-tokens), then ssh's defaults."""

from __future__ import annotations

import dataclasses
import getpass
import hashlib
import os
import re
import socket
import typing as t

from ops.errors import ConfigError
from ops.transport._paramiko import paramiko

if t.TYPE_CHECKING:
    from ops.hosts import Host


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


class _SSHConfig(paramiko.SSHConfig):  # type: ignore[misc]  # paramiko ships no types
    """paramiko's ssh_config, except that ProxyCommand keeps its %-tokens: paramiko would expand %p
    and %r with the config's own Port/User (or 22 and the local user), before hosts.toml's values
    are known. ``expand_proxy_command`` expands them once with the final ones."""

    def _allowed_tokens(self, key: str) -> list[str]:
        return [] if key == "proxycommand" else super()._allowed_tokens(key)


def expand_proxy_command(raw: str, *, host: Host, hostname: str, port: int, user: str) -> str:
    """OpenSSH's ProxyCommand tokens (``%%``, ``%h``, ``%p``, ``%r``, ``%n``, ``%u``, ``%d``, ``%i``,
    ``%L``, ``%l``, ``%C``) with the final host, port and user; ``~`` at the start of a word is HOME
    (ssh hands the line to a shell; paramiko does not, so we do what that shell would)."""
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
        raise ConfigError(full, f"cannot read ssh config: not UTF-8 text (byte {e.start})") from e
    except (OSError, paramiko.ConfigParseError) as e:
        raise ConfigError(full, f"cannot read ssh config: {e}") from e


def _jump_target(host: Host, spec: str, key_files: tuple[str, ...], known_hosts: tuple[str, ...]) -> SSHTarget:
    """One ProxyJump hop, ``[user@]host[:port]`` or a Host alias of ~/.ssh/config."""
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


def ssh_config_word(value: str) -> str:
    """``value`` as one word of an ssh_config line (``ssh -o``): double-quoted with ``\\`` and ``\"``
    escapes when it has spaces or quotes (OpenSSH's argv_split), ``%`` doubled (ssh expands
    %-tokens in file names whether quoted or not)."""
    value = value.replace("%", "%%")
    if value and not any(c.isspace() or c in "\"'\\#" for c in value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
