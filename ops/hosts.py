"""The inventory: hosts.toml read once into frozen dataclasses (docs/design.md section 2).

Every unknown key and every bad value is a ``ConfigError`` that names its full key path,
e.g. ``hosts.pve.port: expected an integer, got "x"``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing as t
from pathlib import Path

from ops import keypath
from ops.errors import ConfigError
from ops.group import Group, parse_groups

ENV_VAR = "DFLASHCTL_HOSTS"
USER_FILE = "~/.config/dflashctl/hosts.toml"

# What a new user gets with no hosts.toml anywhere: this machine, the tiny CPU run.
EMBEDDED_DEFAULT = """\
default = "local"

[hosts.local]
transport = "local"
workdir = ".dflash"
run_dir = ".dflash/runs"
command = "python -m dflash train --config configs/tiny-cpu.toml"
"""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProxmoxApi:
    """Optional proxmoxer (https + API token) path for container status and start."""

    node: str
    api_host: str
    port: int = 8006
    user: str = "root@pam"
    token_name: str
    token_value_env: str
    verify_ssl: bool = True
    backend: str = "https"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SupervisePlace:
    """``[hosts.NAME.supervise]``: where `dflashctl supervise install` puts the supervisor on the Proxmox
    host that runs the container (docs/design.md section 18)."""

    dir: str = "/var/lib/dflashctl"  # on the host: dflashctl's release, the launcher, one folder per session
    python: str = "python3"  # the host's interpreter (stdlib only: nothing is installed there)
    mode: t.Literal["auto", "systemd", "tmux"] = "auto"  # auto: systemd when it is PID 1, else tmux
    tmux_socket: str = "dflashctl-supervise"  # tmux mode: `tmux -L NAME` on the host


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Host:
    """One machine dflashctl manages: where it is, how to get in, and what runs there."""

    name: str
    transport: t.Literal["local", "ssh"]
    workdir: str
    run_dir: str
    python: str = "python3"
    session: str = "dflash"
    command: tuple[str, ...]
    env: t.Mapping[str, str] = dataclasses.field(default_factory=dict)
    tmux_socket: str = "dflash"
    hang_after: float = 900.0
    startup_grace: float = 1200.0
    keep_releases: int = 5
    # ssh only
    address: str | None = None
    port: int | None = None  # None: from ~/.ssh/config, else 22
    user: str | None = None  # None: from ~/.ssh/config, else the local user
    identity_file: str | None = None
    known_hosts: str | None = None
    ssh_config: str = "~/.ssh/config"
    connect_timeout: float = 10.0
    # Seconds a connection keeper (ops/transport/keeper.py) holds the ssh connection after its last use,
    # for later dflashctl calls to reuse; 0: none, every call connects afresh.
    keep_connection: float = 0.0
    container: int | None = None
    pct: tuple[str, ...] = ("pct",)
    proxmox: ProxmoxApi | None = None
    supervise: SupervisePlace = dataclasses.field(default_factory=SupervisePlace)

    @property
    def is_local(self) -> bool:
        return self.transport == "local"

    @property
    def label(self) -> str:
        """How messages name the host: ``pve (ct 200)``."""
        return self.name if self.container is None else f"{self.name} (ct {self.container})"

    @property
    def secret_env(self) -> tuple[str, ...]:
        """Environment variables of this machine that hold this host's secrets (the API token)."""
        return (self.proxmox.token_value_env,) if self.proxmox is not None else ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Inventory:
    path: Path | None  # None: the embedded default
    default: str
    hosts: t.Mapping[str, Host]
    groups: t.Mapping[str, Group] = dataclasses.field(default_factory=dict)  # [groups.NAME] (ops/group.py)

    def get(self, name: str | None = None) -> Host:
        """The host called ``name``, or the default host."""
        key = name or self.default
        if key not in self.hosts:
            known = ", ".join(sorted(self.hosts)) or "none"
            raise ConfigError(f"hosts.{key}", f"no such host in {self.source} (known: {known})")
        return self.hosts[key]

    def group(self, name: str) -> Group:
        """The group called ``name``."""
        if name not in self.groups:
            known = ", ".join(sorted(self.groups)) or "none"
            raise ConfigError(f"groups.{name}", f"no such group in {self.source} (known: {known})")
        return self.groups[name]

    @property
    def source(self) -> str:
        return str(self.path) if self.path else "the embedded default inventory"

    @property
    def secret_env(self) -> tuple[str, ...]:
        """Every host's secret environment variables (what a hook must not inherit)."""
        return tuple(dict.fromkeys(name for h in self.hosts.values() for name in h.secret_env))


# --------------------------------------------------------------------------------------------
# Loading


def find_hosts_file(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """Lookup order: ``--hosts PATH``, ``$DFLASHCTL_HOSTS``, ``./hosts.toml``, the user file; None = embedded."""
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ConfigError("--hosts", f"no such file: {path}")
        return path
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ConfigError(f"${ENV_VAR}", f"no such file: {path}")
        return path
    for candidate in (Path("hosts.toml"), Path(USER_FILE).expanduser()):
        if candidate.is_file():
            return candidate
    return None


def load_inventory(explicit: str | os.PathLike[str] | None = None) -> Inventory:
    """Find and parse the inventory once (see ``find_hosts_file`` for the order)."""
    path = find_hosts_file(explicit)
    if path is None:
        return parse_inventory(EMBEDDED_DEFAULT, path=None, base=Path.cwd())
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(str(path), f"cannot read: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(
            str(path), f"not UTF-8 text (byte {e.start}: {e.object[e.start : e.start + 1]!r}); TOML files are UTF-8"
        ) from e
    return parse_inventory(text, path=path.resolve(), base=path.resolve().parent)


def parse_inventory(text: str, *, path: Path | None, base: Path) -> Inventory:
    """Parse hosts.toml text; relative paths of local hosts resolve against ``base``."""
    where = str(path) if path else "hosts.toml"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(where, f"not valid TOML: {e}") from e
    except RecursionError as e:  # tomllib recurses once per nested array or inline table
        raise ConfigError(where, "not valid TOML here: values nested too deeply") from e
    keypath.only_keys(data, {"default", "hosts", "groups"}, "")
    hosts_raw = data.get("hosts", {})
    if not isinstance(hosts_raw, dict) or not hosts_raw:
        raise ConfigError("hosts", "expected at least one [hosts.<name>] table")
    hosts = {name: _parse_host(name, raw, base) for name, raw in hosts_raw.items()}
    if "default" in data:
        default = keypath.string(data["default"], "default")
    elif len(hosts) == 1:
        default = next(iter(hosts))
    else:
        raise ConfigError("default", "required when there is more than one host")
    if default not in hosts:
        raise ConfigError("default", f'names no host: "{default}" (known: {", ".join(sorted(hosts))})')
    return Inventory(path=path, default=default, hosts=hosts, groups=parse_groups(data.get("groups"), hosts))


_COMMON = {
    "transport",
    "workdir",
    "run_dir",
    "python",
    "session",
    "command",
    "env",
    "tmux_socket",
    "hang_after",
    "startup_grace",
    "keep_releases",
}
_SSH = {
    "address",
    "port",
    "user",
    "identity_file",
    "known_hosts",
    "ssh_config",
    "connect_timeout",
    "keep_connection",
}
# A keeper idles at most a day: a connection kept past that is one nobody uses.
KEEP_CONNECTION_MAX = 86400.0
# A Proxmox container: reached over ssh, or with transport = "local" by dflashctl running on the Proxmox
# host itself (pct exec directly, no ssh: the supervisor `dflashctl supervise install` puts there).
_CONTAINER = {"container", "pct", "proxmox", "supervise"}


def _parse_host(name: str, raw: t.Any, base: Path) -> Host:
    p = f"hosts.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(p, f"expected a table, got {keypath.show(raw)}")
    transport = raw.get("transport", "ssh" if "address" in raw else None)
    if transport not in ("local", "ssh"):
        got = "nothing" if transport is None else keypath.show(transport)
        raise ConfigError(f"{p}.transport", f'expected "local" or "ssh", got {got}')
    allowed = _COMMON | _CONTAINER | (_SSH if transport == "ssh" else set())
    for key in raw:
        if key not in allowed:
            hint = ' (only for transport = "ssh")' if key in _SSH else ""
            raise ConfigError(f"{p}.{key}", f"unknown key{hint}")
    container = "container" in raw
    for key in ("pct", "proxmox", "supervise"):
        # (an ssh host always took pct and proxmox; they do nothing there without a container)
        if key in raw and not container and (transport == "local" or key == "supervise"):
            raise ConfigError(f"{p}.{key}", "only for a host with a container (set container = N)")

    kw: dict[str, t.Any] = {"name": name, "transport": transport}
    if container:
        kw["container"] = keypath.integer(raw["container"], f"{p}.container", minimum=100)
    if "pct" in raw:
        kw["pct"] = keypath.argv(raw["pct"], f"{p}.pct")
    if "supervise" in raw:
        kw["supervise"] = _parse_supervise(raw["supervise"], f"{p}.supervise")
    for key in ("python", "session", "tmux_socket"):
        if key in raw:
            kw[key] = keypath.string(raw[key], f"{p}.{key}", nonempty=True)
    for key in ("hang_after", "startup_grace"):
        if key in raw:
            kw[key] = keypath.number(raw[key], f"{p}.{key}", minimum=0)
    if "keep_releases" in raw:
        kw["keep_releases"] = keypath.integer(raw["keep_releases"], f"{p}.keep_releases", minimum=2)
    if "command" not in raw:
        raise ConfigError(f"{p}.command", "required: the training command the session runs")
    kw["command"] = keypath.argv(raw["command"], f"{p}.command")
    if "env" in raw:
        env = raw["env"]
        if not isinstance(env, dict):
            raise ConfigError(f"{p}.env", f"expected a table of strings, got {keypath.show(env)}")
        for k in env:
            if not keypath.ENV_NAME.fullmatch(k):
                raise ConfigError(
                    f"{p}.env.{k}",
                    "not a valid environment variable name (letters, digits, '_'; not starting with a digit)",
                )
        kw["env"] = {k: keypath.string(v, f"{p}.env.{k}") for k, v in env.items()}
    for key in ("session", "tmux_socket"):
        if key in kw:
            keypath.check_name(kw[key], f"{p}.{key}")

    if transport == "local" and not container:
        workdir = keypath.local_path(raw.get("workdir", ".dflash"), f"{p}.workdir", base)
        kw["workdir"] = workdir
        kw["run_dir"] = keypath.local_path(raw.get("run_dir", f"{workdir}/runs"), f"{p}.run_dir", base)
        if "python" in kw and "/" in kw["python"]:
            kw["python"] = keypath.local_path(kw["python"], f"{p}.python", base)
        return Host(**kw)
    # The run lives in a container (paths and python are the container's, never this file's folder),
    # or on an ssh host: absolute paths, the same defaults.
    _far_paths(raw, kw, p)
    if transport == "local":
        if "proxmox" in raw:  # dflashctl on the Proxmox host itself: the API is this machine's
            kw["proxmox"] = _parse_proxmox(raw["proxmox"], f"{p}.proxmox", default_host="localhost")
        return Host(**kw)

    if "address" not in raw:
        raise ConfigError(f"{p}.address", 'required for transport = "ssh"')
    kw["address"] = keypath.string(raw["address"], f"{p}.address", nonempty=True)
    if "@" in kw["address"] or any(c.isspace() for c in kw["address"]):
        raise ConfigError(
            f"{p}.address",
            f'expected a host name or address (put the user in "user"), got {keypath.show(kw["address"])}',
        )
    keypath.ssh_word(kw["address"], f"{p}.address")
    if "port" in raw:
        kw["port"] = keypath.integer(raw["port"], f"{p}.port", minimum=1, maximum=65535)
    for key in ("user", "identity_file", "known_hosts", "ssh_config"):
        if key in raw:
            kw[key] = keypath.string(raw[key], f"{p}.{key}", nonempty=True)
    if "user" in kw:
        keypath.ssh_word(kw["user"], f"{p}.user")
    for key in ("identity_file", "known_hosts", "ssh_config"):
        if key in kw:
            keypath.ssh_path(kw[key], f"{p}.{key}")
    if "connect_timeout" in raw:
        kw["connect_timeout"] = keypath.number(raw["connect_timeout"], f"{p}.connect_timeout", minimum=0.1)
    if "keep_connection" in raw:
        keep = keypath.number(raw["keep_connection"], f"{p}.keep_connection", minimum=0)
        if keep > KEEP_CONNECTION_MAX:
            raise ConfigError(
                f"{p}.keep_connection", f"expected at most {KEEP_CONNECTION_MAX:.0f} seconds (a day), got {keep:g}"
            )
        kw["keep_connection"] = keep
    if "proxmox" in raw:
        kw["proxmox"] = _parse_proxmox(raw["proxmox"], f"{p}.proxmox", default_host=kw["address"])
    return Host(**kw)


def _far_paths(raw: dict[str, t.Any], kw: dict[str, t.Any], p: str) -> None:
    """workdir and run_dir of an ssh host or a container: absolute, where the run lives."""
    where = "in the container" if "container" in kw else "on the host"
    for key in ("workdir", "run_dir"):
        if key in raw:
            value = keypath.string(raw[key], f"{p}.{key}", nonempty=True)
            if not value.startswith("/"):
                raise ConfigError(f"{p}.{key}", f"expected an absolute path {where}, got {keypath.show(value)}")
            kw[key] = value
    kw.setdefault("workdir", "/root/dflash")
    kw.setdefault("run_dir", f"{kw['workdir']}/runs")


# Folders of the host's own: a supervise dir is a folder of dflashctl's below one of these, never one of them.
SYSTEM_DIRS = frozenset(
    "/ /bin /boot /dev /etc /home /lib /lib32 /lib64 /libx32 /media /mnt /opt /proc /root /run /sbin /srv /sys "
    "/tmp /usr /usr/bin /usr/lib /usr/lib64 /usr/libexec /usr/local /usr/local/bin /usr/local/lib /usr/local/sbin "
    "/usr/sbin /usr/share /usr/src /var /var/cache /var/lib /var/lib/vz /var/local /var/log /var/opt /var/spool "
    "/var/tmp /etc/pve /etc/systemd /etc/systemd/system".split()
)


def supervise_dir_problem(value: str, *, resolve: bool = False) -> str | None:
    """Why ``value`` cannot be the supervisor's folder on the host (None: it can). The operator's side and
    the host's check it alike; the host (``resolve``) also checks where it really is, links followed: a
    folder of dflashctl's below a link to /var may be /var/local."""
    if not value.startswith("/") or "\0" in value:
        return "expected an absolute path on the Proxmox host"
    if os.path.normpath(value) != value or value.startswith("//"):
        return f"expected a normalised path (no '.', '..', '//' or trailing '/'): {os.path.normpath(value)!r}?"
    if value in SYSTEM_DIRS:
        return "a folder of the system itself: give a folder of dflashctl's own below it (default /var/lib/dflashctl)"
    real = os.path.realpath(value) if resolve else value
    if real in SYSTEM_DIRS:
        return f"{value} is {real} through a link: a folder of the system itself; give a folder of dflashctl's own"
    return None


def _parse_supervise(raw: t.Any, p: str) -> SupervisePlace:
    if not isinstance(raw, dict):
        raise ConfigError(p, f"expected a table, got {keypath.show(raw)}")
    keypath.only_keys(raw, {"dir", "python", "mode", "tmux_socket"}, f"{p}.")
    kw: dict[str, t.Any] = {}
    if "dir" in raw:
        value = keypath.string(raw["dir"], f"{p}.dir", nonempty=True)
        problem = supervise_dir_problem(value)
        if problem:
            raise ConfigError(f"{p}.dir", f"{problem}, got {keypath.show(value)}")
        kw["dir"] = value
    if "python" in raw:
        kw["python"] = keypath.string(raw["python"], f"{p}.python", nonempty=True)
    if "mode" in raw:
        mode = keypath.string(raw["mode"], f"{p}.mode")
        if mode not in ("auto", "systemd", "tmux"):
            raise ConfigError(f"{p}.mode", f'expected "auto", "systemd" or "tmux", got {keypath.show(mode)}')
        kw["mode"] = mode
    if "tmux_socket" in raw:
        kw["tmux_socket"] = keypath.check_name(
            keypath.string(raw["tmux_socket"], f"{p}.tmux_socket", nonempty=True), f"{p}.tmux_socket"
        )
    return SupervisePlace(**kw)


def _parse_proxmox(raw: t.Any, p: str, *, default_host: str) -> ProxmoxApi:
    if not isinstance(raw, dict):
        raise ConfigError(p, f"expected a table, got {keypath.show(raw)}")
    allowed = {"node", "backend", "api_host", "port", "user", "token_name", "token_value_env", "verify_ssl"}
    for key in raw:
        if key not in allowed:
            raise ConfigError(f"{p}.{key}", "unknown key")
    for key in ("node", "token_name", "token_value_env"):
        if key not in raw:
            raise ConfigError(f"{p}.{key}", "required")
    backend = keypath.string(raw.get("backend", "https"), f"{p}.backend")
    if backend != "https":
        # proxmoxer's ssh backends accept any host key; we only use the token API.
        raise ConfigError(f"{p}.backend", f'only "https" is supported, got {keypath.show(backend)}')
    verify = raw.get("verify_ssl", True)
    if not isinstance(verify, bool):
        raise ConfigError(f"{p}.verify_ssl", f"expected true or false, got {keypath.show(verify)}")
    return ProxmoxApi(
        node=keypath.string(raw["node"], f"{p}.node", nonempty=True),
        api_host=keypath.string(raw.get("api_host", default_host), f"{p}.api_host", nonempty=True),
        port=keypath.integer(raw.get("port", 8006), f"{p}.port", minimum=1, maximum=65535),
        user=keypath.string(raw.get("user", "root@pam"), f"{p}.user", nonempty=True),
        token_name=keypath.string(raw["token_name"], f"{p}.token_name", nonempty=True),
        token_value_env=keypath.env_name(raw["token_value_env"], f"{p}.token_value_env"),
        verify_ssl=verify,
        backend=backend,
    )
