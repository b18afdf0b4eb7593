"""pytest fixtures for the real-process harness (registered in tests/conftest.py).

- ``ssh_home``: a throwaway HOME (the user's ~/.ssh is never read or written), no ssh-agent.
- ``sshd``: a real sshd on 127.0.0.1 for this test (``.stop()``/``.start()``/``.rotate_host_key()``).
- ``fake_pve``: a fake Proxmox host; containers are real pid+mount namespaces.
- ``fake_pve_api``: its REST API for proxmoxer (https on 127.0.0.1, API token).
- ``tmux_servers`` / ``tmux_socket``: unique ``-L`` socket names, servers reaped afterwards.
- ``pve_hosts``: hosts.toml with ``pve`` (sshd + container 200, started) and ``local``; ``.cli()``.

With ``CI=true`` a missing sshd/tmux/unshare is a failure; elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

import pytest

from testkit import FakePve, PveHosts, Sshd, TmuxServers, missing_requirement


def require(what: str) -> None:
    """Skip (or, under CI=true, fail) when the harness part ``what`` cannot run on this machine."""
    reason = missing_requirement(what)
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def ssh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    monkeypatch.delenv("DFLASHCTL_HOSTS", raising=False)
    return home


@pytest.fixture
def sshd(tmp_path: Path, ssh_home: Path) -> t.Iterator[Sshd]:
    require("sshd")
    server = Sshd(tmp_path / "sshd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fake_pve() -> t.Iterator[FakePve]:
    require("namespaces")
    pve = FakePve()
    try:
        yield pve
    finally:
        pve.close()


@pytest.fixture
def fake_pve_api(fake_pve: FakePve) -> t.Iterator[t.Any]:
    """The fake PVE REST API (https on 127.0.0.1, token ``root@pam!dflashctl=s3cret``) over fake_pve's state."""
    from testkit.pveapi import FakePveApi

    with FakePveApi(fake_pve) as api:
        yield api


@pytest.fixture
def tmux_servers() -> t.Iterator[TmuxServers]:
    require("tmux")
    servers = TmuxServers()
    try:
        yield servers
    finally:
        servers.reap()


@pytest.fixture
def tmux_socket(tmux_servers: TmuxServers) -> str:
    return tmux_servers.new()


@pytest.fixture
def pve_hosts(tmp_path: Path, sshd: Sshd, fake_pve: FakePve, ssh_home: Path, tmux_servers: TmuxServers) -> PveHosts:
    fake_pve.create(200, start=True)
    return PveHosts(
        tmp_path / "inventory",
        sshd=sshd,
        pve=fake_pve,
        home=ssh_home,
        vmid=200,
        tmux_socket=tmux_servers.new(),  # lives in the container's /tmp: dies with the container
        local_tmux_socket=tmux_servers.new(),
    )
