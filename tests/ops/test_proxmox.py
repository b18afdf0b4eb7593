"""Container: pct exec/push/status/start over the real sshd, into the fake Proxmox host's namespaces."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import typing as t

import pytest

from ops import errors
from ops.proxmox import Container
from ops.remote import Remote, connect
from testkit import PveHosts, retry_until

NASTY = ["-x", "--keep-env", "a b", "it's", 'say "hi"', "x;id", "$(id)", "`id`", "l1\nl2", "*", "", "ünï ☃"]


@pytest.fixture
def remote(pve_hosts: PveHosts) -> t.Iterator[Remote]:
    r = connect(pve_hosts.host())
    try:
        yield r
    finally:
        r.close()


def ct(remote: Remote) -> Container:
    assert remote.container is not None
    return remote.container


def test_command_runs_inside_the_container_with_streams_intact(remote: Remote, pve_hosts: PveHosts) -> None:
    r = remote.run(["sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo err >&2; exit 5"])
    assert (r.exit_code, r.stderr) == (5, b"err\n")
    assert "__init__" in r.out and str(pve_hosts.pve.state) in r.out  # pid 1 is the container's init
    assert r.argv == ("sh", "-c", "cat /proc/1/cmdline | tr '\\0' ' '; echo err >&2; exit 5")


def test_20mb_binary_stdin_reaches_the_container_intact(remote: Remote) -> None:
    payload = os.urandom(20 * 1024 * 1024)
    r = remote.run(["sha256sum"], stdin=payload, timeout=120)
    assert r.ok, r.err
    assert r.out.split()[0] == hashlib.sha256(payload).hexdigest()


def test_argv_after_the_double_dash_is_untouched(remote: Remote) -> None:
    r = remote.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))", *NASTY])
    assert r.ok, r.err
    assert json.loads(r.out) == NASTY


def test_signalled_command_in_the_container(remote: Remote) -> None:
    r = remote.run(["sh", "-c", "kill -KILL $$"])
    assert r.exit_code == 137 and not r.timed_out  # lxc-attach reports 128+N


def test_timeout_kills_the_process_inside_the_container(remote: Remote, pve_hosts: PveHosts) -> None:
    r = remote.run(["sh", "-c", "echo $$; exec sleep 60"], timeout=1)
    assert r.timed_out
    pid = r.out.split()[0]
    # Ask the container itself: its own pid namespace has no such process any more.
    retry_until(lambda: pve_hosts.pve.run_in(200, ["test", "-e", f"/proc/{pid}"]).returncode == 1, 10)


def test_stopped_container_is_a_typed_error(remote: Remote, pve_hosts: PveHosts) -> None:
    pve_hosts.pve.stop(200)
    with pytest.raises(errors.ContainerDown) as info:
        remote.run(["true"])
    assert (info.value.vmid, info.value.cause) == (200, "stopped")
    assert "container 200 is stopped" in str(info.value)
    assert ct(remote).status() == "stopped"


def test_missing_container_is_a_typed_error(remote: Remote, pve_hosts: PveHosts) -> None:
    pve_hosts.pve.destroy(200)
    with pytest.raises(errors.ContainerDown) as info:
        remote.run(["true"])
    assert (info.value.vmid, info.value.cause) == (200, "missing")
    assert "does not exist" in str(info.value)
    assert ct(remote).status() == "missing"
    assert ct(remote).booted_at() is None


def test_status_booted_at_and_start(remote: Remote, pve_hosts: PveHosts) -> None:
    c = ct(remote)
    assert c.status() == "running"
    booted = c.booted_at()
    now = dt.datetime.now(dt.UTC)
    assert booted is not None and now - dt.timedelta(minutes=5) < booted <= now
    pve_hosts.pve.stop(200)
    assert c.booted_at() is None
    c.start()
    assert c.status() == "running"
    c.start()  # already running: fine
    assert remote.run(["true"]).ok


def test_pct_with_a_prefix_command(pve_hosts: PveHosts) -> None:
    pve_hosts.write(pct=f"env DFLASH_VIA_PREFIX=1 {pve_hosts.pve.pct}")
    r = connect(pve_hosts.host())
    try:
        assert ct(r).pct[:2] == ("env", "DFLASH_VIA_PREFIX=1")
        out = r.run(["sh", "-c", 'echo "$DFLASH_VIA_PREFIX"'])
        assert out.out == "1\n"  # pct exec keeps the environment, like the real one
    finally:
        r.close()


# --- the optional PVE API path (proxmoxer over https, API token from the environment) ------------


def api_container(fake_pve: t.Any, fake_pve_api: t.Any, vmid: int = 200) -> Container:
    from ops.hosts import ProxmoxApi
    from ops.transport import LocalTransport

    api = ProxmoxApi(
        node="pve",
        api_host="127.0.0.1",
        port=fake_pve_api.port,
        token_name="dflashctl",
        token_value_env="DFLASH_TEST_PVE_TOKEN",
        verify_ssl=False,
    )
    return Container(LocalTransport(), vmid, pct=(str(fake_pve.pct),), api=api, config_key="hosts.pve.proxmox")


@pytest.mark.filterwarnings("ignore:Unverified HTTPS request")
def test_api_status_and_start(fake_pve: t.Any, fake_pve_api: t.Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_TEST_PVE_TOKEN", "s3cret")
    fake_pve.create(200)
    c = api_container(fake_pve, fake_pve_api)
    assert c.status() == "stopped"
    c.start()
    assert c.status() == "running" and fake_pve.init_pid(200) is not None
    assert ("POST", "/api2/json/nodes/pve/lxc/200/status/start") in fake_pve_api.requests
    booted = c.booted_at()
    assert booted is not None
    c.start()  # already running: no second start task
    assert fake_pve_api.requests.count(("POST", "/api2/json/nodes/pve/lxc/200/status/start")) == 1
    assert api_container(fake_pve, fake_pve_api, vmid=201).status() == "missing"


@pytest.mark.filterwarnings("ignore:Unverified HTTPS request")
def test_api_token_errors(fake_pve: t.Any, fake_pve_api: t.Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pve.create(200)
    monkeypatch.delenv("DFLASH_TEST_PVE_TOKEN", raising=False)
    with pytest.raises(
        errors.ConfigError,
        match=r"^hosts.pve.proxmox.token_value_env: environment variable DFLASH_TEST_PVE_TOKEN is not set",
    ):
        api_container(fake_pve, fake_pve_api).status()
    monkeypatch.setenv("DFLASH_TEST_PVE_TOKEN", "wrong")
    with pytest.raises(errors.RemoteCommandError, match="401"):
        api_container(fake_pve, fake_pve_api).status()
