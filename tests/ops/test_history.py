"""`dflashctl history`: every attempt of a session in one table, read in ONE agent call
over the real sshd + `pct exec` into the fake Proxmox container, with the real tmux and the fake trainer
(which resumes from its checkpoint and prints the training core's resume line).

The night this project was born from: a CUDA OOM, then the tmux server gone with the run, each restarted
by restart-on-crash; a container restart; and a group of two containers, a row per node.
"""

from __future__ import annotations

import json
import re
import shlex
import typing as t
from pathlib import Path

import pytest

from ops.far.history import resumed_from
from testkit import PveHosts, retry_until
from testkit.faultrig import FAST, VMID, K, Rig


@pytest.fixture
def rig(pve_hosts: PveHosts, tmp_path: Path) -> t.Iterator[Rig]:
    r = Rig(pve_hosts, tmp_path)
    yield r
    r.close()


def history(rig: Rig, *args: str) -> dict[str, t.Any]:
    r = rig.cli("history", "--json", "--state-dir", str(rig.state_dir), *args)
    assert r.exit_code == 0, r.output
    return t.cast(dict[str, t.Any], json.loads(r.stdout))


def resumed_step(rig: Rig, n: int) -> int:
    m = re.search(r"INFO dflash\.train: resuming from \S+ at step (\d+)", rig.log(n))
    assert m, rig.log(n)[:500]
    return int(m.group(1))


def test_the_trainers_resume_line_is_found_in_the_logs_head(tmp_path: Path) -> None:
    log = tmp_path / "train.log"
    log.write_text(
        "loading the target\rloading 100%\n"
        "[default0]:2026-11-29T21:02:40 INFO dflash.train: resuming from /ws/runs/dflash/checkpoints/step-1200 "
        "at step 1200 (run 20261129-ab12)\nstep 1201 | loss 2.3\n"
    )
    assert resumed_from(str(log)) == {
        "path": "/ws/runs/dflash/checkpoints/step-1200",
        "step": 1200,
        "run": "20261129-ab12",
    }
    log.write_text("step 1 | loss 3.0\n")
    assert resumed_from(str(log)) is None and resumed_from(str(tmp_path / "none.log")) is None
    log.write_text("x" * 100 + "\nresuming from /c/step-5 at step 5 (run r)\n")
    assert resumed_from(str(log), head=50) is None, "only the log's head is read"


def test_history_after_a_night_oom_then_the_tmux_server_gone_then_a_restart(rig: Rig) -> None:
    rig.configure()
    rig.start()  # attempt 1, by hand
    sup = rig.supervise(*FAST, "--retry-oom")
    retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
    rig.fault("once:oom")  # CUDA out of memory on GPU 5
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)
    retry_until(lambda: len(rig.steps(2)) >= K + 2, 30)
    # then the tmux server goes, and the run with it (server first: the runner ignores its hang-up)
    run2 = rig.run_json(2)
    server = rig.inside("tmux", "-L", rig.socket, "display-message", "-p", "#{pid}").stdout.decode().strip()
    pids = [server, *(str(run2[k]) for k in ("keeper_pid", "child_pid", "pid"))]
    assert rig.inside("kill", "-KILL", *pids).returncode == 0
    sup.event(r"lost: the run died with its tmux server \(no exit record, attempt 2\)")
    sup.event(r"restarted: attempt 3 started")
    rig.assert_resumed(2, 3)
    assert sup.stop() == 0
    steps1, steps2 = rig.steps(1), rig.steps(2)

    doc = history(rig)
    assert (doc["name"], doc["session"], doc["hosts"], doc["total"]) == ("pve", "dflash", ["pve"], {"pve": 3})
    a1, a2, a3 = doc["attempts"]
    assert [a["attempt"] for a in (a1, a2, a3)] == [1, 2, 3]
    assert (a1["state"], a1["cause"], a1["gpu"], a1["exit_code"], a1["signal"]) == ("crashed", "cuda-oom", 5, 1, None)
    assert a1["step"] == steps1[-1] and a1["resumed_from"] is None
    assert a1["started_by"]["by"] == "operator" and a1["started_by"]["why"] == "dflashctl start"
    assert a1["ended_at"] >= a1["started_at"] and a1["duration_s"] > 0
    # attempt 2: no exit record; what the supervisor saw (the next attempt's started_by.after) names the cause
    assert (a2["state"], a2["cause"], a2["cause_from"], a2["exit_code"]) == (
        "lost",
        "tmux-server-killed",
        "supervisor",
        None,
    )
    assert a2["ended_at"] is None and a2["last_seen_at"] >= a2["started_at"]
    # the step is the last metrics record's; the SIGKILL may land between a step line and its record
    assert a2["step"] in (steps2[-1], steps2[-1] - 1), (a2["step"], steps2[-3:])
    assert a2["resumed_from"]["step"] == resumed_step(rig, 2) == steps2[0] - 1
    by2 = a2["started_by"]
    assert (by2["by"], by2["action"], by2["pid"]) == ("supervisor", "restart", sup.proc.pid)
    assert by2["after"] == {
        **by2["after"],
        "attempt": 1,
        "state": "crashed",
        "cause": "cuda-oom",
        "exit_code": 1,
    }
    assert by2["why"].startswith("crashed: CUDA out of memory on GPU 5 (exit 1") and "restart in" in by2["why"]
    assert (a3["state"], a3["exit_code"], a3["ended_at"]) == ("running", None, None)
    assert a3["resumed_from"]["step"] == resumed_step(rig, 3)
    assert a3["started_by"]["after"]["state"] == "lost" and a3["started_by"]["after"]["cause"] == "tmux-server-killed"
    # the supervisor's incidents, each under the attempt that was the newest when it happened
    inc1, inc2 = a1["incidents"], a2["incidents"]
    assert [(i["state"], i["cause"], i["action"], i["outcome"], i["next_attempt"]) for i in inc1] == [
        ("crashed", "cuda-oom", "restart", "done", 2)
    ]
    assert [(i["state"], i["cause"], i["action"], i["outcome"], i["next_attempt"]) for i in inc2] == [
        ("lost", "tmux-server-killed", "restart", "done", 3)
    ]
    assert a3["incidents"] == [] and doc["before"] == []

    text = rig.cli("history", "--state-dir", str(rig.state_dir))
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[0] == f"history of pve/dflash: 3 attempt(s); supervisor incidents from {rig.state_dir / 'incidents'}"
    head = lines[1].split()
    assert head[:3] == ["attempt", "started", "ended"] and lines[1].rstrip().endswith("resumed from  started by")
    row1 = next(x for x in lines if x.startswith("1 "))
    assert "crashed (cuda-oom, GPU 5)" in row1 and "exit 1" in row1 and f" {steps1[-1]} " in row1
    assert re.search(r"operator \S+@\S+$", row1)
    row2 = next(x for x in lines if x.startswith("2 "))
    assert "lost (tmux-server-killed)" in row2 and f"step {resumed_step(rig, 2)}" in row2
    assert row2.endswith("restart after crashed cuda-oom")
    assert any(
        re.fullmatch(
            r"    \d\d:\d\d:\d\d  supervisor saw crashed \(cuda-oom\) of attempt 1 -> restart: done, attempt 2 started",
            x,
        )
        for x in lines
    )
    row3 = next(x for x in lines if x.startswith("3 "))
    assert " running " in row3 and row3.endswith("restart after lost tmux-server-killed")

    last = history(rig, "-n", "1")
    assert [a["attempt"] for a in last["attempts"]] == [3] and last["total"] == {"pve": 3}
    assert [i["next_attempt"] for i in last["before"]] == [2, 3], "older incidents come before the first row shown"


def test_history_after_the_container_restarted_reads_the_persistent_run_dir(rig: Rig) -> None:
    rig.configure()
    rig.start()
    retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
    rig.pve.reboot(VMID)  # /tmp (the tmux socket) is wiped; the run dir is on the container's disk
    doc = history(rig)
    [a1] = doc["attempts"]
    assert (a1["state"], a1["cause"], a1["cause_from"]) == ("lost", "container-restart", "records")
    assert a1["step"] == rig.steps(1)[-1] and a1["started_by"]["by"] == "operator"
    r = rig.cli("start")
    assert r.exit_code == 0, r.output
    retry_until(lambda: len(rig.steps(2)) >= 2, 30)
    a1, a2 = history(rig)["attempts"]
    assert a1["cause"] == "container-restart" and a2["state"] == "running"
    # ONE remote command for the whole history (-vv logs every command the transport runs)
    r = rig.cli("-vv", "history", "--json", "--state-dir", str(rig.state_dir))
    assert r.exit_code == 0, r.output
    ran = [x for x in r.stderr.splitlines() if re.search(r"\bssh pve: ", x)]
    assert len(ran) == 1 and "pct exec 200" in ran[0] and " history --json" in ran[0], r.stderr
    assert a2["resumed_from"]["step"] == resumed_step(rig, 2) and resumed_step(rig, 2) % K == 0


def test_history_of_a_group_has_a_row_per_node(pve_hosts: PveHosts, tmux_servers: t.Any, tmp_path: Path) -> None:
    """Two containers (ct 200, 201) behind the test sshd: node pve2's command is killed, restart-on-crash
    --group restarts both; history --group shows attempt 1 and 2 of each node and the group's incident."""
    from testkit.hostsfile import dump_hosts
    from testkit.runkit import fake_release, reap_runs, train_command

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
    state = str(tmp_path / "state")
    try:
        assert pve_hosts.cli("--group", "two", "start", timeout=90).exit_code == 0
        run2 = Path(str(second["run_dir"])) / "dflash" / "attempt-1"
        child = retry_until(lambda: (run2 / "run.json").exists() and json.loads((run2 / "run.json").read_text()), 30)
        assert pve_hosts.pve.run_in(201, ["kill", "-KILL", str(child["child_pid"])]).returncode == 0
        retry_until(lambda: (run2 / "exit.json").exists(), 30)
        sup = pve_hosts.cli(
            "--group", "two", "restart-on-crash", "--once", "--backoff", "0", "--state-dir", state, timeout=120
        )
        assert sup.exit_code == 0, sup.output
        r = pve_hosts.cli("--group", "two", "history", "--json", "--state-dir", state)
        assert r.exit_code == 0, r.output
        doc = r.json()
        assert (doc["name"], doc["hosts"], doc["total"]) == ("group two", ["pve", "pve2"], {"pve": 2, "pve2": 2})
        rows = [(a["attempt"], a["host"], a["state"], a["cause"]) for a in doc["attempts"]]
        assert rows == [
            (1, "pve", "stopped", None),  # the survivor, stopped by the supervisor before the group's restart
            (1, "pve2", "crashed", "signal"),
            (2, "pve", "running", None),
            (2, "pve2", "running", None),
        ]
        a = doc["attempts"]
        assert a[1]["signal"] == 9 and all(x["started_by"]["by"] == "operator" for x in a[:2])
        assert all(x["started_by"]["by"] == "supervisor" for x in a[2:])
        assert a[2]["started_by"]["after"]["state"] == "crashed" and "pve2: crashed" in a[2]["started_by"]["why"]
        assert a[0]["incidents"] == []
        [inc] = a[1]["incidents"]  # the group's incident, under the last row of attempt 1
        assert (inc["host"], inc["state"], inc["action"], inc["next_attempt"]) == ("group two", "crashed", "restart", 2)
        lines = pve_hosts.cli("--group", "two", "history", "--state-dir", state).stdout.splitlines()
        assert lines[0].startswith("history of group two/dflash: 4 attempt(s)")
        assert lines[1].split()[:3] == ["attempt", "node", "started"]
        assert [x.split()[:2] for x in lines if re.match(r"\d ", x)] == [
            ["1", "pve"],
            ["1", "pve2"],
            ["2", "pve"],
            ["2", "pve2"],
        ]
    finally:
        until.touch()
        for table in (pve_hosts.pve_table, second):
            reap_runs(Path(str(table["run_dir"])))


def test_one_bad_record_costs_its_row_not_the_table(rig: Rig) -> None:
    """Records a crash, an older version or a person left: a mistyped time, NaN, a 100,000-deep run.json,
    a 5,000-digit step, terminal control sequences and a huge value in started_by, a 100,000-deep incident."""
    import shutil

    rig.configure()
    rig.start()
    r = rig.cli("stop", "--grace", "10")
    assert r.exit_code == 0, r.output
    good = rig.run_json(1)

    def attempt(n: int, run: str | None = None, metrics: str | None = None) -> Path:
        d = rig.attempt(n)
        shutil.copytree(rig.attempt(1), d)
        if run is not None:
            (d / "run.json").write_text(run)
        if metrics is not None:
            with open(d / "metrics.jsonl", "a") as f:
                f.write(metrics + "\n")
        return d

    attempt(2, run=json.dumps({**good, "started_at": "2026-13-45T99:99:99Z", "started_ts": "yesterday"}))
    attempt(3, run=json.dumps({**good, "started_ts": 1.0}).replace('"started_ts": 1.0', '"started_ts": NaN'))
    attempt(4, run=json.dumps({**good, "x": 0}).replace('"x": 0', '"x": ' + "[" * 100_000 + "]" * 100_000))
    attempt(5, metrics='{"step": ' + "9" * 5000 + ', "loss": 1.0}')
    by = {"by": "operator", "user": "\x1b]0;pwned\x07\x1b]52;c;Zm9v\x07", "machine": "m" * 100_000, "why": "x"}
    attempt(6, run=json.dumps({**good, "started_by": by, "hostname": "\x1b[2J" + "h" * 100_000}))
    attempt(7, run=json.dumps({**good, "started_by": {"by": "operator", "why": "w" * (2 << 20)}}))
    incidents = rig.state_dir / "incidents"
    incidents.mkdir(parents=True)
    (incidents / "deep.json").write_text("[" * 100_000 + "]" * 100_000)

    r = rig.cli("history", "--state-dir", str(rig.state_dir))
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output[-3000:]
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout, "control characters are escaped"
    assert max(map(len, r.stdout.splitlines())) < 2000, "no value is printed whole"
    rows = {int(m.group(1)): m.group(0) for m in re.finditer(r"^(\d+)\s.*$", r.stdout, re.M)}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6, 7], r.stdout
    assert "attempt-7/run.json: larger than 1024 KiB" in r.stdout, "a 2 MiB record is neither sent nor printed"
    assert "attempt-2/run.json: started_at: expected a time as 2026-11-29T15:02:11Z" in r.stdout, r.stdout
    assert "attempt-2/run.json: started_ts: expected a number" in r.stdout, r.stdout
    assert rows[2].split()[1] == "?", "a mistyped time is no time"
    assert "attempt-3/run.json: NaN is not a number" in r.stdout, r.stdout
    assert "attempt-4/run.json: nested too deeply" in r.stdout, r.stdout
    assert "attempt-6/run.json: started_by: larger than 2048 bytes" in r.stdout, r.stdout
    assert rows[3].split()[1] == "?" and rows[4].split()[1] == "?", "an unreadable run.json: its row says ?"
    doc = history(rig)
    steps = {a["attempt"]: a["step"] for a in doc["attempts"]}
    assert steps[5] == steps[1] and steps[1] is not None, "the 5,000-digit record is skipped, the last good one read"
    six = next(a for a in doc["attempts"] if a["attempt"] == 6)
    assert six["started_by"] is None and any("started_by" in e for e in six["errors"]), six
