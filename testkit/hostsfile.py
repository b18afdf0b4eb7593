"""A hosts.toml for tests: host ``pve`` (the real sshd + the fake Proxmox host) and host ``local``,
plus a runner for the REAL ``dflashctl`` executable against it."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import typing as t
from pathlib import Path

from ops.hosts import Host, Inventory, load_inventory, parse_inventory
from testkit import forkserver
from testkit.forkserver import dflashctl_argv as dflashctl_argv  # where the tests import it from

if t.TYPE_CHECKING:
    from testkit.pve import FakePve
    from testkit.sshd import Sshd

TomlValue = str | int | float | bool | list[t.Any] | dict[str, t.Any]


def toml_value(value: TomlValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_hosts(default: str | None, hosts: dict[str, dict[str, TomlValue]]) -> str:
    """hosts.toml text; a nested dict value of a host becomes its own table (``[hosts.pve.proxmox]``)."""
    lines = [] if default is None else [f"default = {toml_value(default)}", ""]
    for name, table in hosts.items():
        subtables = {k: v for k, v in table.items() if isinstance(v, dict) and k != "env"}
        lines.append(f"[hosts.{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if k not in subtables and v is not None]
        for sub, values in subtables.items():
            lines += ["", f"[hosts.{name}.{sub}]"]
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CliResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def json(self) -> t.Any:
        return json.loads(self.stdout)


class PveHosts:
    """hosts.toml with ``pve`` (ssh to the test sshd, container ``vmid`` of the fake Proxmox host) and
    ``local`` (this machine), default ``pve``.

    ``write(**changes)`` rewrites the ``pve`` entry (a value of None removes the key), e.g.
    ``pve_hosts.write(known_hosts=str(empty_file))`` for the unknown-host-key case.
    """

    def __init__(
        self,
        root: Path,
        *,
        sshd: Sshd,
        pve: FakePve,
        home: Path,
        vmid: int = 200,
        tmux_socket: str = "dflash-test",
        local_tmux_socket: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.sshd = sshd
        self.pve = pve
        self.home = Path(home)
        self.vmid = vmid
        self.path = self.root / "hosts.toml"
        work = pve.fs / f"ct{vmid}"
        self.pve_table: dict[str, TomlValue] = {
            "transport": "ssh",
            "address": "127.0.0.1",
            "port": sshd.port,
            "user": sshd.user,
            "identity_file": str(sshd.client_key),
            "known_hosts": str(sshd.known_hosts),
            "connect_timeout": 5,
            "container": vmid,
            "pct": str(pve.pct),
            "workdir": str(work / "dflash"),
            "run_dir": str(work / "runs"),
            "python": sys.executable,
            "session": "dflash",
            "command": ["sh", "-c", "echo step 1; sleep 600"],
            "tmux_socket": tmux_socket,
        }
        self.local_table: dict[str, TomlValue] = {
            "transport": "local",
            "workdir": str(self.root / "local" / "dflash"),
            "run_dir": str(self.root / "local" / "runs"),
            "python": sys.executable,
            "session": "dflash",
            "command": ["sh", "-c", "echo step 1; sleep 600"],
            "tmux_socket": local_tmux_socket or f"{tmux_socket}-local",
        }
        self.default = "pve"
        self.write()

    def write(self, **changes: TomlValue | None) -> Path:
        for key, value in changes.items():
            if value is None:
                self.pve_table.pop(key, None)
            else:
                self.pve_table[key] = value
        self.path.write_text(dump_hosts(self.default, {"pve": self.pve_table, "local": self.local_table}))
        return self.path

    @property
    def inventory(self) -> Inventory:
        return load_inventory(self.path)

    def host(self, name: str = "pve") -> Host:
        return self.inventory.get(name)

    @property
    def workdir(self) -> Path:
        return Path(str(self.pve_table["workdir"]))

    @property
    def run_dir(self) -> Path:
        return Path(str(self.pve_table["run_dir"]))

    def env(self, extra: t.Mapping[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("SSH_AUTH_SOCK", "DFLASHCTL_HOSTS", "TMUX")}
        env["HOME"] = str(self.home)
        env.update(extra or {})
        return env

    def cli(
        self, *args: str, input: str | None = None, timeout: float = 60, env: t.Mapping[str, str] | None = None
    ) -> CliResult:
        """Run the real ``dflashctl --hosts <path> ...`` as a child process with the test HOME: a fork of this
        worker's dflashctl fork server (click, paramiko and ops imported once: ~0.3 s of CPU a command),
        a fresh interpreter when stdin is given."""
        proc = forkserver.shared("dflashctl").run(
            ["--hosts", str(self.path), *args], input=input, timeout=timeout, env=self.env(env), cwd=self.root
        )
        return CliResult(proc.returncode, proc.stdout, proc.stderr)


def ssh_host(sshd: Sshd, **changes: t.Any) -> Host:
    """Host ``pve``: the real sshd on 127.0.0.1, its client key and known_hosts; a change of None drops the key."""
    table: dict[str, t.Any] = {
        "address": "127.0.0.1",
        "port": sshd.port,
        "user": "root",
        "identity_file": str(sshd.client_key),
        "known_hosts": str(sshd.known_hosts),
        "connect_timeout": 5,
        "command": "true",
    }
    for k, v in changes.items():
        if v is None:
            table.pop(k, None)
        else:
            table[k] = v
    return parse_inventory(dump_hosts(None, {"pve": table}), path=None, base=Path("/")).get("pve")


def local_host(tmp_path: Path, socket: str, command: list[str], **extra: t.Any) -> Host:
    """Host ``local`` on its own tmux socket, its workdir and run_dir under ``tmp_path``; also written as
    ``tmp_path/hosts.toml`` for the real CLI (``dflashctl``)."""
    table: dict[str, t.Any] = {
        "transport": "local",
        "workdir": str(tmp_path / "work"),
        "run_dir": str(tmp_path / "runs"),
        "python": sys.executable,
        "session": "dflash",
        "command": command,
        "tmux_socket": socket,
        "hang_after": 600,
        "startup_grace": 0,
        **extra,
    }
    text = dump_hosts(None, {"local": table})
    (tmp_path / "hosts.toml").write_text(text)
    return parse_inventory(text, path=None, base=tmp_path).get("local")
