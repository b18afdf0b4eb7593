"""ops.session pieces that need no container: attach, names, the agent argv, the lean paramiko import."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops import session
from ops.hosts import parse_inventory
from testkit import PveHosts, retry_until
from testkit.runkit import fake_release, reap_runs, train_command

INVENTORY = """
default = "here"
[hosts.pve]
address = "127.0.0.1"
port = 2222
user = "root"
identity_file = "/keys/id ed25519"
known_hosts = "/keys/known_hosts"
container = 200
pct = "sudo pct"
command = "true"
tmux_socket = "dflash"

[hosts.box]
address = "127.0.0.1"
command = "true"

[hosts.here]
transport = "local"
command = "true"
session = "train"
"""


def hosts() -> dict:
    inv = parse_inventory(INVENTORY, path=None, base=Path("/work"))
    return {name: inv.get(name) for name in ("pve", "box", "here")}


def test_attach_argv() -> None:
    from ops.attach import attach_argv

    h = hosts()
    assert attach_argv(h["pve"], "run2") == [
        "ssh",
        "-t",
        "-o",
        "StrictHostKeyChecking=yes",
        "-p",
        "2222",
        "-i",
        "/keys/id ed25519",
        "-o",
        "UserKnownHostsFile=/keys/known_hosts ~/.ssh/known_hosts",
        "--",
        "root@127.0.0.1",
        'exec "sudo" "pct" "exec" "200" "--" "tmux" "-L" "dflash" "attach-session" "-t" "=run2"',
    ]
    assert attach_argv(h["box"]) == [
        "ssh",
        "-t",
        "-o",
        "StrictHostKeyChecking=yes",
        "--",
        "127.0.0.1",
        'exec "tmux" "-L" "dflash" "attach-session" "-t" "=dflash"',
    ]
    assert attach_argv(h["here"]) == ["env", "-u", "TMUX", "tmux", "-L", "dflash", "attach-session", "-t", "=train"]


def test_agent_argv_keeps_user_values_out_of_the_code() -> None:
    argv = session.agent_argv("/w d/x'y", "/opt/py thon", "probe")
    assert argv == ["/opt/py thon", "-I", "-S", "-c", session.BOOT, "/w d/x'y/current", "probe", "--json"]
    assert "/w d" not in session.BOOT


def test_attach_exec_attaches_a_terminal(pve_hosts: PveHosts) -> None:
    """The local host: `attach --exec` replaces dflashctl with a tmux client on a real pty."""
    pve_hosts.local_table["command"] = train_command(
        "--steps", "1", "--interval", "0.2", "--until", str(pve_hosts.root / "finish")
    )
    pve_hosts.default = "local"
    pve_hosts.write()
    fake_release(Path(str(pve_hosts.local_table["workdir"])))
    assert pve_hosts.cli("start").exit_code == 0
    master, slave = pty.openpty()
    env = pve_hosts.env({"TERM": "xterm"})
    from testkit.hostsfile import dflashctl_argv

    proc = subprocess.Popen(
        [*dflashctl_argv(), "--hosts", str(pve_hosts.path), "attach", "--exec"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=pve_hosts.root,
        start_new_session=True,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 30
        while b"step " not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        assert b"step " in seen  # the pane's output reached our terminal
        sock = str(pve_hosts.local_table["tmux_socket"])
        clients = retry_until(
            lambda: subprocess.run(
                ["tmux", "-L", sock, "list-clients", "-F", "#{client_pid}"], capture_output=True, text=True
            ).stdout.split(),
            10,
        )
        assert str(proc.pid) in clients  # exec: the tmux client IS the dflashctl process
        subprocess.run(["tmux", "-L", sock, "detach-client", "-s", "=dflash"], capture_output=True, timeout=10)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
        reap_runs(Path(str(pve_hosts.local_table["run_dir"])))


@pytest.mark.parametrize("bad", ["a:b", "x.y", "../up", "", "=x"])
def test_session_names_are_checked(bad: str) -> None:
    with pytest.raises(Exception, match=r"^--session: use letters, digits, '-', '_' only"):
        session.session_name(hosts()["pve"], bad)


def test_operator_and_agent_speak_the_same_protocol() -> None:
    from ops.far import agent

    assert session.AGENT_PROTOCOL == agent.PROTOCOL


def test_an_agent_from_another_version_means_fallback(tmp_path: Path, tmux_socket: str) -> None:
    """A release whose agent answers another protocol: status still answers, from tmux, and says why."""
    from ops.remote import Remote
    from ops.transport import LocalTransport

    inv = parse_inventory(
        f'[hosts.x]\ntransport = "local"\ncommand = "true"\ntmux_socket = "{tmux_socket}"\n'
        f'workdir = "{tmp_path}/w"\nrun_dir = "{tmp_path}/r"\npython = "{sys.executable}"\n',
        path=None,
        base=tmp_path,
    )
    host = inv.get("x")
    rel = fake_release(Path(host.workdir))
    protocol_py = rel / "ops" / "far" / "protocol.py"  # the envelope's version, which the agent answers with
    protocol_py.write_text(protocol_py.read_text().replace("PROTOCOL = 1\n", "PROTOCOL = 99\n", 1))
    remote = Remote(host, LocalTransport())
    st = session.status(host, None, lambda: remote)
    assert (st.state, st.mode) == ("not-started", "fallback")
    assert "the deployed agent speaks protocol 99, this dflashctl 1: run `dflashctl deploy`" in st.evidence[0]


def test_two_entries_for_one_container_socket_and_session_name_the_other_run(pve_hosts: PveHosts) -> None:
    """Two host entries with one container, tmux socket and session but two run_dirs: the second one's
    status names the first one's run for what it is, and its start refuses naming it."""
    import json

    fake_release(pve_hosts.workdir)
    assert pve_hosts.cli("start").exit_code == 0
    theirs = pve_hosts.run_dir / "dflash" / "attempt-1"
    retry_until(lambda: (theirs / "run.json").exists(), 30)
    try:
        pve_hosts.local_table = {**pve_hosts.pve_table, "run_dir": str(pve_hosts.run_dir.parent / "runs-b")}
        pve_hosts.write()
        st = pve_hosts.cli("--host", "local", "status", "--json")
        doc = json.loads(st.stdout)
        assert doc["state"] == "running", doc
        assert f"the pane runs {theirs}: the run of another host entry" in doc["evidence"][0], doc["evidence"]
        r = pve_hosts.cli("--host", "local", "start")
        assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.output
        assert f"the run of {theirs}, another host entry's run_dir" in r.stderr, r.stderr
    finally:
        assert pve_hosts.cli("stop", "--grace", "5").exit_code == 0
