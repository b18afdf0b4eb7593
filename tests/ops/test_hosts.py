"""hosts.toml: parsed once into frozen dataclasses; every bad key or value names its key path."""

from __future__ import annotations

import dataclasses
import typing as t
from pathlib import Path

import pytest

from ops.errors import ConfigError
from ops.hosts import EMBEDDED_DEFAULT, find_hosts_file, load_inventory, parse_inventory

SSH_HOST = """
default = "pve"

[hosts.pve]
transport = "ssh"
address = "10.0.0.5"
port = 2222
user = "root"
container = 200
pct = "sudo pct"
workdir = "/root/dflash"
run_dir = "/workspace/runs"
command = "/root/start_training.sh --fast"
env = { PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }

[hosts.pve.proxmox]
node = "pve"
token_name = "dflashctl"
token_value_env = "PVE_TOKEN"
"""


def parse(text: str, base: Path = Path("/base")) -> t.Any:
    return parse_inventory(text, path=None, base=base)


def error_of(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text)
    return info.value


def test_ssh_host_parses_into_frozen_dataclasses() -> None:
    inv = parse(SSH_HOST)
    h = inv.get()
    assert h.name == "pve" and h.port == 2222 and h.container == 200
    assert h.pct == ("sudo", "pct")  # split with shlex
    assert h.command == ("/root/start_training.sh", "--fast")
    assert h.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert h.proxmox is not None and h.proxmox.api_host == "10.0.0.5" and h.proxmox.port == 8006
    assert h.label == "pve (ct 200)"
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.port = 22  # type: ignore[misc]


class Bad(t.NamedTuple):
    test_id: str
    text: str
    path: str
    words: str


BAD = [
    Bad("unknown-key", '[hosts.pve]\naddress = "h"\ncommand = "x"\nportt = 22\n', "hosts.pve.portt", "unknown key"),
    Bad("unknown-top-key", 'defaults = "pve"\n[hosts.pve]\naddress = "h"\ncommand = "x"\n', "defaults", "unknown key"),
    Bad(
        "port-wrong-type",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nport = "x"\n',
        "hosts.pve.port",
        'expected an integer, got "x"',
    ),
    Bad("port-out-of-range", '[hosts.pve]\naddress = "h"\ncommand = "x"\nport = 70000\n', "hosts.pve.port", "1..65535"),
    Bad("port-zero", '[hosts.pve]\naddress = "h"\ncommand = "x"\nport = 0\n', "hosts.pve.port", "got 0"),
    Bad(
        "container-wrong-type",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\ncontainer = "200"\n',
        "hosts.pve.container",
        "expected an integer",
    ),
    Bad(
        "timeout-bool",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nconnect_timeout = true\n',
        "hosts.pve.connect_timeout",
        "expected a number",
    ),
    Bad(
        "keep-connection-negative",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nkeep_connection = -1\n',
        "hosts.pve.keep_connection",
        "at least 0",
    ),
    Bad(
        "keep-connection-string",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nkeep_connection = "10m"\n',
        "hosts.pve.keep_connection",
        "expected a number of seconds",
    ),
    Bad(
        "keep-connection-over-a-day",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nkeep_connection = 86401\n',
        "hosts.pve.keep_connection",
        "at most 86400",
    ),
    Bad(
        "keep-connection-on-a-local-host",
        '[hosts.me]\ntransport = "local"\ncommand = "x"\nkeep_connection = 60\n',
        "hosts.me.keep_connection",
        'only for transport = "ssh"',
    ),
    Bad("default-names-no-host", 'default = "gpu"\n[hosts.pve]\naddress = "h"\ncommand = "x"\n', "default", '"gpu"'),
    Bad(
        "default-wrong-type", 'default = 3\n[hosts.pve]\naddress = "h"\ncommand = "x"\n', "default", "expected a string"
    ),
    Bad(
        "default-required",
        '[hosts.a]\naddress = "h"\ncommand = "x"\n[hosts.b]\naddress = "h"\ncommand = "x"\n',
        "default",
        "required",
    ),
    Bad("no-hosts", 'default = "x"\n', "hosts", "at least one"),
    Bad("missing-address", '[hosts.pve]\ntransport = "ssh"\ncommand = "x"\n', "hosts.pve.address", "required"),
    Bad("address-with-user", '[hosts.pve]\naddress = "root@h"\ncommand = "x"\n', "hosts.pve.address", '"user"'),
    Bad("missing-command", '[hosts.pve]\naddress = "h"\n', "hosts.pve.command", "required"),
    Bad("bad-transport", '[hosts.pve]\ntransport = "telnet"\ncommand = "x"\n', "hosts.pve.transport", '"telnet"'),
    Bad(
        "ssh-key-on-local",
        '[hosts.l]\ntransport = "local"\ncommand = "x"\nport = 22\n',
        "hosts.l.port",
        "only for transport",
    ),
    Bad(
        "relative-remote-workdir",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nworkdir = "dflash"\n',
        "hosts.pve.workdir",
        "absolute",
    ),
    Bad(
        "unsafe-session",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nsession = "a;b"\n',
        "hosts.pve.session",
        "letters, digits",
    ),
    Bad(
        "env-value-type",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nenv = { A = 1 }\n',
        "hosts.pve.env.A",
        "expected a string",
    ),
    Bad(
        "env-name",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\nenv = { "1A" = "x" }\n',
        "hosts.pve.env.1A",
        "environment variable name",
    ),
    Bad(
        "proxmox-unknown-key",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\n[hosts.pve.proxmox]\nnode = "n"\ntoken_name = "t"\ntoken_value_env = "E"\ntoken_value = "secret"\n',
        "hosts.pve.proxmox.token_value",
        "unknown key",
    ),
    Bad(
        "proxmox-ssh-backend",
        '[hosts.pve]\naddress = "h"\ncommand = "x"\n[hosts.pve.proxmox]\nnode = "n"\ntoken_name = "t"\ntoken_value_env = "E"\nbackend = "ssh_paramiko"\n',
        "hosts.pve.proxmox.backend",
        "only",
    ),
    Bad("command-empty", '[hosts.pve]\naddress = "h"\ncommand = ""\n', "hosts.pve.command", "non-empty command"),
]


@pytest.mark.parametrize("case", BAD, ids=[c.test_id for c in BAD])
def test_bad_value_names_its_key_path(case: Bad) -> None:
    err = error_of(case.text)
    assert err.path == case.path
    assert str(err).startswith(f"{case.path}: ")
    assert case.words in str(err)


def test_keep_connection_is_off_unless_set_and_read_as_seconds() -> None:
    plain = parse('[hosts.pve]\naddress = "h"\ncommand = "x"\n').get()
    kept = parse('[hosts.pve]\naddress = "h"\ncommand = "x"\nkeep_connection = 600\n').get()
    assert (plain.keep_connection, kept.keep_connection) == (0.0, 600.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept.keep_connection = 1  # type: ignore[misc]


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "hosts.toml"
    f.write_text("[hosts.pve\n")
    with pytest.raises(ConfigError) as info:
        load_inventory(f)
    assert info.value.path == str(f.resolve()) and "not valid TOML" in str(info.value)


def test_missing_host_names_it_and_the_known_ones() -> None:
    inv = parse(SSH_HOST)
    with pytest.raises(ConfigError) as info:
        inv.get("gpu9")
    assert info.value.path == "hosts.gpu9"
    assert "known: pve" in str(info.value)


def test_local_paths_resolve_against_the_file_folder(tmp_path: Path) -> None:
    f = tmp_path / "conf" / "hosts.toml"
    f.parent.mkdir()
    f.write_text('[hosts.l]\ntransport = "local"\ncommand = "x"\nworkdir = "w"\npython = ".venv/bin/python"\n')
    h = load_inventory(f).get()
    assert h.workdir == str(tmp_path / "conf" / "w")
    assert h.run_dir == str(tmp_path / "conf" / "w" / "runs")
    assert h.python == str(tmp_path / "conf" / ".venv" / "bin" / "python")


def test_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASHCTL_HOSTS", raising=False)
    assert find_hosts_file() is None  # nothing anywhere: the embedded default
    assert load_inventory().get().is_local
    user = home / ".config" / "dflashctl" / "hosts.toml"
    user.parent.mkdir(parents=True)
    user.write_text(EMBEDDED_DEFAULT)
    assert find_hosts_file() == user
    (tmp_path / "hosts.toml").write_text(EMBEDDED_DEFAULT)
    assert find_hosts_file() == Path("hosts.toml")
    env_file = tmp_path / "env.toml"
    env_file.write_text(EMBEDDED_DEFAULT)
    monkeypatch.setenv("DFLASHCTL_HOSTS", str(env_file))
    assert find_hosts_file() == env_file
    explicit = tmp_path / "explicit.toml"
    explicit.write_text(EMBEDDED_DEFAULT)
    assert find_hosts_file(explicit) == explicit
    with pytest.raises(ConfigError) as info:
        find_hosts_file(tmp_path / "nope.toml")
    assert info.value.path == "--hosts"
    monkeypatch.setenv("DFLASHCTL_HOSTS", str(tmp_path / "gone.toml"))
    with pytest.raises(ConfigError) as info:
        find_hosts_file()
    assert info.value.path == "$DFLASHCTL_HOSTS"


def test_shipped_hosts_toml_parses() -> None:
    shipped = Path(__file__).resolve().parents[2] / "hosts.toml"
    inv = load_inventory(shipped)
    assert inv.default == "local" and inv.get().is_local


def test_cli_reports_a_config_error_with_exit_1(tmp_path: Path) -> None:
    import subprocess

    from testkit.hostsfile import dflashctl_argv

    f = tmp_path / "hosts.toml"
    f.write_text('[hosts.pve]\naddress = "h"\ncommand = "x"\nport = "x"\n')
    r = subprocess.run([*dflashctl_argv(), "--hosts", str(f), "hosts"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == 'dflashctl: hosts.pve.port: expected an integer, got "x"'
    f.write_text('[hosts.pve]\naddress = "h"\ncommand = "x"\n')
    r = subprocess.run(
        [*dflashctl_argv(), "--hosts", str(f), "--host", "gpu9", "trust-host"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert r.stderr.startswith("dflashctl: hosts.gpu9: no such host in ") and "(known: pve)" in r.stderr


def test_a_bad_argument_value_exits_1_and_an_unknown_option_2(capsys: pytest.CaptureFixture[str]) -> None:
    from ops.cli import main

    with pytest.raises(SystemExit) as bad_value:
        main(["tail", "-n", "0"])
    assert bad_value.value.code == 1 and "0 is not in the range x>=1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["tail", "--bogus"])
    assert usage.value.code == 2 and "No such option '--bogus'" in capsys.readouterr().err
