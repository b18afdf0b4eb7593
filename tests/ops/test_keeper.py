"""The connection keeper (ops/transport/keeper.py) against the real sshd on 127.0.0.1 and the fake Proxmox host:
reuse, idle exit, private files, refusal of another owner or mode, a dead keeper, known_hosts kept the authority."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import time
import typing as t
from pathlib import Path

import pytest

from ops import errors
from ops.hosts import Host
from ops.remote import connect
from ops.transport import keeper
from ops.transport.keeper import KeeperState, KeptTransport
from testkit import retry_until
from testkit.hostsfile import PveHosts
from testkit.runkit import fake_release

# The pid of the sshd process that serves one connection, seen from a command run over it: every channel's
# command is a grandchild of it (the login shell execs `timeout`, whose child this is).
CONNECTION_PID = ["sh", "-c", "cut -d' ' -f4 /proc/$PPID/stat"]


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> t.Iterator[Path]:
    """$XDG_RUNTIME_DIR of this test (short: a socket path has at most 107 bytes); every keeper started under it
    is ended by pid afterwards."""
    root = Path(tempfile.mkdtemp(prefix="kt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(root))
    try:
        yield root
    finally:
        folder = root / "dflashctl-keeper"
        for lock in folder.glob("*.lock") if folder.is_dir() else []:
            pid = lock.read_text().strip()
            if pid.isdigit() and not keeper._lock_free(lock):
                os.kill(int(pid), signal.SIGKILL)
        for proc in keeper._started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        keeper._started.clear()
        shutil.rmtree(root, ignore_errors=True)


def kept_host(pve_hosts: PveHosts, seconds: float = 60) -> Host:
    pve_hosts.write(keep_connection=seconds)
    return pve_hosts.host()


def ready(host: Host) -> KeeperState:
    retry_until(lambda: keeper.reach(host).state is KeeperState.READY, 30)
    return keeper.reach(host).state


def connection_pid(transport: t.Any) -> str:
    res = transport.run(CONNECTION_PID, timeout=20)
    assert res.ok, res
    return res.out.strip()


def test_calls_after_the_first_reuse_the_keepers_one_connection(pve_hosts: PveHosts, runtime: Path) -> None:
    host = kept_host(pve_hosts)
    assert keeper.reach(host).state is KeeperState.ABSENT
    first = connect(host).transport  # no keeper yet: a direct connection, and one started beside it
    assert type(first).__name__ == "SSHTransport"
    direct = connection_pid(first)
    first.close()
    ready(host)
    a, b = connect(host).transport, connect(host).transport
    assert isinstance(a, KeptTransport) and isinstance(b, KeptTransport)
    through_a, through_b = connection_pid(a), connection_pid(b)
    assert through_a == through_b != direct  # two "calls", one ssh connection: the keeper's
    # a command's exit code, stderr and stdin travel whole; the container is in front as usual
    res = connect(host).run(["sh", "-c", "cat; echo oops >&2; exit 3"], stdin=b"x" * 100_000, timeout=20)
    assert (res.exit_code, len(res.stdout), res.err) == (3, 100_000, "oops\n")


def test_status_through_the_keeper_is_the_same_status(pve_hosts: PveHosts, runtime: Path) -> None:
    """The CLI (a process of its own, like the operator's): the first status starts the keeper, the next ones
    are served by it (its log counts them), with the same answer."""
    fake_release(pve_hosts.workdir)
    host = kept_host(pve_hosts)
    first = pve_hosts.cli("status", "--json")
    assert first.exit_code == 7, first.output
    ready(host)
    log = keeper.socket_path(host).with_suffix(".log")
    served = log.read_text().count("served:")
    second = pve_hosts.cli("status", "--json")
    assert second.exit_code == 7, second.output
    assert log.read_text().count("served:") == served + 1
    same = ("host", "state", "cause", "mode", "tmux", "container", "evidence")  # (the disk's free bytes move)
    assert {k: second.json()[k] for k in same} == {k: first.json()[k] for k in same}


def test_files_are_private_and_an_idle_keeper_exits_and_removes_its_socket(pve_hosts: PveHosts, runtime: Path) -> None:
    host = kept_host(pve_hosts, seconds=1.5)
    pid = keeper.start(host)
    assert pid is not None
    ready(host)
    path = keeper.socket_path(host)
    d, s = os.lstat(path.parent), os.lstat(path)
    assert stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.getuid()
    assert stat.S_ISSOCK(s.st_mode) and stat.S_IMODE(s.st_mode) == 0o600 and s.st_uid == os.getuid()
    assert keeper.keeper_pid(host) == pid
    assert connection_pid(KeptTransport(host, path))  # used once: the idle time starts again
    started = time.monotonic()
    retry_until(lambda: keeper._started[-1].poll() is not None, 20)
    assert time.monotonic() - started >= 1.0  # not before its idle time
    assert keeper._started[-1].returncode == 0
    assert not path.exists()
    assert keeper.reach(host).state is KeeperState.ABSENT


@pytest.mark.parametrize("wrong", ["dir-mode", "dir-owner", "socket-mode", "socket-owner"])
def test_a_keeper_of_another_user_or_mode_is_refused_and_the_call_goes_direct(
    pve_hosts: PveHosts, runtime: Path, wrong: str
) -> None:
    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    path = keeper.socket_path(host)
    nobody = 65534
    if wrong == "dir-mode":
        os.chmod(path.parent, 0o755)
    elif wrong == "dir-owner":
        os.chown(path.parent, nobody, -1)
    elif wrong == "socket-mode":
        os.chmod(path, 0o666)
    else:
        os.chown(path, nobody, -1)
    r = keeper.reach(host)
    assert r.state is KeeperState.REFUSED, r
    assert ("0700" if wrong == "dir-mode" else "0600" if wrong == "socket-mode" else "uid 65534") in r.why
    transport = connect(host).transport
    assert not isinstance(transport, KeptTransport)
    assert transport.run(["true"], timeout=20).ok  # direct, and working
    transport.close()
    assert keeper._started[1:] == []  # nothing started in place of a refused one
    # refused files are left as found: the keeper's socket was not replaced or removed
    assert path.exists()


def test_a_caller_served_by_another_uid_is_refused(
    pve_hosts: PveHosts, runtime: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SO_PEERCRED: a socket that passes the file checks but answers from another user's process is not used."""
    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    kept = KeptTransport(host, keeper.socket_path(host))
    with monkeypatch.context() as m:
        m.setattr(os, "getuid", lambda: 65534)  # this process plays another user: the keeper's uid is not its own
        assert kept._open() is None
    assert kept.state is KeeperState.REFUSED
    assert kept.run(["true"], timeout=20).ok  # over a direct connection
    kept.close()


def test_a_dead_keeper_is_a_state_the_call_connects_directly_and_a_new_keeper_starts(
    pve_hosts: PveHosts, runtime: Path
) -> None:
    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    kept = connect(host).transport
    assert isinstance(kept, KeptTransport)
    pid = keeper.keeper_pid(host)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    retry_until(lambda: keeper._started[0].poll() is not None, 10)
    assert keeper.socket_path(host).exists()  # killed: it could not remove its socket
    # a transport that held it: the next command goes direct, nothing raised
    res = kept.run(CONNECTION_PID, timeout=20)
    assert res.ok and kept.state is KeeperState.DOWN
    kept.close()
    # a new call: down, direct, and a fresh keeper that replaces the dead one's socket
    assert keeper.reach(host).state is KeeperState.DOWN
    fresh = connect(host).transport
    assert not isinstance(fresh, KeptTransport) and fresh.run(["true"], timeout=20).ok
    fresh.close()
    ready(host)
    assert keeper.keeper_pid(host) not in (None, pid)


def test_known_hosts_stays_the_authority_a_changed_file_is_checked_again(pve_hosts: PveHosts, runtime: Path) -> None:
    """The keeper connected under a known key; known_hosts then loses it: the next command is refused as a direct
    call would be (unreachable, host-key), and the keeper goes."""
    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    assert KeptTransport(host, keeper.socket_path(host)).run(["true"], timeout=20).ok
    Path(pve_hosts.sshd.known_hosts).write_text("")
    with pytest.raises(errors.HostKeyRejected) as e:
        KeptTransport(host, keeper.socket_path(host)).run(["true"], timeout=20)
    assert e.value.cause == "host-key" and e.value.fingerprint
    retry_until(lambda: keeper._started[0].poll() is not None, 10)
    assert keeper.reach(host).state is KeeperState.ABSENT


def test_status_json_through_a_keeper_never_imports_paramiko(pve_hosts: PveHosts, runtime: Path) -> None:
    import subprocess
    import sys

    fake_release(pve_hosts.workdir)
    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    program = (
        "import sys, json, ops.cli\n"
        "try:\n ops.cli.main(['--hosts', sys.argv[1], 'status', '--json'])\n"
        "except SystemExit: pass\n"
        "print(json.dumps(sorted(m for m in ('paramiko', 'cryptography') if m in sys.modules)))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", program, str(pve_hosts.path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=pve_hosts.env(),
    )
    lines = p.stdout.strip().splitlines()
    assert json.loads(lines[0])["state"] == "not-started", p.stderr[-2000:]
    assert json.loads(lines[-1]) == [], p.stderr[-2000:]


def test_a_keeper_of_another_hosts_entry_is_refused_before_anything_runs(pve_hosts: PveHosts, runtime: Path) -> None:
    """The socket's name is a checksum; the keeper compares each request's whole entry with its own."""
    import dataclasses

    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    other = dataclasses.replace(host, hang_after=1.0)
    kept = KeptTransport(other, keeper.socket_path(host))
    res = kept.run(["sh", "-c", "echo ran"], timeout=20)
    assert res.ok and res.out == "ran\n" and kept.state is KeeperState.REFUSED  # run once, directly
    kept.close()
    log = keeper.socket_path(host).with_suffix(".log").read_text()
    assert "served:" not in log


def test_a_host_that_is_down_is_unreachable_and_gets_no_keeper_at_every_call(
    pve_hosts: PveHosts, runtime: Path
) -> None:
    pve_hosts.write(port=1)  # nothing listens on port 1 of 127.0.0.1
    host = kept_host(pve_hosts)
    with pytest.raises(errors.ConnectionRefused):
        connect(host)  # direct: the state the CLI reports, as without a keeper
    assert len(keeper._started) == 1
    retry_until(lambda: keeper._started[0].poll() is not None, 30)
    assert keeper._started[0].returncode == 1
    assert "cannot connect" in keeper.socket_path(host).with_suffix(".log").read_text()
    with pytest.raises(errors.ConnectionRefused):
        connect(host)
    assert len(keeper._started) == 1  # the failed keeper's mark holds the next one back for a while
    assert keeper.reach(host).state is KeeperState.ABSENT


def test_the_click_free_status_gets_its_whole_answer_from_the_keeper(pve_hosts: PveHosts, runtime: Path) -> None:
    """session.quick_status (the console entry's hook): with a ready keeper the status is computed in the keeper's
    warm process, so the call imports neither paramiko nor classify's modules, and prints what the CLI prints."""
    import subprocess
    import sys

    fake_release(pve_hosts.workdir)
    host = kept_host(pve_hosts)
    keeper.start(host)
    ready(host)
    program = (
        "import json, sys\nfrom ops.session import quick_status\ncode = quick_status(sys.argv[1:])\n"
        "print(json.dumps([code, sorted(m for m in ('paramiko', 'ops.probe', 'click') if m in sys.modules)]))\n"
    )
    runs = []
    for form in (["status", "--json"], ["status"]):
        p = subprocess.run(
            [sys.executable, "-c", program, "--hosts", str(pve_hosts.path), *form],
            capture_output=True,
            text=True,
            timeout=120,
            env=pve_hosts.env(),
        )
        runs.append(p.stdout.strip().splitlines())
        assert json.loads(runs[-1][-1]) == [7, []], p.stderr[-2000:]
    log = keeper.socket_path(host).with_suffix(".log").read_text()
    assert log.count("served: status") == 2
    cli = pve_hosts.cli("status", "--json")
    same = ("host", "session", "state", "cause", "mode", "tmux", "container", "evidence")
    assert {k: json.loads(runs[0][0])[k] for k in same} == {k: cli.json()[k] for k in same}
    assert runs[1][:-1] == pve_hosts.cli("status").stdout.strip().splitlines()


def test_tail_runs_its_agent_call_on_the_keepers_connection(pve_hosts: PveHosts, runtime: Path) -> None:
    """The CLI's other commands use the keeper's connection too (App.remote -> ops.remote.connect)."""
    fake_release(pve_hosts.workdir)
    host = kept_host(pve_hosts)
    first = pve_hosts.cli("tail", "-n", "5")  # direct; starts the keeper
    ready(host)
    log = keeper.socket_path(host).with_suffix(".log")
    served = log.read_text().count("served:")
    second = pve_hosts.cli("tail", "-n", "5")
    assert log.read_text().count("served:") == served + 1
    assert (second.exit_code, second.stdout, second.stderr) == (first.exit_code, first.stdout, first.stderr)
    assert first.exit_code == 1 and "nothing to show: no log under" in first.stderr, first.output  # the agent answered
