"""Transports against real processes: LocalTransport, and SSHTransport against a real sshd."""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ops import errors
from ops.hosts import parse_inventory
from ops.transport import LocalTransport, SSHTransport, resolve_target
from ops.transport.ssh import _unreachable
from testkit import PveHosts, Sshd, pid_alive, retry_until
from testkit.hostsfile import ssh_host as make_host
from testkit.runkit import RELAY

ECHO_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"


@pytest.fixture
def ssh(sshd: Sshd) -> t.Iterator[SSHTransport]:
    tr = SSHTransport.connect(make_host(sshd))
    try:
        yield tr
    finally:
        tr.close()


def accepted_logins(sshd: Sshd) -> int:
    return sshd.log.read_text().count("Accepted publickey")


# --- LocalTransport -----------------------------------------------------------------------------


def test_local_run_returns_exit_code_and_streams() -> None:
    r = LocalTransport().run(["sh", "-c", "cat; echo err >&2; exit 3"], stdin=b"\x00\xffbin")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"\x00\xffbin", b"err\n", False)


def test_local_timeout_kills_the_process_group() -> None:
    r = LocalTransport().run(["sh", "-c", "echo $$; sleep 60 & wait"], timeout=0.5)
    assert r.timed_out
    with pytest.raises(errors.CommandTimeout, match=r"no answer within 0.5s"):
        r.check()
    pid = int(r.out.split()[0])
    retry_until(lambda: not pid_alive(pid), 10)


def test_local_reports_signal_and_missing_program() -> None:
    r = LocalTransport().run(["sh", "-c", "kill -TERM $$"])
    assert (r.exit_code, r.signal) == (None, 15)
    missing = LocalTransport().run(["/no/such/program"])
    assert missing.exit_code == 127 and b"No such file" in missing.stderr


# --- SSH: commands ------------------------------------------------------------------------------


def test_ssh_exit_code_stdout_stderr_come_back_intact(ssh: SSHTransport) -> None:
    r = ssh.run(["sh", "-c", "printf 'out\\000\\377'; echo err >&2; exit 7"])
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.signal) == (7, b"out\x00\xff", b"err\n", False, None)
    assert ssh.run(["true"]).ok  # the same connection serves the next command


def test_ssh_streams_20mb_of_binary_stdin(ssh: SSHTransport) -> None:
    payload = os.urandom(20 * 1024 * 1024)
    r = ssh.run(["sha256sum"], stdin=payload, timeout=120)
    assert r.ok, r.err
    assert r.out.split()[0] == hashlib.sha256(payload).hexdigest()
    # A file object and an iterator of chunks stream the same way.
    assert ssh.run(["wc", "-c"], stdin=io.BytesIO(payload[:100_000])).out.strip() == "100000"
    assert ssh.run(["cat"], stdin=iter([b"a", b"", b"b"])).stdout == b"ab"


def test_ssh_output_larger_than_the_window_while_stdin_streams(ssh: SSHTransport) -> None:
    # The command writes before it reads: both directions must keep moving.
    payload = os.urandom(4 * 1024 * 1024)
    r = ssh.run(["sh", "-c", "head -c 3000000 /dev/zero; cat"], stdin=payload, timeout=120)
    assert r.ok and len(r.stdout) == 3_000_000 + len(payload) and r.stdout[3_000_000:] == payload


def test_ssh_timeout_kills_the_remote_process(ssh: SSHTransport) -> None:
    r = ssh.run(["sh", "-c", "echo $$; exec sleep 60"], timeout=1)
    assert r.timed_out and r.exit_code == 124
    pid = int(r.out.split()[0])  # sshd runs on this machine: the remote pid is a local pid
    retry_until(lambda: not pid_alive(pid), 10)


def test_ssh_timeout_escalates_to_kill(ssh: SSHTransport) -> None:
    r = ssh.run(["sh", "-c", "trap '' TERM; echo $$; while :; do sleep 0.1; done"], timeout=1)
    # After TERM is ignored, `timeout -k` KILLs the command's process group (itself included).
    assert r.timed_out and (r.exit_code, r.signal) in ((137, None), (None, 9))
    retry_until(lambda: not pid_alive(int(r.out.split()[0])), 10)


def test_ssh_reports_a_signalled_remote_process(ssh: SSHTransport) -> None:
    r = ssh.run(["sh", "-c", "kill -TERM $$"])
    assert (r.exit_code, r.signal, r.timed_out) == (None, 15, False)
    r = ssh.run(["sh", "-c", "kill -KILL $$"])
    assert (r.exit_code, r.signal) == (None, 9)


NASTY = [
    "a b",
    "it's",
    'say "hi"',
    "x;rm -rf /tmp/nope",
    "$(touch /tmp/pwned)",
    "`id`",
    "line1\nline2",
    "*",
    "-n",
    "",
    "ünïcødé ☃",
    "\t\\",
]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    argv=st.lists(
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
        min_size=1,
        max_size=5,
    )
)
@example(argv=NASTY)
def test_user_values_reach_the_remote_argv_literally(ssh: SSHTransport, argv: list[str]) -> None:
    r = ssh.run([sys.executable, "-c", ECHO_ARGV, *argv])
    assert r.ok, r.err
    assert json.loads(r.out) == argv


def test_close_is_clean_and_idempotent(ssh: SSHTransport) -> None:
    assert ssh.alive
    ssh.close()
    ssh.close()
    assert not ssh.alive
    with pytest.raises(errors.ConnectionLost):
        ssh.run(["true"])


# --- SSH: connection failures, each with its own typed error ------------------------------------


def test_closed_port_is_refused(sshd: Sshd) -> None:
    sshd.stop()
    with pytest.raises(errors.ConnectionRefused) as info:
        SSHTransport.connect(make_host(sshd))
    assert info.value.cause == "refused"
    assert f"127.0.0.1:{sshd.port}" in str(info.value) and str(info.value).startswith("pve: ")


def test_silent_port_times_out(sshd: Sshd) -> None:
    with socket.socket() as silent:  # accepts TCP (backlog), never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(5)
        port = silent.getsockname()[1]
        with pytest.raises(errors.ConnectTimeout) as info:
            SSHTransport.connect(make_host(sshd, port=port, connect_timeout=1))
    assert info.value.cause == "timeout" and f"127.0.0.1:{port}" in str(info.value)


def test_name_resolution_error_is_typed() -> None:
    target = resolve_target(
        parse_inventory('[hosts.h]\naddress = "nowhere.invalid"\ncommand = "x"\n', path=None, base=Path("/")).get()
    )
    err = _unreachable(target, socket.gaierror(-2, "Name or service not known"))
    assert isinstance(err, errors.NameResolutionError) and err.cause == "dns"
    assert "nowhere.invalid" in str(err)


def test_wrong_client_key_is_an_auth_error(sshd: Sshd, tmp_path: Path) -> None:
    from testkit.sshd import keygen

    keygen(tmp_path / "other", "other")
    with pytest.raises(errors.AuthenticationFailed) as info:
        SSHTransport.connect(make_host(sshd, identity_file=str(tmp_path / "other")))
    assert info.value.cause == "auth" and f"root@127.0.0.1:{sshd.port}" in str(info.value)


def _fingerprint_of(pub: str, tmp_path: Path) -> str:
    f = tmp_path / "key.pub"
    f.write_text(pub + "\n")
    return subprocess.run(["ssh-keygen", "-lf", str(f)], capture_output=True, text=True, check=True).stdout.split()[1]


def test_unknown_host_key_is_rejected_and_nothing_runs(sshd: Sshd, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    before = accepted_logins(sshd)
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(make_host(sshd, known_hosts=str(empty)))
    e = info.value
    assert e.cause == "host-key" and not e.changed
    assert e.fingerprint == _fingerprint_of(sshd.host_key_pub, tmp_path)  # same as `ssh-keygen -l`
    assert e.fingerprint in str(e) and "trust-host" in str(e)
    assert accepted_logins(sshd) == before  # we never logged in


def test_changed_host_key_is_rejected_with_both_fingerprints(sshd: Sshd, tmp_path: Path) -> None:
    old = _fingerprint_of(sshd.host_key_pub, tmp_path)
    sshd.rotate_host_key()
    new = _fingerprint_of(sshd.host_key_pub, tmp_path)
    before = accepted_logins(sshd)
    with pytest.raises(errors.HostKeyRejected) as info:
        SSHTransport.connect(make_host(sshd))
    e = info.value
    assert e.changed and (e.fingerprint, e.expected) == (new, old)
    assert "HOST KEY CHANGED" in str(e) and old in str(e) and new in str(e)
    assert accepted_logins(sshd) == before


def test_key_in_user_known_hosts_is_accepted(sshd: Sshd, ssh_home: Path) -> None:
    (ssh_home / ".ssh" / "known_hosts").write_text(sshd.known_hosts_line + "\n")
    with SSHTransport.connect(make_host(sshd, known_hosts=None)) as tr:
        assert tr.run(["true"]).ok


# --- ~/.ssh/config ------------------------------------------------------------------------------


def test_ssh_config_supplies_hostname_port_user_and_key(sshd: Sshd, ssh_home: Path) -> None:
    (ssh_home / ".ssh" / "config").write_text(
        f"Host gpubox\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.client_key}\n"
    )
    host = make_host(sshd, address="gpubox", port=None, user=None, identity_file=None)
    with SSHTransport.connect(host) as tr:
        assert tr.target.hostname == "127.0.0.1" and tr.target.port == sshd.port
        assert tr.run(["id", "-u"]).out.strip() == "0"
    # hosts.toml wins where it says something: a wrong port there beats the right one in the config.
    with pytest.raises(errors.ConnectionRefused):
        SSHTransport.connect(make_host(sshd, address="gpubox", port=1, user=None, identity_file=None))


def test_proxy_jump_one_hop_through_the_same_sshd(sshd: Sshd, ssh_home: Path) -> None:
    (ssh_home / ".ssh" / "config").write_text(
        f"Host inner\n  HostName 127.0.0.1\n  Port {sshd.port}\n  ProxyJump root@127.0.0.1:{sshd.port}\n"
    )
    before = accepted_logins(sshd)
    with SSHTransport.connect(make_host(sshd, address="inner", port=None)) as tr:
        assert tr.target.proxy_jump is not None and tr.target.proxy_jump.port == sshd.port
        assert tr.run(["echo", "via jump"]).out == "via jump\n"
    assert accepted_logins(sshd) == before + 2  # the jump host and the target: two logins


def test_proxy_jump_with_more_than_one_hop_is_a_config_error(sshd: Sshd, ssh_home: Path) -> None:
    (ssh_home / ".ssh" / "config").write_text("Host inner\n  ProxyJump a,b\n")
    with pytest.raises(errors.ConfigError, match="only one hop"):
        SSHTransport.connect(make_host(sshd, address="inner"))


def test_proxy_command(sshd: Sshd, ssh_home: Path, tmp_path: Path) -> None:
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    marker = tmp_path / "relay-used"
    (ssh_home / ".ssh" / "config").write_text(
        f"Host viacmd\n  HostName 127.0.0.1\n  Port {sshd.port}\n"
        f"  ProxyCommand sh -c 'touch {marker}; exec {sys.executable} {relay} %h %p'\n"
    )
    with SSHTransport.connect(make_host(sshd, address="viacmd", port=None)) as tr:
        assert tr.run(["echo", "relayed"]).out == "relayed\n"
    assert marker.exists()


# --- trust-host (the real CLI) ------------------------------------------------------------------


def _kh_lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def test_trust_host_records_an_unknown_key_only_when_confirmed(pve_hosts: PveHosts, tmp_path: Path) -> None:
    kh = tmp_path / "pinned" / "known_hosts"
    pve_hosts.write(known_hosts=str(kh))
    fp = _fingerprint_of(pve_hosts.sshd.host_key_pub, tmp_path)

    refused = pve_hosts.cli("doctor")
    assert refused.exit_code == 10 and "host-key" in refused.stdout

    no_answer = pve_hosts.cli("trust-host")  # no terminal, no --yes: nothing is recorded
    assert no_answer.exit_code == 1 and fp in no_answer.stdout and "ssh-ed25519" in no_answer.stdout
    assert _kh_lines(kh) == []
    said_no = pve_hosts.cli("trust-host", input="n\n")
    assert said_no.exit_code == 1 and _kh_lines(kh) == []

    said_yes = pve_hosts.cli("trust-host", input="y\n")
    assert said_yes.exit_code == 0, said_yes.stderr
    assert _kh_lines(kh) == [pve_hosts.sshd.known_hosts_line]
    assert oct(kh.stat().st_mode & 0o777) == "0o600"

    again = pve_hosts.cli("trust-host", "--yes")
    assert again.exit_code == 0 and "already trusted" in again.stdout
    assert len(_kh_lines(kh)) == 1


def test_trust_host_writes_to_user_known_hosts_when_none_is_configured(pve_hosts: PveHosts) -> None:
    pve_hosts.write(known_hosts=None)
    r = pve_hosts.cli("trust-host", "--yes")
    assert r.exit_code == 0, r.stderr
    assert _kh_lines(pve_hosts.home / ".ssh" / "known_hosts") == [pve_hosts.sshd.known_hosts_line]


def test_trust_host_on_a_changed_key_needs_replace(pve_hosts: PveHosts, tmp_path: Path) -> None:
    sshd = pve_hosts.sshd
    old_line = sshd.known_hosts_line
    old_fp = _fingerprint_of(sshd.host_key_pub, tmp_path)
    sshd.rotate_host_key()
    new_fp = _fingerprint_of(sshd.host_key_pub, tmp_path)

    r = pve_hosts.cli("trust-host", "--yes")
    assert r.exit_code == 10
    assert old_fp in r.stderr and new_fp in r.output and "HOST KEY CHANGED" in r.stderr and "--replace" in r.stderr
    assert _kh_lines(sshd.known_hosts) == [old_line]

    r = pve_hosts.cli("trust-host", "--yes", "--replace")
    assert r.exit_code == 0, r.stderr
    assert _kh_lines(sshd.known_hosts) == [sshd.known_hosts_line]
    with SSHTransport.connect(pve_hosts.host()) as tr:  # the new key is trusted now
        assert tr.run(["true"]).ok


def test_cli_message_and_exit_code_for_a_closed_port(pve_hosts: PveHosts) -> None:
    pve_hosts.sshd.stop()
    r = pve_hosts.cli("trust-host")
    assert r.exit_code == 10
    assert r.stderr.startswith("dflashctl: pve: cannot connect to 127.0.0.1:")


def test_lean_paramiko_import_keeps_match_exec_working(tmp_path: Path) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text('Match exec "true"\n  User matched\n')
    code = f"""
import sys
from ops.transport import SSHTransport
assert "paramiko" in sys.modules
assert "invoke" not in sys.modules, "invoke imported at start-up"
import paramiko
print(paramiko.SSHConfig.from_path({str(cfg)!r}).lookup("anyhost").get("user"))
assert "invoke" in sys.modules
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "matched"


def test_the_transport_contract_and_local_need_no_paramiko() -> None:
    """The far side shares CommandResult: ops.transport, .base and .local load no third-party module."""
    code = """
import sys
from ops.transport import CommandResult, LocalTransport, Transport
import ops.transport.base, ops.transport.local
assert LocalTransport().run(["true"]).ok
print(sorted(m for m in ("paramiko", "invoke", "cryptography") if m in sys.modules))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_paramiko_is_imported_without_importlib_metadata_and_knows_its_version() -> None:
    """Every ssh status pays paramiko's import: its `importlib.metadata` (only for its own version, the SSH
    banner's) is left out, and the version is still the installed one."""
    import importlib.metadata

    code = (
        "import sys\nfrom ops.transport import SSHTransport\nfrom ops.transport._paramiko import paramiko\n"
        "print(paramiko.__version__, 'importlib.metadata' in sys.modules)"
    )
    p = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == [importlib.metadata.version("paramiko"), "False"], p.stdout


def test_the_tcp_socket_sends_at_once_and_acks_at_once_before_each_channel(
    ssh: SSHTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nagle's algorithm held paramiko's second small write for the server's delayed ACK (public-key auth
    51 ms), and our own delayed ACK held sshd's channel-open confirmation (49 ms a remote exec):
    bench/status_vs_raw.py measured both. The socket has TCP_NODELAY; quick-ACK mode is set on it before
    every channel opens."""
    from ops.transport import ssh as ssh_mod

    tr = ssh._transport()
    sock = tr.sock
    assert isinstance(sock, socket.socket)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    order: list[str] = []
    real_ack, real_open = ssh_mod._ack_at_once, type(tr).open_session

    def ack(s: t.Any) -> None:
        order.append("ack" if s is sock else f"ack on {s!r}")
        real_ack(s)

    def open_session(self: t.Any, *args: t.Any, **kwargs: t.Any) -> t.Any:
        order.append("open")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(ssh_mod, "_ack_at_once", ack)
    monkeypatch.setattr(type(tr), "open_session", open_session)
    for _ in range(2):
        assert ssh.run(["true"]).exit_code == 0
    assert order == ["ack", "open", "ack", "open"]
