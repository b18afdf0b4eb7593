"""A run is every process its command starts. The REAL dflashctl against the real sshd
+ a fake Proxmox container (a real pid+mount namespace), with commands shaped as users write them: a
script that runs the trainer as its child, a pipeline into `tee`, a child that calls `setsid`, one that
double-forks away. `stop`, a crash of the script while its trainer lives, a keeper killed with it, and
restart-on-crash after both: no process of the run is left in the container, checked by pid and start
time (the pids come from pid files and from /proc inside the container, never from a process name).
"""

from __future__ import annotations

import json
import shlex
import sys
import typing as t
from pathlib import Path

import pytest

from testkit import CliResult, PveHosts, retry_until
from testkit.runkit import FAKE_TRAIN, fake_release

VMID = 200

# /proc inside the container as {pid: {ppid, start, state}}: run there with `pct exec`.
TABLE = r"""
import json, os
out = {}
for name in os.listdir("/proc"):
    if not name.isdigit():
        continue
    try:
        raw = open("/proc/%s/stat" % name, "rb").read().decode("ascii", "replace")
    except OSError:
        continue
    rest = raw[raw.rfind(")") + 2:].split()
    out[name] = {"state": rest[0], "ppid": int(rest[1]), "start": int(rest[19])}
print(json.dumps(out))
"""

Proc = tuple[int, int]  # (pid, start ticks): a process, never a reused pid


class Run:
    """The pve host of the harness with a fake-trainer command, seen from inside its container."""

    def __init__(self, hosts: PveHosts) -> None:
        self.hosts = hosts
        self.pve = hosts.pve
        self.shared = hosts.workdir.parent  # the same path for the host and the container
        self.finish = self.shared / "finish"
        self.shared.mkdir(parents=True, exist_ok=True)

    def trainer(self, name: str, *extra: str) -> str:
        """A shell word list: the fake trainer stepping until the test's finish file, its pid in ``<name>.pid``."""
        pidfile = self.shared / f"{name}.pid"
        args = ["python", FAKE_TRAIN, "--steps", "1", "--interval", "0.1", "--until", str(self.finish), *extra]
        return f"sh -c {shlex.quote(f'echo $$ > {pidfile}; exec {shlex.join(args)}')}"

    def script(self, body: str) -> Path:
        """A start script as the README has it (`command = "/root/start_training.sh"`)."""
        path = self.shared / "start_training.sh"
        path.write_text(f"#!/bin/sh\necho starting\n{body}\necho the trainer ended: $?\n")
        path.chmod(0o755)
        return path

    def configure(self, command: list[str], **table: t.Any) -> None:
        self.hosts.write(command=command, **table)
        fake_release(self.hosts.workdir)

    def cli(self, *args: str, timeout: float = 90) -> CliResult:
        return self.hosts.cli(*args, timeout=timeout)

    def status(self) -> tuple[int, dict[str, t.Any]]:
        r = self.cli("status", "--json")
        assert r.stdout.strip(), r.stderr
        return r.exit_code, json.loads(r.stdout)

    def attempt(self, n: int) -> Path:
        return self.hosts.run_dir / "dflash" / f"attempt-{n}"

    def record(self, n: int, name: str = "run.json") -> dict[str, t.Any]:
        path = self.attempt(n) / name
        return retry_until(lambda: path.exists() and json.loads(path.read_text()), 30)

    def steps(self, n: int) -> int:
        log = self.attempt(n) / "train.log"
        return log.read_text(errors="replace").count("\nstep ") if log.exists() else 0

    def table(self) -> dict[int, dict[str, t.Any]]:
        r = self.pve.run_in(VMID, [sys.executable, "-c", TABLE])
        assert r.returncode == 0, r.stderr
        return {int(k): v for k, v in json.loads(r.stdout).items()}

    def proc(self, pid: int) -> Proc:
        return pid, self.table()[pid]["start"]

    def pidfile(self, name: str) -> Proc:
        path = self.shared / f"{name}.pid"
        pid = retry_until(lambda: path.exists() and path.read_text().strip() and int(path.read_text()), 30)
        return self.proc(pid)

    def tree(self, pid: int) -> set[Proc]:
        """``pid`` and its descendants, as they are now."""
        table = self.table()
        out, todo = set(), [pid]
        while todo:
            p = todo.pop()
            if p in table and table[p]["state"] not in "ZX":
                out.add((p, table[p]["start"]))
                todo += [c for c, v in table.items() if v["ppid"] == p]
        return out

    def alive(self, procs: t.Iterable[Proc]) -> set[Proc]:
        table = self.table()
        return {(p, s) for p, s in procs if p in table and table[p]["start"] == s and table[p]["state"] not in "ZX"}

    def forge(self, tag: str, run_dir: Path) -> Proc:
        """A process the run never started, in a session of its own, carrying ``tag`` and ``run_dir`` as
        a run's processes do (its SIGINT left at the default: a signal meant for the run would end it)."""
        code = (
            f"import os, subprocess; env = dict(os.environ, DFLASH_RUN_TAG={tag!r}, DFLASH_RUN_DIR={str(run_dir)!r}); "
            "p = subprocess.Popen(['sleep', '3000'], env=env, start_new_session=True, stdin=subprocess.DEVNULL, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)"
        )
        r = self.pve.run_in(VMID, [sys.executable, "-c", code])
        assert r.returncode == 0, r.stderr
        return self.proc(int(r.stdout))

    def kill(self, sig: str, *pids: int) -> None:
        r = self.pve.run_in(VMID, ["kill", f"-{sig}", *map(str, pids)])
        assert r.returncode == 0, r.stderr


@pytest.fixture
def box(pve_hosts: PveHosts) -> t.Iterator[Run]:
    b = Run(pve_hosts)
    yield b
    b.finish.touch()  # let a trainer that is still stepping end by itself


def started(box: Run, n: int = 1) -> dict[str, t.Any]:
    r = box.cli("start", *(["--replace"] if n > 1 else []))
    assert r.exit_code == 0, r.output
    run = box.record(n)
    retry_until(lambda: box.steps(n) >= 2, 30)
    return run


# ---------------------------------------------------------------------------------------------
# stop: every member, whatever the command's shape


def test_stop_ends_a_script_and_the_trainer_it_runs(box: Run) -> None:
    box.configure([str(box.script(box.trainer("trainer")))])
    run = started(box)
    trainer = box.pidfile("trainer")
    members = box.tree(run["child_pid"])
    assert trainer in members and len(members) >= 2, "the script and its trainer (its child)"
    r = box.cli("stop", "--grace", "10")
    assert r.exit_code == 0, r.output
    assert box.alive(members) == set(), "nothing of the run outlives its stop"
    assert r.stdout.startswith("stopped attempt 1 by interrupt"), r.stdout
    code, st = box.status()
    assert (code, st["state"]) == (8, "stopped"), st
    assert "Traceback" in (box.attempt(1) / "train.log").read_text(), "the trainer got the interrupt itself"


def test_stop_ends_every_process_of_a_pipeline(box: Run) -> None:
    tee_log = box.shared / "tee.log"
    box.configure(["sh", "-c", f"{box.trainer('trainer')} | tee {shlex.quote(str(tee_log))}"])
    run = started(box)
    members = box.tree(run["child_pid"])
    assert box.pidfile("trainer") in members and len(members) >= 3, "sh, the trainer and tee"
    r = box.cli("stop", "--grace", "10")
    assert r.exit_code == 0, r.output
    assert box.alive(members) == set()
    assert "step 1 |" in tee_log.read_text()
    assert not (box.attempt(1) / ".exit.reserved").exists() and box.record(1, "exit.json")


def test_stop_ends_a_setsid_child_and_a_double_forked_one(box: Run) -> None:
    # `setsid` puts A in a session of its own under the live script; B is forked by a subshell that
    # exits at once, so B's parent dies before the stop: it is re-parented, away from the script's tree.
    a, b = box.trainer("a"), box.trainer("b")
    box.configure(["sh", "-c", f"setsid {a} & ({b} &); wait"])
    run = started(box)
    procs = {box.pidfile("a"), box.pidfile("b")}
    table = box.table()
    assert table[box.pidfile("b")[0]]["ppid"] != run["child_pid"], "B left the script's tree"
    r = box.cli("stop", "--grace", "3")
    assert r.exit_code == 0, r.output
    assert box.alive(procs | {(run["child_pid"], run["child_start"])}) == set()
    exit_rec = box.record(1, "exit.json")
    assert exit_rec.get("killed") == [], "the interrupt ended them: nobody had to be killed"


def test_stop_kills_what_ignores_interrupt_and_term_and_names_it(box: Run) -> None:
    stubborn = box.trainer("stubborn", "--ignore-signals")
    box.configure([str(box.script(stubborn))])
    run = started(box)
    pid, start = box.pidfile("stubborn")
    r = box.cli("stop", "--grace", "0.5")
    assert r.exit_code == 0, r.output
    assert box.alive({(pid, start), (run["child_pid"], run["child_start"])}) == set()
    exit_rec = box.record(1, "exit.json")
    assert [(k["pid"], k["start"]) for k in exit_rec["killed"]] == [(pid, start)], exit_rec
    assert f"killed pid {pid}" in r.stdout, r.stdout


# ---------------------------------------------------------------------------------------------
# the command ends (or its keeper dies) while its trainer lives


def test_a_script_that_dies_takes_its_trainer_and_restart_starts_exactly_one(box: Run) -> None:
    box.configure([str(box.script(box.trainer("trainer")))])
    run = started(box)
    first = box.pidfile("trainer")
    (box.shared / "trainer.pid").unlink()
    box.kill("KILL", run["child_pid"])  # the script dies; its trainer did nothing wrong
    exit_rec = box.record(1, "exit.json")
    assert (exit_rec["exit_code"], exit_rec["signal"]) == (None, 9)
    assert [(m["pid"], m["start"]) for m in exit_rec["left"]] == [first], "the trainer was left running"
    assert box.alive({first}) == set(), "exit.json comes once every member is gone"
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (5, "crashed", "signal"), st
    assert any("left 1 process running" in e for e in st["evidence"]), st["evidence"]

    sup = box.cli("restart-on-crash", "--once", "--backoff", "0", "--state-dir", str(box.hosts.root / "state"))
    assert sup.exit_code == 0, sup.output
    second = box.pidfile("trainer")
    assert second != first and box.alive({first, second}) == {second}, "one trainer, the new attempt's"
    assert box.record(2)["attempt"] == 2


def test_a_keeper_killed_with_its_script_leaves_orphans_start_refuses_restart_stops_them(box: Run) -> None:
    box.configure([str(box.script(box.trainer("trainer")))])
    run = started(box)
    first = box.pidfile("trainer")
    (box.shared / "trainer.pid").unlink()
    box.kill("KILL", run["keeper_pid"])  # the keeper first: nothing is left to end the run or record it
    box.kill("KILL", run["child_pid"])
    code, st = retry_until(lambda: (x := box.status())[1]["cause"] == "orphans-left" and x, 30)
    assert (code, st["state"]) == (5, "crashed"), st
    assert [m["pid"] for m in st["members"]] == [first[0]] and st["pid"] == first[0], st
    assert f"pid {first[0]}" in st["detail"], st["detail"]
    assert not (box.attempt(1) / "exit.json").exists()

    r = box.cli("start")
    assert r.exit_code == 1 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert f"pid {first[0]}" in r.stderr and "--replace" in r.stderr, r.stderr
    assert box.alive({first}) == {first}, "a refused start changes nothing"

    sup = box.cli("restart-on-crash", "--once", "--backoff", "0", "--state-dir", str(box.hosts.root / "state"))
    assert sup.exit_code == 0, sup.output
    assert "stop-then-restart" in sup.stdout or "stop and restart" in sup.stdout, sup.stdout
    second = box.pidfile("trainer")
    assert box.alive({first, second}) == {second}, "the leftover was stopped before the new attempt started"
    assert box.status()[1]["attempt"] == 2


# ---------------------------------------------------------------------------------------------
# who is the run's: the recorded tags (their nonce too), or the keeper's tree


def test_a_process_that_forges_the_runs_tag_is_not_the_runs(box: Run) -> None:
    box.configure([str(box.script(box.trainer("trainer")))])
    run = started(box)
    assert run["tag"].startswith("dflash/1/") and run["tag"] != "dflash/1/000000000000"
    forged = box.forge("dflash/1/000000000000", box.attempt(1))  # the right names, a nonce nobody recorded
    try:
        code, st = box.status()
        assert (code, st["state"]) == (0, "running"), st
        assert forged[0] not in [m["pid"] for m in st["members"]], st["members"]
        r = box.cli("stop", "--grace", "10")
        assert r.exit_code == 0 and r.stdout.startswith("stopped attempt 1 by interrupt"), r.output
        code, st = box.status()
        assert (code, st["state"]) == (8, "stopped"), st
        assert box.alive({forged}) == {forged}, "a stop ends the run's processes, never a stranger's"
        r = box.cli("start")
        assert r.exit_code == 0, r.output
        assert box.record(2)["attempt"] == 2
        r = box.cli("stop", "--grace", "10")
        assert r.exit_code == 0, r.output
        assert box.alive({forged}) == {forged}, "nor does a second stop"
    finally:
        box.kill("KILL", forged[0])


def test_a_stop_ends_leftovers_that_outlive_their_exit_record(box: Run) -> None:
    stubborn = box.trainer("stubborn", "--ignore-signals")
    box.configure([str(box.script(stubborn))])
    run = started(box)
    left = box.pidfile("stubborn")
    box.kill("KILL", run["keeper_pid"], run["child_pid"])  # nobody is left to end it
    exit_json = box.attempt(1) / "exit.json"
    # an exit record written beside a live process of the run (a keeper killed right after writing it)
    exit_json.write_text(json.dumps({"exit_code": 0, "signal": None, "ended_at": "2026-01-01T00:00:00Z"}))
    code, st = box.status()
    assert left[0] in [m["pid"] for m in st["members"]], st
    r = box.cli("stop", "--grace", "0.5")
    assert r.exit_code == 0, r.output
    assert box.alive({left}) == set(), "interrupt, TERM, then KILL: until the run's processes are gone"
    assert f"killed pid {left[0]}" in r.stdout, r.stdout
