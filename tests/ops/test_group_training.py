"""The real thing on two boxes: `dflashctl --group` runs REAL multi-node training (torchrun, gloo) in two
fake Proxmox containers (ct 200, 201: own pid and mount namespaces, shared loopback) behind the test
sshd. A node's training process is SIGKILLed; the other ends with `peer-lost` within the distributed
timeout; the group's verdict names the node that died; `restart-on-crash --group --once` brings both
back, resuming from the checkpoint. Each start imports torch in two containers: about a minute in all.
"""

from __future__ import annotations

import json
import re
import typing as t
from pathlib import Path

import pytest

from testkit import free_port, retry_until
from testkit.hostsfile import dump_hosts

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 20  # [distributed] timeout: a lost peer ends the other within it

pytestmark = pytest.mark.timeout(900)


def test_a_group_trains_on_two_containers_survives_a_dead_node_and_resumes(
    pve_hosts: t.Any, tmux_servers: t.Any
) -> None:
    pve = pve_hosts.pve
    pve.create(201, start=True)
    command = ["python", "-m", "dflash", "train", "--config", "configs/tiny-random.toml"]
    for o in (
        'devices.targets=["cpu"]',
        'devices.drafters=["cpu"]',
        "max_steps=100000",
        "log_every=1",
        "average_every=2",
        "checkpoint.interval=4",
        f"distributed.timeout={TIMEOUT}",
    ):
        command += ["--set", o]
    # LOGLEVEL=INFO: torchrun's agent logs its rendezvous steps into train.log (a failure then shows where
    # a node waited: a CI run once ended with both nodes "running" and both logs empty)
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
    first = dict(pve_hosts.pve_table, command=command, env=env, hang_after=600, startup_grace=600)
    second = dict(
        first,
        container=201,
        tmux_socket=tmux_servers.new(),
        workdir=str(pve.fs / "ct201" / "dflash"),
        run_dir=str(pve.fs / "ct201" / "runs"),
    )
    text = dump_hosts("pve", {"pve": first, "pve2": second})
    # each node its own name for 127.0.0.1 (torchrun tells nodes apart by address and pid; both agents may
    # get the same pid in the two fresh containers): the default on one loopback would be 127.0.0.2
    group = f'[groups.two]\nhosts = ["pve", "pve2"]\nrdzv = "127.0.0.1:{free_port()}"\n'
    group += 'local_addrs = { pve = "127.0.0.1", pve2 = "localhost" }\n'
    pve_hosts.path.write_text(text + group)
    runs = {"pve": Path(str(first["run_dir"])) / "dflash", "pve2": Path(str(second["run_dir"])) / "dflash"}

    def ctl(*args: str) -> t.Any:
        return pve_hosts.cli(*args, timeout=180)

    def log(name: str, attempt: int) -> str:
        p = runs[name] / f"attempt-{attempt}" / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""

    r = ctl("--group", "two", "deploy", "--source", str(REPO))
    assert r.exit_code == 0, r.output
    r = ctl("--group", "two", "start")
    assert r.exit_code == 0, r.output
    run = json.loads((runs["pve"] / "attempt-1" / "run.json").read_text())
    assert run["command"][1:3] == ["-m", "torch.distributed.run"], "torchrun around the host's own command"
    assert run["command"][run["command"].index("--local-addr") + 1] == "127.0.0.1"

    def trained_past_a_checkpoint() -> bool:
        steps = [max(map(int, re.findall(r"^step (\d+) \|", log(n, 1), re.M)), default=0) for n in runs]
        return min(steps) >= 10 and any((r / "checkpoints").glob("step-*") for r in runs.values())

    try:
        retry_until(trained_past_a_checkpoint, 420, interval=1)
    except AssertionError:
        st = ctl("--group", "two", "status")
        raise AssertionError(st.output + "\n".join(f"--- {n}:\n{log(n, 1)[-3000:]}" for n in runs)) from None
    # node 2's training process (the torchrun agent's only child, inside ct 201) dies at once
    agent = json.loads((runs["pve2"] / "attempt-1" / "run.json").read_text())["child_pid"]
    kids = pve.run_in(201, ["sh", "-c", f"cat /proc/{agent}/task/*/children"]).stdout.split()
    assert kids, "the torchrun agent has its worker"
    assert pve.run_in(201, ["kill", "-KILL", kids[0].decode()]).returncode == 0
    retry_until(lambda: all((r / "attempt-1" / "exit.json").exists() for r in runs.values()), TIMEOUT + 90, interval=1)

    st = ctl("--group", "two", "status", "--json")
    doc = json.loads(st.stdout)
    assert st.exit_code == 5 and (doc["state"], doc["node"]) == ("crashed", "pve2"), st.output
    survivor = doc["hosts"][0]
    assert (survivor["state"], survivor["cause"]) == ("crashed", "peer-lost"), survivor
    assert "lost the node group" in survivor["detail"]

    sup = ctl(
        "--group", "two", "restart-on-crash", "--once", "--backoff", "0", "--state-dir", str(pve_hosts.root / "state")
    )
    assert sup.exit_code == 0, sup.output
    assert "pve: restarted: attempt 2" in sup.stdout and "pve2: restarted: attempt 2" in sup.stdout, sup.stdout

    def resumed() -> bool:
        return all(re.search(r"resuming from \S+/step-(\d+) at step \1", log(n, 2)) for n in runs)

    retry_until(resumed, 240, interval=1)
    st = retry_until(lambda: (x := ctl("--group", "two", "status")).exit_code == 0 and x, 120, interval=1)
    assert st.stdout.splitlines()[-1] == "group two: running"
    stop = ctl("--group", "two", "stop", "--grace", "20")
    assert stop.exit_code == 0, stop.output
