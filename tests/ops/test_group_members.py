"""A run is every process its command starts, for groups: real groups in two fake Proxmox containers (ct 200, 201) behind the test sshd:

- Ctrl-C during `dflashctl --group start` while one host is slow to start (a slow pct) says each
  host's outcome at once and stops what this call started; the slow host's start, when it finally
  reaches its container, is refused (it was cancelled): no node is left waiting alone;
- a real torchrun group: the torchrun agent of a node SIGKILLed with its keeper leaves no `dflash train`
  worker behind (PR_SET_PDEATHSIG), and `--group stop` leaves no process of either run in either
  container (checked by pid and start time, from /proc inside the containers).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from testkit import PveHosts, free_port, retry_until
from testkit.hostsfile import dflashctl_argv, dump_hosts
from testkit.runkit import FAKE_TRAIN, fake_release

REPO = Path(__file__).resolve().parents[2]

# /proc inside a container: {pid: [ppid, start, state]}
TABLE = r"""
import json, os
out = {}
for name in os.listdir("/proc"):
    if name.isdigit():
        try:
            raw = open("/proc/%s/stat" % name, "rb").read().decode("ascii", "replace")
        except OSError:
            continue
        rest = raw[raw.rfind(")") + 2:].split()
        out[name] = [int(rest[1]), int(rest[19]), rest[0]]
print(json.dumps(out))
"""


def table(pve: t.Any, vmid: int) -> dict[int, list[t.Any]]:
    r = pve.run_in(vmid, [sys.executable, "-c", TABLE])
    assert r.returncode == 0, r.stderr
    return {int(k): v for k, v in json.loads(r.stdout).items()}


def tree(pve: t.Any, vmid: int, pid: int) -> set[tuple[int, int]]:
    """``pid`` and its descendants, as (pid, start) pairs."""
    tab = table(pve, vmid)
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in tab and tab[p][2] not in "ZX":
            out.add((p, tab[p][1]))
            todo += [c for c, v in tab.items() if v[0] == p]
    return out


def alive(pve: t.Any, vmid: int, procs: t.Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    tab = table(pve, vmid)
    return {(p, s) for p, s in procs if p in tab and tab[p][1] == s and tab[p][2] not in "ZX"}


def two_hosts(pve_hosts: PveHosts, tmux_servers: t.Any, **both: t.Any) -> tuple[dict[str, t.Any], dict[str, t.Any]]:
    pve = pve_hosts.pve
    pve.create(201, start=True)
    first = dict(pve_hosts.pve_table, **both)
    second = dict(
        first,
        container=201,
        tmux_socket=tmux_servers.new(),
        workdir=str(pve.fs / "ct201" / "dflash"),
        run_dir=str(pve.fs / "ct201" / "runs"),
    )
    return first, second


# ---------------------------------------------------------------------------------------------
# Ctrl-C during a group start


def test_ctrl_c_during_a_group_start_says_each_outcome_and_stops_what_it_started(
    pve_hosts: PveHosts, tmux_servers: t.Any
) -> None:
    pve = pve_hosts.pve
    shared = pve.fs / "shared"
    shared.mkdir(parents=True)
    finish = shared / "finish"
    first, second = two_hosts(pve_hosts, tmux_servers)
    # pve2's pct holds the agent's start until the test opens the gate (and ignores the hang-up of the
    # call we cut): its start reaches the container only after the interrupted dflashctl has returned, so
    # that dflashctl returning at all shows it did not wait for the slowest host (no timing involved)
    slow, gate, done = shared / "slow-start", shared / "slow-start-gate", shared / "slow-start-done"
    slow_pct = shared / "slow-pct"
    slow_pct.write_text(
        "#!/bin/sh\n"
        'case "$*" in *" start --json"*)\n'
        f"  trap '' HUP PIPE; touch {slow}; i=0\n"
        f"  while [ ! -e {gate} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done\n"
        f'  {pve.pct} "$@" >/dev/null 2>&1; touch {done}; exit 0;;\n'
        "esac\n"
        f'exec {pve.pct} "$@"\n'
    )
    slow_pct.chmod(0o755)
    second["pct"] = str(slow_pct)
    text = dump_hosts("pve", {"pve": first, "pve2": second})
    command = ["python", FAKE_TRAIN, "--steps", "1", "--interval", "0.1", "--until", str(finish)]
    text += (
        f'[groups.two]\nhosts = ["pve", "pve2"]\nrdzv = "127.0.0.1:{free_port()}"\ncommand = {json.dumps(command)}\n'
    )
    pve_hosts.path.write_text(text)
    for table_ in (first, second):
        fake_release(Path(str(table_["workdir"])))
    runs = {n: Path(str(x["run_dir"])) / "dflash" for n, x in (("pve", first), ("pve2", second))}
    proc = None
    try:
        proc = subprocess.Popen(
            [*dflashctl_argv(), "--hosts", str(pve_hosts.path), "--group", "two", "start"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=pve_hosts.env(),
            cwd=pve_hosts.root,
        )
        retry_until(lambda: (runs["pve"] / "attempt-1" / "run.json").exists() and slow.exists(), 60)
        run = json.loads((runs["pve"] / "attempt-1" / "run.json").read_text())
        procs = tree(pve, 200, run["child_pid"])
        assert procs, "pve's run is up"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert not done.exists(), "it did not wait for the slowest host (its start is still held)"
        assert proc.returncode == 1, out + err
        assert "pve: started attempt 1; stopping it (this start was interrupted)" in out, out
        assert "pve2: interrupted while starting" in out, out
        assert re.search(r"^pve: stopped attempt 1 by \w+$", out, re.M), out
        assert "pve2: its start never ran (cancelled)" in out, out
        assert "nothing this start made is left running" in err, err
        assert "Aborted." not in err
        assert alive(pve, 200, procs) == set(), "what this call started on pve is stopped"
        st = pve_hosts.cli("--host", "pve", "status", "--json")
        assert json.loads(st.stdout)["state"] == "stopped", st.output

        gate.touch()
        retry_until(done.exists, 60)  # the slow start reached ct 201 at last: it is refused
        assert not (runs["pve2"] / "attempt-1").exists(), "the cancelled start made nothing"
        st = pve_hosts.cli("--host", "pve2", "status", "--json")
        assert json.loads(st.stdout)["state"] == "not-started", st.output
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()  # a dflashctl that waited for the held host (the old code): ours to end
            proc.communicate()
        gate.touch()
        finish.touch()


# ---------------------------------------------------------------------------------------------
# a real torchrun group


@pytest.mark.timeout(900)
def test_a_torchrun_worker_dies_with_its_agent_and_a_group_stop_leaves_no_process(
    pve_hosts: PveHosts, tmux_servers: t.Any
) -> None:
    pve = pve_hosts.pve
    command = ["python", "-m", "dflash", "train", "--config", "configs/tiny-random.toml"]
    for o in ('devices.targets=["cpu"]', 'devices.drafters=["cpu"]', "max_steps=100000", "log_every=1"):
        command += ["--set", o]
    command += ["--set", "average_every=2", "--set", "checkpoint.interval=1000", "--set", "distributed.timeout=20"]
    env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    first, second = two_hosts(pve_hosts, tmux_servers, command=command, env=env, hang_after=600, startup_grace=600)
    text = dump_hosts("pve", {"pve": first, "pve2": second})
    text += f'[groups.two]\nhosts = ["pve", "pve2"]\nrdzv = "127.0.0.1:{free_port()}"\n'
    text += 'local_addrs = { pve = "127.0.0.1", pve2 = "localhost" }\n'
    pve_hosts.path.write_text(text)
    runs = {"pve": Path(str(first["run_dir"])) / "dflash", "pve2": Path(str(second["run_dir"])) / "dflash"}

    def ctl(*args: str) -> t.Any:
        return pve_hosts.cli(*args, timeout=180)

    def log(name: str) -> str:
        p = runs[name] / "attempt-1" / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""

    r = ctl("--group", "two", "deploy", "--source", str(REPO))
    assert r.exit_code == 0, r.output
    r = ctl("--group", "two", "start")
    assert r.exit_code == 0, r.output
    try:
        retry_until(lambda: all(re.search(r"^step \d+ \|", log(n), re.M) for n in runs), 420, interval=1)
    except AssertionError:
        raise AssertionError("\n".join(f"--- {n}:\n{log(n)[-3000:]}" for n in runs)) from None
    runs_json = {n: json.loads((runs[n] / "attempt-1" / "run.json").read_text()) for n in runs}
    everything = {n: tree(pve, vmid, runs_json[n]["child_pid"]) for n, vmid in (("pve", 200), ("pve2", 201))}
    agent2 = runs_json["pve2"]["child_pid"]
    workers = {p for p in everything["pve2"] if p[0] != agent2}
    assert workers, "torchrun's worker, in a session of its own"
    # node 2's keeper first (so nothing but the kernel can end the worker), then its torchrun agent
    r = pve.run_in(201, ["kill", "-KILL", str(runs_json["pve2"]["keeper_pid"]), str(agent2)])
    assert r.returncode == 0, r.stderr
    retry_until(lambda: alive(pve, 201, workers) == set(), 30)

    stop = ctl("--group", "two", "stop", "--grace", "20")
    assert stop.exit_code == 0, stop.output
    retry_until(lambda: alive(pve, 200, everything["pve"]) == set(), 60)
    assert alive(pve, 201, everything["pve2"]) == set()
