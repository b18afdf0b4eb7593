"""Host groups: parsing of [groups.*], the per-node torchrun command, the fan-out and the verdict."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import typing as t
from pathlib import Path

import pytest

from ops.errors import ConfigError
from ops.group import Verdict, fan_out, parse_groups, verdict
from ops.hosts import Host
from testkit import forkserver, retry_until


def host(name: str, **kw: t.Any) -> Host:
    base: dict[str, t.Any] = dict(
        name=name,
        transport="ssh",
        workdir="/w",
        run_dir="/w/runs",
        address="10.0.0.1",
        command=("python3", "-m", "dflash", "train", "--config", "configs/big.toml"),
    )
    base.update(kw)
    return Host(**base)


HOSTS = {"pve1": host("pve1", address="10.0.0.1"), "pve2": host("pve2", address="10.0.0.2")}


def test_default_command_is_torchrun_around_each_hosts_own_command() -> None:
    g = parse_groups({"big": {"hosts": ["pve1", "pve2"]}}, HOSTS)["big"]
    assert g.rdzv == "10.0.0.1:29400", "the first host's address, torchrun's c10d port"
    assert g.node_command(HOSTS["pve2"]) == (
        "python3",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
        "--rdzv-id",
        "big",
        "--rdzv-conf",
        "is_host=false",
        "--max-restarts",
        "0",
        "-m",
        "dflash",
        "train",
        "--config",
        "configs/big.toml",
    )
    assert g.node_command(HOSTS["pve1"])[13:15] == ("--rdzv-conf", "is_host=true"), "pve1 alone serves the store"
    # a fresh worker store every rendezvous round (torchrun's shared one keeps the last round's addresses),
    # the host's own env kept
    envd = host("e", env={"HF_HOME": "/data/hf", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert g.node_env(envd) == {"HF_HOME": "/data/hf", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # two nodes on one loopback (the fake containers, or one machine): still exactly one serves it
    same = {"a": host("a", address="127.0.0.1"), "b": host("b", address="127.0.0.1")}
    pair = parse_groups({"p": {"hosts": ["a", "b"]}}, same)["p"]
    assert [pair.node_command(h)[14] for h in same.values()] == ["is_host=true", "is_host=false"]
    # ... and each node has its own address: torchrun names a node (address, pid), its address defaulting to
    # the machine's FQDN, and two containers' agents with the same pid were ONE node: the rendezvous hung
    assert [pair.node_command(h)[15:17] for h in same.values()] == [
        ("--local-addr", "127.0.0.1"),
        ("--local-addr", "127.0.0.2"),
    ]
    assert "--local-addr" not in g.node_command(HOSTS["pve1"]), "off loopback: torchrun's own guess ..."
    named = parse_groups({"big": {"hosts": ["pve1", "pve2"], "local_addrs": {"pve2": "10.0.1.2"}}}, HOSTS)["big"]
    assert "--local-addr" not in named.node_command(HOSTS["pve1"])
    assert named.node_command(HOSTS["pve2"])[15:17] == ("--local-addr", "10.0.1.2"), "... or the one given"
    away = parse_groups({"x": {"hosts": ["pve1"], "rdzv": "elsewhere:29400"}}, HOSTS)["x"]
    assert "--rdzv-conf" not in away.node_command(HOSTS["pve1"]), "an endpoint no host has: torchrun decides"
    own = parse_groups({"g": {"hosts": ["pve1"], "command": "run-it --now", "rdzv": "head:1234"}}, HOSTS)["g"]
    assert own.node_command(HOSTS["pve1"]) == ("run-it", "--now") and own.rdzv == "head:1234"


@pytest.mark.parametrize(
    ("table", "where", "words"),
    [
        ({"big": {"hosts": []}}, "groups.big.hosts", "at least one"),
        ({"big": {"hosts": ["pve1", "pve3"]}}, "groups.big.hosts[1]", 'no such host: "pve3"'),
        ({"big": {"hosts": ["pve1", "pve1"]}}, "groups.big.hosts[1]", "listed twice"),
        ({"big": {"hosts": ["pve1"], "rdzv": "nohost"}}, "groups.big.rdzv", '"HOST:PORT"'),
        ({"big": {"hosts": ["pve1"], "rdzv": "h:99999"}}, "groups.big.rdzv", '"HOST:PORT"'),
        ({"big": {"hosts": ["pve1"], "nproc_per_node": 0}}, "groups.big.nproc_per_node", ""),
        ({"big": {"hosts": ["pve1"], "colour": "red"}}, "groups.big", "colour"),
        ({"pve1": {"hosts": ["pve1"]}}, "groups.pve1", "also a host"),
        ({"big": {"hosts": ["pve1"], "local_addrs": "10.0.1.1"}}, "groups.big.local_addrs", "expected a table"),
        (
            {"big": {"hosts": ["pve1"], "local_addrs": {"pve2": "10.0.1.2"}}},
            "groups.big.local_addrs.pve2",
            "not a host",
        ),
        (
            {"big": {"hosts": ["pve1", "pve2"], "local_addrs": {"pve1": "10.0.1.1", "pve2": "10.0.1.1"}}},
            "groups.big.local_addrs",
            "same address",
        ),
    ],
)
def test_bad_groups_name_their_key_path(table: dict[str, t.Any], where: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_groups(table, HOSTS)
    assert str(e.value).startswith(where) and words in str(e.value)


def test_a_host_command_torchrun_cannot_wrap_is_refused_at_load_time() -> None:
    hosts = {**HOSTS, "odd": host("odd", command=("bash", "train.sh"))}
    with pytest.raises(ConfigError) as e:
        parse_groups({"big": {"hosts": ["pve1", "odd"]}}, hosts)
    assert str(e.value).startswith("groups.big.command") and "-m <module>" in str(e.value)


def test_fan_out_runs_hosts_at_once_keeps_their_order_and_reports_errors_per_host() -> None:
    hosts = [host(f"h{i}") for i in range(6)]
    inside = threading.Barrier(6, timeout=30)  # all six must be inside fn at the same time, or it breaks

    def fn(h: Host) -> str:
        inside.wait()
        if h.name == "h3":
            raise RuntimeError("down")
        time.sleep(0.01 * (6 - int(h.name[1])))  # finish in reverse order
        return h.name.upper()

    out = fan_out(hosts, fn)
    assert [o.host for o in out] == [h.name for h in hosts]
    assert [o.value for o in out] == ["H0", "H1", "H2", None, "H4", "H5"]
    assert isinstance(out[3].error, RuntimeError) and all(o.error is None for o in out if o.host != "h3")


@dataclasses.dataclass
class Node:
    host: str
    state: str
    head: str = ""

    def headline(self) -> str:
        return self.head or self.state


def test_the_verdict_is_running_only_when_every_node_runs_else_the_worst_naming_the_node() -> None:
    assert verdict([Node("a", "running"), Node("b", "running")]) == Verdict("running", None, None)
    v = verdict(
        [Node("a", "running"), Node("b", "crashed", "crashed: CUDA out of memory on GPU 3 (exit 1)"), Node("c", "lost")]
    )
    assert v.line() == "crashed: b: CUDA out of memory on GPU 3 (exit 1)"
    assert (
        verdict([Node("a", "running"), Node("b", "container-down", "container-down: container 201 is stopped")]).line()
        == "container-down: b: container 201 is stopped"
    )
    assert verdict([Node("a", "succeeded"), Node("b", "running")]).state == "running"
    assert (
        verdict([Node("a", "unreachable", "unreachable (refused): connection refused"), Node("b", "stalled")]).line()
        == "unreachable: a: (refused): connection refused"
    )


@dataclasses.dataclass
class CausedNode(Node):
    cause: str | None = None


def test_the_verdict_names_the_node_that_took_the_others_down_not_one_that_lost_its_peers() -> None:
    v = verdict(
        [
            CausedNode("pve1", "crashed", "crashed: lost the other nodes of the run", "peer-lost"),
            CausedNode("pve2", "crashed", "crashed: CUDA out of memory on GPU 3 (exit 1)", "cuda-oom"),
        ]
    )
    assert v.node == "pve2" and "CUDA out of memory" in (v.why or "")


# What node 1 of a two-node torchrun run logged when node 2's training process was SIGKILLed (helper run,
# 2026-11-30): dflash's PeerLost line, twice, then torchrun's own traceback last.
PEER_LOST_TAIL = """\
step 8 | loss 6.486 | acc 0.01 | tau_tf 1.0 | 1.1 Ktok/s | queue 8/8 | drafters 1/1 | busy T 71 | D 80
Traceback (most recent call last):
  File "/w/dflash/distributed.py", line 120, in exchange
dflash.train.distributed.PeerLost: node 0 of 2 lost the node group at step 8 (the barrier; [distributed] timeout 20s): [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53385: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application.
[rank0]: dflash.train.distributed.PeerLost: node 0 of 2 lost the node group at step 8 (the barrier; [distributed] timeout 20s): [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:53385: Connection reset by peer.
Traceback (most recent call last):
  File "/w/.venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
dflash.train FAILED
""".splitlines()


def test_a_node_that_lost_its_peers_is_crashed_peer_lost_not_torchruns_exception() -> None:
    from ops.diagnosis import diagnose

    d = diagnose(PEER_LOST_TAIL, exit_code=1, signal=None)
    assert d.cause == "peer-lost" and d.detail is not None
    assert d.detail.startswith("node 0 of 2 lost the node group at step 8") and "Connection reset by peer" in d.detail
    hung = ["[E] gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 20000ms for send operation to complete"]
    assert diagnose(hung, exit_code=1, signal=None).cause == "peer-lost"


# --------------------------------------------------------------------------------------------
# The real CLI on two local hosts (own workdirs and tmux sockets): start, status, stop, restart as a group


@dataclasses.dataclass
class Pair:
    root: Path
    command: str
    until: Path

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real dflashctl, a fork of this worker's dflashctl fork server (no interpreter start each)."""
        env = {k: v for k, v in os.environ.items() if k != "DFLASHCTL_HOSTS"}
        hosts = str(self.root / "hosts.toml")
        return forkserver.shared("dflashctl").run(["--hosts", hosts, *args], timeout=120, env=env, cwd=self.root)

    def run_json(self, name: str) -> dict[str, t.Any]:
        return t.cast(
            dict[str, t.Any], json.loads((self.root / name / "runs" / "dflash" / "current" / "run.json").read_text())
        )


@pytest.fixture
def pair(tmp_path: Path, tmux_servers: t.Any) -> t.Iterator[Pair]:
    from testkit.runkit import fake_release, reap_runs, train_command

    until = tmp_path / "until"
    command = shlex.join(train_command("--steps", "1", "--interval", "0.2", "--until", str(until)))
    table = 'default = "a"\n'
    for name in ("a", "b"):
        fake_release(tmp_path / name)
        table += (
            f'[hosts.{name}]\ntransport = "local"\nworkdir = "{tmp_path / name}"\nrun_dir = "{tmp_path / name}/runs"\n'
            f'python = "{sys.executable}"\ncommand = "python -m dflash train"\ntmux_socket = "{tmux_servers.new()}"\n'
        )
    table += f'[groups.pair]\nhosts = ["a", "b"]\ncommand = {json.dumps(command)}\n'
    (tmp_path / "hosts.toml").write_text(table)
    try:
        yield Pair(tmp_path, command, until)
    finally:
        until.touch()
        for name in ("a", "b"):
            reap_runs(tmp_path / name / "runs")


def test_a_group_starts_reports_and_stops_as_one_run_and_names_the_node_that_is_off(pair: Pair) -> None:
    started = pair.cli("--group", "pair", "start")
    assert started.returncode == 0, started.stderr
    lines = started.stdout.splitlines()
    assert any(x.startswith("a: started attempt 1:") for x in lines) and any(
        x.startswith("b: started attempt 1:") for x in lines
    )
    assert lines[-1] == "group pair: done on 2 hosts"
    for name in ("a", "b"):  # each node runs the GROUP's command, not its own
        assert pair.run_json(name)["command"] == shlex.split(pair.command)
    st = pair.cli("--group", "pair", "status")
    assert st.returncode == 0 and st.stdout.splitlines()[-1] == "group pair: running", st.stdout
    assert pair.cli("--host", "b", "stop", "--grace", "5").returncode == 0
    st = pair.cli("--group", "pair", "status", "--json")
    doc = json.loads(st.stdout)
    assert st.returncode == 8 and (doc["state"], doc["node"]) == ("stopped", "b"), st.stdout
    assert [h["host"] for h in doc["hosts"]] == ["a", "b"] and doc["hosts"][0]["state"] == "running"
    every = pair.cli("status", "--all")
    assert every.returncode == 8 and every.stdout.splitlines()[-1].startswith(
        "all: stopped: b: stopped by dflashctl stop"
    )
    assert pair.cli("--group", "pair", "--host", "a", "status").returncode == 2
    refused = pair.cli("--group", "pair", "plot")
    assert (
        refused.returncode == 1
        and refused.stderr.strip() == "dflashctl: --group: this command acts on one host: use --host"
    )
    stopped = pair.cli("--group", "pair", "stop", "--grace", "5")
    assert (
        stopped.returncode == 0 and "b: nothing stopped" in stopped.stdout and "a: stopped attempt 1" in stopped.stdout
    )


def test_restart_on_crash_restarts_the_whole_group_when_one_node_crashes(pair: Pair) -> None:
    state = str(pair.root / "state")
    refused = pair.cli(
        "--group", "pair", "restart-on-crash", "--once", "--on-gpu-fault", "exclude", "--state-dir", state
    )
    assert (
        refused.returncode == 1 and "--on-gpu-fault: exclude is for one host's run, not a --group's" in refused.stderr
    )
    assert pair.cli("--group", "pair", "start").returncode == 0
    b_run = pair.root / "b" / "runs" / "dflash" / "current"
    os.kill(pair.run_json("b")["child_pid"], signal.SIGKILL)  # node b's training process dies
    retry_until(lambda: (b_run / "exit.json").exists(), 30)
    st = pair.cli("--group", "pair", "status")
    assert st.returncode == 5 and st.stdout.splitlines()[-1].startswith("group pair: crashed: b: killed by signal 9"), (
        st.stdout
    )
    sup = pair.cli(
        "--group", "pair", "restart-on-crash", "--once", "--backoff", "0", "--state-dir", str(pair.root / "state")
    )
    assert sup.returncode == 0, sup.stdout + sup.stderr
    assert "a: stopped the survivor" in sup.stdout, sup.stdout
    for name in ("a", "b"):
        assert pair.run_json(name)["attempt"] == 2, f"{name} restarted with the group"
    a_first = json.loads((pair.root / "a" / "runs" / "dflash" / "attempt-1" / "exit.json").read_text())
    assert a_first["exit_code"] != 0 or a_first["signal"], "the survivor was stopped, not left running"
    incidents = list((pair.root / "state").rglob("*.json"))
    assert any("group-pair" in str(p) for p in incidents), incidents
    assert pair.cli("--group", "pair", "status").returncode == 0


def test_a_group_of_two_containers_over_ssh_names_the_one_that_went_down(pve_hosts: t.Any, tmux_servers: t.Any) -> None:
    """Two fake Proxmox containers (ct 200, 201) behind the test sshd: the group runs on both; stopping
    container 201 makes the group `container-down`, naming it (exit 9)."""
    from testkit.hostsfile import dump_hosts
    from testkit.runkit import fake_release, train_command

    pve_hosts.pve.create(201, start=True)
    until = pve_hosts.root / "until"
    second = dict(
        pve_hosts.pve_table,
        container=201,
        tmux_socket=tmux_servers.new(),
        workdir=str(pve_hosts.pve.fs / "ct201" / "dflash"),
        run_dir=str(pve_hosts.pve.fs / "ct201" / "runs"),
    )
    command = shlex.join(train_command("--steps", "1", "--interval", "0.2", "--until", str(until)))
    text = dump_hosts("pve", {"pve": pve_hosts.pve_table, "pve2": second})
    pve_hosts.path.write_text(text + f'[groups.two]\nhosts = ["pve", "pve2"]\ncommand = {json.dumps(command)}\n')
    for table in (pve_hosts.pve_table, second):
        fake_release(Path(str(table["workdir"])))
    try:
        r = pve_hosts.cli("--group", "two", "start", timeout=90)
        assert r.exit_code == 0, r.output
        r = retry_until(lambda: (x := pve_hosts.cli("--group", "two", "status")).exit_code == 0 and x, 30)
        assert r.stdout.splitlines()[-1] == "group two: running"
        pve_hosts.pve.stop(201)
        r = pve_hosts.cli("--group", "two", "status", "--json")
        doc = json.loads(r.stdout)
        assert r.exit_code == 9 and (doc["state"], doc["node"]) == ("container-down", "pve2"), r.output
        assert doc["why"] == "container 201 is stopped" and doc["hosts"][0]["state"] == "running"
    finally:
        until.touch()  # the runs end with their containers (the fake Proxmox host kills them at teardown)
