"""Who watches a run: the heartbeat record and its lease (ops/far/watch.py), how
`status` shows it (ops/probe.py), and the policy of a supervisor that never ends (keep_watching)."""

from __future__ import annotations

import json
import os
import typing as t
from pathlib import Path

import pytest

from ops import errors
from ops.far import watch
from ops.probe import Status, classify
from ops.states import Cause, State
from ops.supervise.heartbeat import Heartbeat
from ops.supervise.policy import GIVE_UP, RESTART, WAIT, Options, Policy

NOW = 1_800_000_000.0


def beat(id: str = "a", **kw: t.Any) -> dict[str, t.Any]:
    return {"id": id, "by": "pve", "where": "pve1", "mode": "systemd", "pid": 812, "interval": 30.0, **kw}


def test_a_heartbeat_is_written_and_a_live_one_of_another_supervisor_refuses_the_next(tmp_path: Path) -> None:
    sdir = str(tmp_path / "runs" / "dflash")  # no run yet: the folder is made
    assert watch.beat(sdir, beat("a"), NOW) == {"written": True, "refused": False, "holder": None, "error": None}
    rec = watch.read(sdir)
    assert rec is not None and rec["id"] == "a" and rec["at"] == NOW
    other = watch.beat(sdir, beat("b", interval=5.0), NOW + 89)  # a within 3 x 30 s: live
    assert other["refused"] and not other["written"] and other["holder"]["id"] == "a"
    assert watch.read(sdir)["id"] == "a"
    assert watch.beat(sdir, beat("a"), NOW + 89)["written"]  # the holder itself goes on
    # silent for more than 3 intervals: the lease is over, another supervisor takes it
    assert watch.beat(sdir, beat("b", interval=5.0), NOW + 89 + 91)["written"]
    assert watch.read(sdir)["id"] == "b"
    # one that stopped on purpose ends its lease at once
    assert watch.beat(sdir, beat("b", interval=5.0, stopped=True), NOW + 200)["written"]
    assert watch.beat(sdir, beat("c"), NOW + 201)["written"]


def test_only_the_known_keys_of_a_heartbeat_reach_the_disk(tmp_path: Path) -> None:
    sdir = str(tmp_path / "s")
    big = {"reason": "x" * 10_000}
    watch.beat(sdir, {**beat("a"), "secret": "s3cret", "pid": True, "by": "b" * 1000, "last_action": big}, NOW)
    text = Path(sdir, watch.HEARTBEAT).read_text()
    rec = json.loads(text)
    assert "secret" not in rec and "pid" not in rec and len(rec["by"]) == watch.MAX_TEXT
    assert rec["last_action"] == {"note": "last action too large to keep"}
    assert watch.beat(sdir, {"by": "no id"}, NOW)["error"] == "not a heartbeat (no id)"


def test_a_heartbeat_that_cannot_be_written_is_an_answer_not_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = watch.beat(str(blocker / "dflash"), beat(), NOW)
    assert out["written"] is False and out["refused"] is False and out["error"]


def facts(supervisor: dict[str, t.Any] | None, now: float) -> dict[str, t.Any]:
    return {
        "host": "pve",
        "session": "dflash",
        "socket": "dflash",
        "checked_at": now,
        "agent": {
            "ok": True,
            "now": now,
            "tmux": {"exit_code": 1, "stderr": "no server running on /tmp/tmux-0/dflash"},
            "attempt": None,
            "supervisor": supervisor,
        },
    }


@pytest.mark.parametrize(
    ("rec", "later", "state", "line"),
    [
        (None, 0, "none", "not supervised"),
        ({**beat("a"), "at": NOW}, 12, "watching", "supervised by pve (systemd, last probe 12 s ago)"),
        (
            {**beat("a"), "at": NOW},
            125,
            "stale",
            "STALE: the supervisor pve (systemd, pid 812) has been silent for 2m05s (more than 3 of its 30 s intervals): nothing watches this run",
        ),
        (
            {**beat("a"), "at": NOW, "stopped": True},
            40,
            "stopped",
            "not supervised (the supervisor pve (systemd) stopped 40 s ago)",
        ),
    ],
)
def test_status_says_who_watches_and_a_stale_supervisor_is_a_fault_that_leaves_the_state(
    rec: dict[str, t.Any] | None, later: float, state: str, line: str
) -> None:
    st = classify(facts(rec, NOW + later))
    assert st.state == State.LOST or st.state == State.NOT_STARTED  # the run's own state, whatever watches it
    assert st.supervisor is not None and st.supervisor.state == state
    assert f"  watch:     {line}" in st.lines()
    doc = st.to_json()["supervisor"]
    assert doc["state"] == state and json.dumps(doc)
    stale = [e for e in st.evidence if e.startswith("supervisor:")]
    assert bool(stale) == (state == "stale")
    if rec:
        assert (doc["by"], doc["mode"], doc["pid"], doc["interval"], doc["silent_for"]) == (
            "pve",
            "systemd",
            812,
            30.0,
            float(later),
        )


def test_an_agent_older_than_the_heartbeat_is_unknown_not_unsupervised() -> None:
    f = facts(None, NOW)
    del f["agent"]["supervisor"]
    st = classify(f)
    assert st.supervisor is None and st.to_json()["supervisor"] is None
    assert not any(line.startswith("  watch:") for line in st.lines())
    # the supervisor says so once, and does not claim a lease it could not take
    hb = Heartbeat(interval=30)
    note = hb.check(f, "pve/dflash", wrote=True)
    assert note and "predates supervisor heartbeats" in note
    assert hb.check(f, "pve/dflash", wrote=True) is None


def test_a_refused_heartbeat_is_supervisor_locked_naming_the_holder() -> None:
    f = facts({**beat("other"), "at": NOW - 4}, NOW)
    f["agent"]["heartbeat"] = {"written": False, "refused": True, "holder": {**beat("other"), "at": NOW - 4}}
    with pytest.raises(errors.SupervisorLocked) as e:
        Heartbeat(interval=1, id="mine").check(f, "pve/dflash", wrote=True)
    assert str(e.value) == (
        "another supervisor watches pve/dflash: pve (systemd, pid 812 on pve1), last probe 4.0s ago; stop it first "
        "(`dflashctl supervise stop`), or wait until it is stale (3 x its 30s interval)"
    )
    # --once writes nothing, but reads the lease all the same
    with pytest.raises(errors.SupervisorLocked):
        Heartbeat(interval=1, id="mine").check(f, "pve/dflash", wrote=False)
    assert Heartbeat(interval=1, id="other").check(f, "pve/dflash", wrote=False) is None


def crashed(attempt: int, at: float) -> Status:
    return Status(
        host="pve",
        session="dflash",
        state=State.CRASHED,
        cause=Cause.PYTHON_EXCEPTION,
        detail="KeyError: 'x'",
        attempt=attempt,
        fingerprint="python-exception|KeyError: 'x'",
        started_at="2027-01-15T08:00:00Z",
        ended_at="2027-01-15T08:00:05Z",
    )


def test_a_supervisor_that_keeps_watching_never_restarts_the_attempt_it_gave_up_on() -> None:
    opts = Options(backoff=0, max_backoff=0, max_restarts=1)
    p = Policy(opts, keep_watching=True)
    assert p.observe(crashed(1, NOW), NOW).action == RESTART
    p.recovered(NOW, RESTART, attempt=2)
    assert p.observe(crashed(2, NOW + 10), NOW + 10).action == GIVE_UP
    again = p.observe(crashed(2, NOW + 20), NOW + 20)
    assert again.action == WAIT and "gave up on attempt 2" in again.reason and not again.new
    # restarted by systemd: the memory keeps the verdict
    q = Policy(opts, keep_watching=True)
    q.load(json.loads(json.dumps(p.memory())))
    assert q.observe(crashed(2, NOW + 30), NOW + 30).action == WAIT
    # a run started by hand is supervised afresh
    assert q.observe(crashed(3, NOW + 40), NOW + 40).action == RESTART


def test_heartbeat_status_file_of_an_installed_supervisor(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    hb = Heartbeat(interval=30, by="pve", mode="tmux", id="i1", status_file=path)
    hb.acted(
        {"time": "2027-01-15T08:00:06Z", "action": "restart", "outcome": "done", "next_attempt": 2, "state": "crashed"}
    )
    p = Policy(Options())
    st = crashed(1, NOW)
    hb.probed(st, p.observe(st, NOW))
    doc = json.loads(path.read_text())
    assert (doc["pid"], doc["probes"], doc["last_action"]["next_attempt"], doc["error"]) == (os.getpid(), 1, 2, None)
    assert doc["last_probe"]["state"] == "crashed" and path.stat().st_mode & 0o777 == 0o600
    hb.failed("nothing deployed")
    hb.ended()
    doc = json.loads(path.read_text())
    assert doc["error"] == "nothing deployed" and doc["ended_at"] and doc["last_probe"]["state"] == "crashed"


# A supervisor.json that a clock step back, an older version or a person left: status reads it, a
# supervisor takes the lease over it, nothing raises. Through the real dflashctl, sshd and container.
BAD_LEASES = {
    "an hour ahead": lambda now: f'"at": {now + 3600}, "interval": 30',
    "interval Infinity": lambda now: f'"at": {now}, "interval": Infinity',
    "at NaN": lambda now: '"at": NaN, "interval": 30',
    "at 1e20": lambda now: '"at": 1e20, "interval": 30',
    "at -1e20": lambda now: '"at": -1e20, "interval": 30',
    "at 1e400": lambda now: '"at": 1e400, "interval": 30',
}


def test_a_heartbeat_that_cannot_be_trusted_holds_no_lease_and_status_says_so(pve_hosts: t.Any) -> None:
    import time

    from testkit import retry_until
    from testkit.runkit import fake_release

    pve_hosts.write(command=["sh", "-c", "echo step 1; exit 3"])
    fake_release(pve_hosts.workdir)
    r = pve_hosts.cli("start")
    assert r.exit_code == 0, r.output
    sdir = pve_hosts.run_dir / "dflash"
    retry_until(lambda: (sdir / "attempt-1" / "exit.json").exists(), 30)
    for n, (name, body) in enumerate(BAD_LEASES.items(), start=1):
        (sdir / watch.HEARTBEAT).write_text(
            '{"id": "ghost", "by": "ghost", "where": "gone", "mode": "systemd", "pid": 1, ' + body(time.time()) + "}"
        )
        st = pve_hosts.cli("status", "--json")
        assert st.exit_code == 5 and "Traceback" not in st.stderr, (name, st.output)
        doc = json.loads(st.stdout)
        assert doc["state"] == "crashed" and doc["supervisor"]["state"] == "unreadable", (name, doc["supervisor"])
        assert any(e.startswith("supervisor.json: unreadable heartbeat") for e in doc["evidence"]), (name, doc)
        human = pve_hosts.cli("status")
        assert human.exit_code == 5 and "Traceback" not in human.stderr, (name, human.output)
        assert "unreadable heartbeat" in human.stdout and "supervised by ghost" not in human.stdout, human.stdout
        # the crashed attempt is restarted: no ghost holds the lease
        state = pve_hosts.root / f"state-{n}"
        sup = pve_hosts.cli("restart-on-crash", "--once", "--backoff", "0", "--state-dir", str(state))
        assert sup.exit_code == 0 and "another supervisor" not in sup.output, (name, sup.output)
        assert (sdir / f"attempt-{n + 1}" / "run.json").exists(), (name, sup.output)
        retry_until(lambda: (sdir / f"attempt-{n + 1}" / "exit.json").exists(), 30)  # noqa: B023


def test_a_heartbeat_request_with_numbers_that_are_not_numbers_writes_none_of_them(tmp_path: Path) -> None:
    sdir = str(tmp_path / "s")
    deep: t.Any = {}
    for _ in range(50):
        deep = {"a": deep}
    req = {**beat("a"), "interval": float("inf"), "started_at": float("nan"), "pid": 10**400, "last_action": deep}
    assert watch.beat(sdir, req, NOW)["written"]
    rec = json.loads(Path(sdir, watch.HEARTBEAT).read_text(), parse_constant=pytest.fail)  # no NaN, no Infinity
    assert "interval" not in rec and "started_at" not in rec and "pid" not in rec, rec
    assert rec["last_action"] == {"note": "last action too large to keep"}
    assert not watch.live(rec, NOW) and watch.unreadable(rec, NOW), "no interval: no lease"


def test_a_lease_whose_holder_is_dead_on_this_machine_is_taken_over_naming_it(pve_hosts: t.Any) -> None:
    """A supervisor of this machine killed -9 left a lease with a 1-day interval: the next supervisor here
    sees its pid gone, says whose lease it breaks and takes it over (not 3 days locked out). A holder whose
    pid lives, or one of another machine, still refuses it."""
    import socket
    import subprocess
    import time

    from testkit import retry_until
    from testkit.faultrig import Supervisor
    from testkit.hostsfile import dflashctl_argv
    from testkit.runkit import fake_release

    pve_hosts.write(command=["sh", "-c", "echo step 1; sleep 600"])
    fake_release(pve_hosts.workdir)
    assert pve_hosts.cli("start").exit_code == 0
    sdir = pve_hosts.run_dir / "dflash"
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is free now: a supervisor killed -9 on this machine

    def lease(pid: int, where: str) -> None:
        rec = {"id": "ghost", "by": "laptop", "where": where, "mode": "foreground", "pid": pid, "interval": 86400}
        (sdir / watch.HEARTBEAT).write_text(json.dumps({**rec, "at": time.time()}))

    here = socket.gethostname()
    for pid, where in ((os.getpid(), here), (gone.pid, "another-box")):  # alive here; or nothing proves it dead
        lease(pid, where)
        r = pve_hosts.cli("restart-on-crash", "--once", "--state-dir", str(pve_hosts.root / "state"))
        assert (
            r.exit_code == 1
            and f"another supervisor watches pve/dflash: laptop (foreground, pid {pid} on {where})" in (r.stderr)
        ), r.output
    lease(gone.pid, here)
    argv = [*dflashctl_argv(), "--hosts", str(pve_hosts.path), "restart-on-crash", "--interval", "0.5"]
    sup = Supervisor([*argv, "--state-dir", str(pve_hosts.root / "state")], pve_hosts.env(), pve_hosts.root)
    try:
        said = sup.event(r"is void")
        assert f"the lease on pve/dflash of laptop (foreground, pid {gone.pid} on {here})" in said, said
        assert f"pid {gone.pid} is gone from this machine ({here}); taking it over" in said, said
        rec = retry_until(lambda: (r := json.loads((sdir / watch.HEARTBEAT).read_text()))["id"] != "ghost" and r, 30)
        assert rec["pid"] == sup.proc.pid and rec["took_over"] == {
            "id": "ghost", "by": "laptop", "where": here, "pid": gone.pid,
        }  # fmt: skip
    finally:
        sup.stop()
        pve_hosts.cli("stop")


def test_a_link_planted_as_the_heartbeats_temp_file_is_never_followed(tmp_path: Path) -> None:
    """The run can write its own run dir: a link under the name the agent writes the heartbeat through
    (``supervisor.json.tmp<pid>``) is replaced, never written through (the file it names stays as it was)."""
    sdir = tmp_path / "runs" / "dflash"
    sdir.mkdir(parents=True)
    precious = tmp_path / "precious"
    precious.write_text("the user's own file\n")
    (sdir / f"{watch.HEARTBEAT}.tmp{os.getpid()}").symlink_to(precious)
    assert watch.beat(str(sdir), beat("a"), NOW)["written"]
    assert precious.read_text() == "the user's own file\n"
    assert json.loads((sdir / watch.HEARTBEAT).read_text())["id"] == "a"
    assert not (sdir / f"{watch.HEARTBEAT}.tmp{os.getpid()}").exists()
