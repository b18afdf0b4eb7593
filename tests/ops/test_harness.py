"""The harness itself: sshd, the fake Proxmox host (real namespaces, pct's real texts), tmux reaping."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from testkit import FakePve, PveHosts, Sshd, TmuxServers, pid_alive, retry_until
from testkit.pve import shared_tmp_paths
from testkit.tmux import socket_path


def test_retry_until_returns_the_value_and_reports_the_last_one() -> None:
    seen = iter([0, "", None, "done"])
    assert retry_until(lambda: next(seen), 5, interval=0) == "done"
    with pytest.raises(AssertionError, match=r"last value: \[\]"):
        retry_until(lambda: [], 0.05, interval=0.01)


def _banner(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            return s.recv(64)
    except OSError:
        return b""


def test_sshd_stop_and_start_keep_port_and_keys(sshd: Sshd) -> None:
    assert _banner(sshd.port).startswith(b"SSH-2.0")
    assert sshd.known_hosts.read_text().startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")
    key_before = sshd.host_key_pub
    pid = sshd.pid
    sshd.stop()
    assert pid is not None and not pid_alive(pid)
    assert _banner(sshd.port) == b""
    sshd.start()
    assert _banner(sshd.port).startswith(b"SSH-2.0")
    assert sshd.host_key_pub == key_before


def test_sshd_accepts_the_client_key_with_the_pinned_known_hosts(sshd: Sshd) -> None:
    r = subprocess.run(sshd.ssh_argv("echo", "hello"), capture_output=True, text=True, timeout=30)
    assert (r.returncode, r.stdout) == (0, "hello\n"), r.stderr


def test_rotated_host_key_is_refused_by_openssh_too(sshd: Sshd) -> None:
    sshd.rotate_host_key()
    r = subprocess.run(sshd.ssh_argv("true"), capture_output=True, text=True, timeout=30)
    assert r.returncode == 255 and "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr


def test_pct_texts_and_exit_codes(fake_pve: FakePve) -> None:
    missing = fake_pve.pct_run("status", 201)
    assert missing.returncode == 255
    assert missing.stderr.decode() == "Configuration file 'nodes/pve/lxc/201.conf' does not exist\n"
    fake_pve.create(200)
    assert fake_pve.pct_run("status", 200).stdout == b"status: stopped\n"
    stopped = fake_pve.run_in(200, ["true"])
    assert (stopped.returncode, stopped.stderr) == (255, b"container '200' not running!\n")
    push = fake_pve.pct_run("push", 200, "/etc/hostname", "/root/x")
    assert (push.returncode, push.stderr) == (255, b"can only push files to a running CT\n")
    fake_pve.start(200)
    again = fake_pve.pct_run("start", 200)
    assert (again.returncode, again.stderr) == (255, b"CT 200 already running\n")
    verbose = fake_pve.pct_run("status", 200, "--verbose").stdout.decode()
    assert "status: running\n" in verbose and f"pid: {fake_pve.init_pid(200)}\n" in verbose


def test_exec_relays_streams_and_exit_codes_like_lxc_attach(fake_pve: FakePve) -> None:
    fake_pve.create(200, start=True)
    r = fake_pve.run_in(200, ["sh", "-c", "cat; echo out; echo err >&2; exit 3"], input=b"in\n")
    assert (r.returncode, r.stdout, r.stderr) == (3, b"in\nout\n", b"err\n")
    signalled = fake_pve.run_in(200, ["sh", "-c", "kill -9 $$"])
    assert signalled.returncode == 128 + 9
    absent = fake_pve.run_in(200, ["/opt/no-such-agent", "--json"])
    assert absent.returncode == 127 and b'Failed to exec "/opt/no-such-agent"' in absent.stderr
    # It runs in its own pid namespace: the command sees itself as a low pid, init as 1.
    pid = fake_pve.run_in(200, ["sh", "-c", "echo $$; cat /proc/1/cmdline | tr '\\0' ' '"]).stdout.decode().split("\n")
    assert int(pid[0]) < 100 and "__init__" in pid[1]


def test_container_reboot_kills_its_processes_and_wipes_tmp(fake_pve: FakePve, tmp_path: Path) -> None:
    fake_pve.create(200, start=True)
    init_before = fake_pve.init_pid(200)
    marker = f"/tmp/dflash-marker-{os.getpid()}"
    assert fake_pve.run_in(200, ["sh", "-c", 'echo inside > "$1"', "sh", marker]).returncode == 0
    assert fake_pve.run_in(200, ["cat", marker]).stdout == b"inside\n"
    assert not Path(marker).exists()  # the container's /tmp is its own tmpfs
    # A tmux server inside the container, like a training session.
    sock = "dflash-harness"
    r = fake_pve.run_in(200, ["tmux", "-L", sock, "new-session", "-d", "-s", "t", "sleep 600"])
    assert r.returncode == 0, r.stderr
    server_pid = int(fake_pve.run_in(200, ["tmux", "-L", sock, "display-message", "-p", "#{pid}"]).stdout)
    host_pids = _host_pids_in_namespace_of(init_before)
    assert len(host_pids) >= 2  # init + tmux server + sleep
    fake_pve.reboot(200)
    init_after = fake_pve.init_pid(200)
    assert init_after is not None and init_after != init_before
    for pid in host_pids:
        retry_until(lambda pid=pid: not pid_alive(pid), 10)
    # A fresh, empty /tmp but for the checkout's bind mounts (mpN), when the checkout lives under /tmp.
    mounted = {p.split("/")[2] for p in shared_tmp_paths()}
    assert set(fake_pve.run_in(200, ["ls", "-A", "/tmp"]).stdout.decode().split()) == mounted
    gone = fake_pve.run_in(200, ["tmux", "-L", sock, "has-session", "-t", "=t"])
    assert (
        gone.returncode == 1
        and b"error connecting to /tmp/tmux-0/dflash-harness (No such file or directory)" in gone.stderr
    )
    assert server_pid > 1


def _host_pids_in_namespace_of(init: int | None) -> list[int]:
    assert init is not None
    ns = os.readlink(f"/proc/{init}/ns/pid")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_stop_kills_everything_and_destroy_removes_the_config(fake_pve: FakePve) -> None:
    fake_pve.create(200, start=True)
    init = fake_pve.init_pid(200)
    fake_pve.run_in(200, ["sh", "-c", "sleep 600 >/dev/null 2>&1 &"])
    pids = _host_pids_in_namespace_of(init)
    fake_pve.stop(200)
    for pid in pids:
        retry_until(lambda pid=pid: not pid_alive(pid), 10)
    assert fake_pve.pct_run("stop", 200).stderr == b"CT 200 not running\n"
    fake_pve.destroy(200)
    assert b"does not exist" in fake_pve.pct_run("status", 200).stderr


def test_close_kills_every_init_it_started() -> None:
    from testkit.plugin import require

    require("namespaces")  # under CI=true a failure, never a skip
    pve = FakePve()
    pve.create(200, start=True)
    pve.create(201, start=True)
    pids = [pve.init_pid(200), pve.init_pid(201)]
    pve.close()
    assert all(p is not None for p in pids)
    # SIGKILLed by close(); on a loaded machine a namespace full of processes can take a moment to go (CI)
    retry_until(lambda: not any(pid_alive(p) for p in pids if p is not None), 30)
    assert not pve.root.exists()


def test_tmux_servers_are_reaped_by_socket(tmux_servers: TmuxServers) -> None:
    name = tmux_servers.new()
    assert name.startswith("dflash-test-")
    server = tmux_servers.server(name)
    server.new_session(session_name="x", window_command="sleep 600")
    pid = int(
        subprocess.run(
            ["tmux", "-L", name, "display-message", "-p", "#{pid}"], capture_output=True, text=True, timeout=30
        ).stdout
    )
    assert socket_path(name).exists()
    tmux_servers.reap()
    retry_until(lambda: not pid_alive(pid), 10)
    assert not socket_path(name).exists() and not server.is_alive()


def test_pve_hosts_writes_a_usable_inventory_and_runs_the_real_cli(pve_hosts: PveHosts) -> None:
    inv = pve_hosts.inventory
    assert inv.default == "pve"
    pve = pve_hosts.host("pve")
    assert (pve.port, pve.container, pve.pct) == (pve_hosts.sshd.port, 200, (str(pve_hosts.pve.pct),))
    assert pve_hosts.host("local").is_local
    assert os.environ["HOME"] == str(pve_hosts.home)
    r = pve_hosts.cli("hosts")
    assert r.exit_code == 0, r.stderr
    assert f"root@127.0.0.1:{pve_hosts.sshd.port}, ct 200" in r.stdout
    pve_hosts.write(port=1)
    assert pve_hosts.host().port == 1
