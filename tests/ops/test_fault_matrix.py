"""The fault matrix of `dflashctl restart-on-crash`.

Real parts only: the REAL dflashctl (the supervisor runs as a subprocess of the CLI, `-v` so every
probe is logged on stderr), a real sshd on 127.0.0.1, a fake Proxmox container (a real pid+mount
namespace), real tmux inside it, and a fake trainer that checkpoints a step counter every K steps
(write, then rename) and resumes from it. Faults come from a control file the test writes (`once:` /
`always:` KIND[@N], see fake_train.py) or from outside (kill, reboot, sshd down), as on a real box.

For each fault: the state seen (the supervisor's event line and its incident file), whether it
restarted (attempt dirs, incident files), and that no completed step was lost beyond the checkpoint
interval (the resumed run starts at the last checkpoint + 1, at most K-1 steps behind the last logged one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import typing as t
from pathlib import Path

import pytest

from testkit import PveHosts, retry_until
from testkit.faultrig import FAST, VMID, K, Rig
from testkit.runkit import fake_release, reap_runs, train_command


@pytest.fixture
def rig(pve_hosts: PveHosts, tmp_path: Path) -> t.Iterator[Rig]:
    r = Rig(pve_hosts, tmp_path)
    yield r
    r.close()


HOOK = """\
import json, os, sys
out = sys.argv[1]
data = json.load(sys.stdin)
env = {k: v for k, v in os.environ.items() if k.startswith("DFLASHCTL_")}
n = len(os.listdir(out))
with open(os.path.join(out, f"{n:03d}.json"), "w") as f:
    json.dump({"incident": data, "env": env}, f)
"""


# ---------------------------------------------------------------------------------------------
# a crash with a traceback; success


def test_traceback_is_restarted_and_resumes_then_success_ends_the_supervisor(rig: Rig, tmp_path: Path) -> None:
    rig.configure()
    rig.start(steps=2 * K + 2)
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (tmp_path / "hook.py").write_text(HOOK)
    sup = rig.supervise(*FAST, "--on-event", f"{sys.executable} {tmp_path / 'hook.py'} {hook_dir}")

    # one supervisor per host+session
    second = rig.cli("restart-on-crash", "--state-dir", str(rig.state_dir), "--once")
    assert second.exit_code == 1
    assert f"restart-on-crash is already watching pve/dflash: pid {sup.proc.pid}" in second.stderr

    rig.fault("once:exception")
    line = sup.event(r"crashed: KeyError: 'missing_key'")
    assert "restart in" in line and "(restart 1 of at most 5" in line
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)
    assert rig.attempts() == [1, 2] and (rig.attempt(1) / "exit.json").exists()  # old evidence kept

    [inc] = rig.incidents()
    assert (inc["state"], inc["cause"], inc["attempt"], inc["action"]) == ("crashed", "python-exception", 1, "restart")
    assert (inc["outcome"], inc["next_attempt"], inc["host"], inc["session"]) == ("done", 2, "pve", "dflash")
    assert inc["detail"] == "KeyError: 'missing_key'" and inc["exit_code"] == 1
    assert "KeyError: 'missing_key'" in inc["log_tail"][-1] and any("Traceback" in x for x in inc["log_tail"])
    assert inc["time"].endswith("Z") and inc["reason"].startswith("restart in ")

    rig.finish.touch()
    assert sup.wait(60) == 0, sup.text
    assert sup.events(r"succeeded \(exit 0.*attempt 2\) -> done")
    states = [i["state"] for i in rig.incidents()]
    assert states == ["crashed", "succeeded"]

    hooks = [json.loads(p.read_text()) for p in sorted(hook_dir.glob("*.json"))]
    assert [h["env"]["DFLASHCTL_ACTION"] for h in hooks] == ["restart", "done"]
    h = hooks[0]
    assert h["env"]["DFLASHCTL_STATE"] == "crashed" and h["env"]["DFLASHCTL_CAUSE"] == "python-exception"
    assert h["env"]["DFLASHCTL_HOST"] == "pve" and h["env"]["DFLASHCTL_SESSION"] == "dflash"
    assert h["incident"]["next_attempt"] == 2 and h["incident"]["detail"] == "KeyError: 'missing_key'"
    assert Path(h["env"]["DFLASHCTL_INCIDENT"]).parent == rig.state_dir / "incidents"


# ---------------------------------------------------------------------------------------------
# CUDA OOM


def test_cuda_oom_is_not_restarted_without_retry_oom_and_is_with_it(rig: Rig, tmp_path: Path) -> None:
    rig.configure()
    rig.start()
    failing_hook = tmp_path / "fail.sh"
    failing_hook.write_text("echo hook is broken >&2; exit 3\n")
    sup = rig.supervise(*FAST, "--on-event", f"sh {failing_hook}")
    retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
    rig.fault("once:oom")
    line = sup.event(r"crashed: CUDA out of memory on GPU 5")
    assert "-> wait: not restarted" in line and "--retry-oom" in line
    warn = sup.event(r"warning: --on-event failed")
    assert "exit 3: hook is broken" in warn  # reported, and the supervisor goes on
    sup.more_probes(3)
    assert rig.attempts() == [1] and sup.proc.poll() is None
    [inc] = rig.incidents()
    assert (inc["state"], inc["cause"], inc["action"], inc["gpu"]) == ("crashed", "cuda-oom", "wait", 5)
    assert inc["hook"]["ok"] is False and inc["hook"]["exit_code"] == 3

    # Ctrl-C ends the supervisor (exit 0), then --once: the same verdict, with the status code
    assert sup.stop(signal.SIGINT) == 0
    assert sup.events(r"supervisor stopped by SIGINT; the run is left as it is")
    once = rig.cli("restart-on-crash", "--state-dir", str(rig.state_dir), "--once")
    assert once.exit_code == 5, once.output
    assert rig.attempts() == [1]
    once = rig.cli("restart-on-crash", "--state-dir", str(rig.state_dir), "--once", "--retry-oom")
    assert once.exit_code == 0, once.output
    assert "restarted: attempt 2 started" in once.stdout
    rig.assert_resumed(1, 2)


def test_the_same_oom_twice_before_min_uptime_gives_up(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 2)
    sup = rig.supervise(*FAST, "--retry-oom")
    rig.fault("always:oom@3")  # every run: OOM after 3 steps
    sup.event(r"restarted: attempt 2 started")
    assert sup.wait(60) == 11, sup.text
    rig.assert_resumed(1, 2)
    assert rig.attempts() == [1, 2]
    give_up = sup.event(r"-> give-up")
    assert "crash loop: the same failure twice in a row" in give_up and "CUDA out of memory on GPU 5" in give_up
    err = "\n".join(sup.err)
    assert "dflashctl: pve/dflash: gave up: crash loop: the same failure twice in a row" in err
    incs = rig.incidents()
    assert [(i["attempt"], i["action"], i["outcome"]) for i in incs] == [
        (1, "restart", "done"),
        (2, "give-up", "noted"),
    ]
    assert incs[1]["fingerprint"] == incs[0]["fingerprint"] == "cuda-oom|gpu 5"


def test_an_uncorrectable_ecc_error_is_not_restarted_into_the_supervisor_gives_up(rig: Rig) -> None:
    """torch's words for a GPU that failed under it (a real CUDA text, no Xid in the log): restart-on-crash
    ends with exit 13 rather than restarting until its crash-loop guard gives up."""
    rig.configure()
    rig.start(steps=K + 2)
    sup = rig.supervise(*FAST)
    rig.fault("always:cuda-ecc")  # every run would fail the same way: none is started
    assert sup.wait(60) == 13, sup.text
    give_up = sup.event(r"-> give-up")
    assert "not restarted into a failed GPU: crashed: GPU fault: uncorrectable ECC error" in give_up
    assert "dflashctl: pve/dflash: gave up: not restarted into a failed GPU" in "\n".join(sup.err)
    assert rig.attempts() == [1]
    [inc] = rig.incidents()
    assert (inc["cause"], inc["action"], inc["xid"]) == ("gpu-fault", "give-up", None)
    assert inc["detail"] == "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    st = rig.status()
    assert (st["state"], st["cause"], st["fingerprint"]) == (
        "crashed",
        "gpu-fault",
        "gpu-fault|uncorrectable ECC error|?",
    )


# ---------------------------------------------------------------------------------------------
# processes killed


def test_sigkilled_training_is_restarted(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 3)
    sup = rig.supervise(*FAST)
    assert rig.inside("kill", "-KILL", str(rig.run_json(1)["child_pid"])).returncode == 0
    sup.event(r"crashed: killed by signal 9 \(SIGKILL\)")
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)
    [inc] = rig.incidents()
    assert (inc["state"], inc["cause"], inc["signal"], inc["next_attempt"]) == ("crashed", "signal", 9, 2)


def test_tmux_server_sigkilled_training_goes_on_without_a_restart(rig: Rig) -> None:
    rig.configure()
    rig.start()
    sup = rig.supervise(*FAST)
    server = int(rig.inside("tmux", "-L", rig.socket, "display-message", "-p", "#{pid}").stdout.decode().strip())
    assert rig.inside("kill", "-KILL", str(server)).returncode == 0
    retry_until(lambda: rig.status()["tmux"]["server"] == "dead", 30, interval=0.5)
    n = len(rig.steps(1))
    sup.more_probes(4)
    assert rig.attempts() == [1] and len(rig.steps(1)) > n  # still training, still logging
    assert rig.incidents() == [] and not sup.events(r"-> (restart|wait|give-up)")
    assert rig.status()["state"] == "running"
    # Ctrl-C stops the supervisor, never the run
    assert sup.stop(signal.SIGINT) == 0
    n = len(rig.steps(1))
    retry_until(lambda: len(rig.steps(1)) > n + 2, 30)
    assert rig.status()["state"] == "running"


# ---------------------------------------------------------------------------------------------
# the container


def test_container_rebooted_is_restarted_once_it_is_up(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 3)
    sup = rig.supervise(*FAST)
    rig.pve.reboot(VMID)
    sup.event(r"lost: the container restarted during the run")
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)
    # a probe may fall in the reboot's gap: the container was down then, and that is said (no action)
    incs = rig.incidents()
    assert all((i["state"], i["action"]) == ("container-down", "wait") for i in incs[:-1]), incs
    inc = incs[-1]
    assert (inc["state"], inc["cause"], inc["action"], inc["next_attempt"]) == (
        "lost",
        "container-restart",
        "restart",
        2,
    )


def test_container_stopped_is_not_started_without_the_flag_and_restarted_when_back(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 3)
    sup = rig.supervise(*FAST)
    rig.pve.stop(VMID)
    line = sup.event(r"container-down: container 200 is stopped")
    assert "-> wait:" in line and "pass --start-container" in line
    sup.more_probes(3)
    assert rig.pve.init_pid(VMID) is None and rig.attempts() == [1]
    rig.pve.start(VMID)  # back by the operator's hand
    sup.event(r"lost: the container restarted during the run")
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)
    assert [(i["state"], i["action"]) for i in rig.incidents()] == [("container-down", "wait"), ("lost", "restart")]


def test_container_stopped_is_started_with_start_container(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 3)
    sup = rig.supervise(*FAST, "--start-container")
    rig.pve.stop(VMID)
    sup.event(r"container-down: container 200 is stopped -> start the container in")
    sup.event(r"container 200 started; re-probing")
    sup.event(r"restarted: attempt 2 started")
    assert rig.pve.init_pid(VMID) is not None
    rig.assert_resumed(1, 2)
    incs = rig.incidents()
    assert [(i["state"], i["action"], i["outcome"]) for i in incs] == [
        ("container-down", "start-container", "done"),
        ("lost", "restart", "done"),
    ]


# ---------------------------------------------------------------------------------------------
# the ssh connection


def _comm(pid: int) -> str:
    """A process's name; "" once it is gone (a short-lived child can exit between listing and reading: CI)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def _descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def test_sshd_down_for_a_while_is_no_crash_and_the_supervisor_goes_on(rig: Rig) -> None:
    rig.configure()
    rig.start()
    sup = rig.supervise(*FAST)
    sshd = rig.hosts.sshd
    assert sshd.pid is not None
    # The listener AND the session processes of the kept connection (ours, by pid): the connection drops.
    sessions = [p for p in _descendants(sshd.pid) if _comm(p).startswith("sshd")]
    sshd.stop()
    for p in sessions:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    line = sup.event(r"unreachable \(refused\)")
    assert "not a crash" in line
    retry_until(lambda: sum(1 for x in sup.err if "reconnect try" in x) >= 3, 30)
    assert sup.proc.poll() is None
    sshd.start()
    back = sup.event(r"reachable again after")
    assert re.search(r"\(\d+ reconnect tr(y|ies)\)", back)
    sup.more_probes(2)
    assert rig.attempts() == [1] and rig.status()["state"] == "running"
    [inc] = rig.incidents()
    assert (inc["state"], inc["cause"], inc["action"], inc["outcome"]) == (
        "unreachable",
        "refused",
        "wait",
        "recovered",
    )
    assert inc["outage_seconds"] > 0
    rig.finish.touch()
    assert sup.wait(60) == 0, sup.text


# ---------------------------------------------------------------------------------------------
# a hung process, a stop on purpose, a crash loop


def test_hung_process_is_stopped_and_restarted_with_restart_stalled(rig: Rig) -> None:
    rig.configure(hang_after=1)
    rig.start(steps=K + 2)
    sup = rig.supervise(*FAST, "--restart-stalled")
    rig.fault("once:forever")  # sleeps without a word
    sup.event(r"stalled: no progress for .* -> stop and restart in")
    sup.event(r"restarted: replaced attempt 1 by \w+; attempt 2 started")
    rig.assert_resumed(1, 2)
    stop = json.loads((rig.attempt(1) / "stop.json").read_text())
    assert stop["reason"] == "replaced" and (rig.attempt(1) / "exit.json").exists()
    [inc] = rig.incidents()
    assert (inc["state"], inc["action"], inc["next_attempt"]) == ("stalled", "stop-then-restart", 2)
    stack = inc["stack"]
    # py-spy is looked for on the container's PATH, then next to the configured python (the venv's bin)
    if shutil.which("py-spy", path=os.path.dirname(sys.executable)):
        dump = (rig.attempt(1) / "py-spy-dump.txt").read_text()
        assert stack["saved"] == str(rig.attempt(1) / "py-spy-dump.txt") and stack["error"] is None
        assert "fake_train.py" in dump and "end (testkit/fake_train.py" in stack["stack"]  # where it hangs
        assert sup.events(r"saved the hung process's stack to ")
    else:
        assert stack["saved"] is None and "py-spy is not installed" in stack["error"]


def test_dflashctl_stop_during_supervision_is_not_restarted(rig: Rig) -> None:
    rig.configure()
    rig.start()
    sup = rig.supervise(*FAST)
    r = rig.cli("stop", "--grace", "10")
    assert r.exit_code == 0, r.output
    line = sup.event(r"stopped by dflashctl stop")
    assert "-> wait: stopped on purpose" in line
    sup.more_probes(3)
    assert rig.attempts() == [1] and sup.proc.poll() is None
    [inc] = rig.incidents()
    assert (inc["state"], inc["action"]) == ("stopped", "wait")
    # still watching: a new start by hand is supervised again
    r = rig.cli("start")
    assert r.exit_code == 0, r.output
    sup.event(r"running\b.*\(attempt 2")
    assert sup.stop() == 0


def test_more_than_max_restarts_within_the_window_gives_up(rig: Rig) -> None:
    rig.configure()
    rig.start()
    # --min-uptime 0: every crash is "late", so only the window guard can end it
    sup = rig.supervise(*FAST, "--max-restarts", "2", "--min-uptime", "0")
    rig.fault("always:exception@2")
    assert sup.wait(90) == 11, sup.text
    assert rig.attempts() == [1, 2, 3]
    for n in (2, 3):
        assert re.search(r"^resumed from checkpoint at step \d+$", rig.log(n), re.M)
    give_up = sup.event(r"-> give-up")
    assert "crash loop: 2 restarts within --window 60m (--max-restarts 2)" in give_up
    assert "dflashctl: pve/dflash: gave up: crash loop: 2 restarts" in "\n".join(sup.err)
    incs = rig.incidents()
    assert [(i["attempt"], i["action"], i["outcome"], i["next_attempt"]) for i in incs] == [
        (1, "restart", "done", 2),
        (2, "restart", "done", 3),
        (3, "give-up", "noted", None),
    ]
    keys = {
        "time",
        "host",
        "session",
        "attempt",
        "state",
        "cause",
        "detail",
        "evidence",
        "log_tail",
        "action",
        "reason",
        "next_attempt",
        "exit_code",
        "fingerprint",
        "log",
    }
    for i in incs:
        assert keys <= set(i), keys - set(i)
        assert i["state"] == "crashed" and i["cause"] == "python-exception" and i["detail"] == "KeyError: 'missing_key'"
        assert i["log_tail"] and i["log_tail"][-1] == "KeyError: 'missing_key'"
        assert i["log"] == str(rig.attempt(i["attempt"]) / "train.log")
    assert incs[2]["restarts_in_window"] == 2


# ---------------------------------------------------------------------------------------------
# transport = "local": the same supervisor on this machine


def test_local_host_once_restarts_a_crashed_run(pve_hosts: PveHosts, tmp_path: Path) -> None:
    local = pve_hosts.local_table
    shared = tmp_path / "local-shared"
    shared.mkdir()
    ckpt, control, finish = shared / "ckpt.json", shared / "control", shared / "finish"
    local["command"] = train_command(
        "--steps",
        "1",
        "--interval",
        "0.1",
        "--until",
        str(finish),
        "--checkpoint",
        str(ckpt),
        "--every",
        str(K),
        "--control",
        str(control),
    )
    pve_hosts.write()
    fake_release(Path(str(local["workdir"])))
    run_dir = Path(str(local["run_dir"])) / "dflash"
    state = ["--state-dir", str(tmp_path / "state")]
    try:
        assert pve_hosts.cli("--host", "local", "start").exit_code == 0
        retry_until(
            lambda: len(re.findall(r"^step \d+", (run_dir / "attempt-1" / "train.log").read_text(), re.M)) > K, 30
        )
        once = pve_hosts.cli("--host", "local", "restart-on-crash", "--once", *state)
        assert once.exit_code == 0 and "watching (once): running" in once.stdout, once.output
        control.write_text("once:exception")
        retry_until(lambda: (run_dir / "attempt-1" / "exit.json").exists(), 30)
        once = pve_hosts.cli("--host", "local", "restart-on-crash", "--once", *state)
        assert once.exit_code == 0, once.output
        assert "crashed: KeyError: 'missing_key'" in once.stdout and "restarted: attempt 2 started" in once.stdout
        log2 = run_dir / "attempt-2" / "train.log"
        m = retry_until(
            lambda: log2.exists() and re.search(r"^resumed from checkpoint at step (\d+)$", log2.read_text(), re.M), 30
        )
        assert int(m.group(1)) % K == 0 and int(m.group(1)) > 0
        [inc] = [json.loads(p.read_text()) for p in (tmp_path / "state" / "incidents").glob("*.json")]
        assert (inc["host"], inc["state"], inc["cause"], inc["next_attempt"]) == (
            "local",
            "crashed",
            "python-exception",
            2,
        )
    finally:
        finish.touch()
        reap_runs(run_dir.parent)


# ---------------------------------------------------------------------------------------------
# a run that diverged (dflash train's exit 3 and its one line)


def test_a_diverged_run_is_not_restarted_by_default_exit_12(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 2)
    sup = rig.supervise(*FAST)
    rig.fault("once:diverged")
    line = sup.event(r"crashed: training diverged")
    assert "-> give-up" in line and f"last finite checkpoint: {rig.ckpt} (step " in line
    assert "--on-diverged resume-from-last-finite" in line
    assert sup.wait(60) == 12, sup.text
    assert "dflashctl: pve/dflash: gave up: training diverged: diverged at step" in "\n".join(sup.err)
    assert rig.attempts() == [1]
    [inc] = rig.incidents()
    assert (inc["state"], inc["cause"], inc["action"], inc["exit_code"]) == ("crashed", "diverged", "give-up", 3)
    assert any(e.startswith("log: dflash: diverged at step") for e in inc["evidence"]), inc["evidence"]
    st = rig.status()
    assert (st["state"], st["cause"]) == ("crashed", "diverged") and "last finite checkpoint" in st["detail"]
    hist = rig.cli("history")
    assert "diverged" in hist.stdout, hist.output


def test_on_diverged_resume_from_last_finite_resumes_once_then_gives_up(rig: Rig) -> None:
    rig.configure()
    rig.start(steps=K + 2)
    sup = rig.supervise(*FAST, "--on-diverged", "resume-from-last-finite")
    rig.fault("always:diverged@3")  # the same data replays: every run diverges again
    line = sup.event(r"crashed: training diverged")
    assert "resuming once from the last finite checkpoint" in line and "the same data position replays" in line
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)
    assert sup.wait(60) == 12, sup.text
    give_up = sup.event(r"-> give-up")
    assert "it diverged again after the one resume from the last finite checkpoint" in give_up
    assert rig.attempts() == [1, 2]
    assert [(i["attempt"], i["cause"], i["action"]) for i in rig.incidents()] == [
        (1, "diverged", "restart"),
        (2, "diverged", "give-up"),
    ]


# ---------------------------------------------------------------------------------------------
# words a program prints are not the machine's: a data sample, a line like the trainer's, a warning it
# recovered from (the verdict comes from the exit record, the last exception, the kernel's lines)


def _crashed_then_supervised(rig: Rig, said: str, *args: str) -> tuple[dict[str, t.Any], t.Any]:
    """Attempt 1 prints ``said`` (the control file's text) and crashes; its status, then a supervisor's."""
    rig.configure()
    rig.start()
    retry_until(lambda: len(rig.steps(1)) >= K + 2, 30)
    rig.fault(said)
    retry_until(lambda: (rig.attempt(1) / "exit.json").exists(), 30)
    return rig.status(), rig.supervise(*FAST, *args)


def test_a_printed_ecc_text_and_xid_line_are_no_gpu_fault_the_value_error_is_restarted(rig: Rig) -> None:
    sample = [
        "sample 1207: {'text': 'RuntimeError: CUDA error: uncorrectable ECC error encountered'}",
        "sample 1208: [ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
    ]
    st, sup = _crashed_then_supervised(rig, "\n".join(["once:value-error", *sample]))
    assert "uncorrectable ECC error encountered" in rig.log(1) and "NVRM: Xid" in rig.log(1)
    assert (st["state"], st["cause"], st["detail"]) == ("crashed", "python-exception", "ValueError: bad row in shard 3")
    line = sup.event(r"crashed: ValueError: bad row in shard 3")
    assert "GPU" not in line
    sup.event(r"restarted: attempt 2 started")
    assert not sup.events(r"give-up|GPU fault")
    rig.finish.touch()
    assert sup.wait(60) == 0, sup.text  # not 13: no GPU failed
    [crash, _] = rig.incidents()
    assert (crash["cause"], crash["action"], crash["xid"]) == ("python-exception", "restart", None)


def test_a_printed_diverged_line_then_exit_1_is_no_divergence_and_etc_is_never_offered(rig: Rig) -> None:
    said = "once:die:1\ndflash: diverged at step 2: loss not finite; last finite checkpoint: /etc (step 1)"
    st, sup = _crashed_then_supervised(rig, said, "--on-diverged", "resume-from-last-finite")
    assert (st["state"], st["cause"], st["exit_code"]) == ("crashed", "nonzero-exit", 1), st
    sup.event(r"restarted: attempt 2 started")
    rig.assert_resumed(1, 2)  # from the run's own checkpoint
    [inc] = rig.incidents()
    assert (inc["cause"], inc["action"]) == ("nonzero-exit", "restart")
    # the program's last line is quoted as its words, never acted on
    assert st["detail"].startswith("dflash: diverged at step 2")
    offered = [sup.text, inc["reason"], json.dumps(rig.run_json(2))]
    assert not any("last finite checkpoint (" in x or "training diverged" in x for x in offered), offered
    assert "/etc" not in json.dumps(rig.run_json(2)["command"]) and "/etc" not in inc["reason"]


def test_a_recovered_oom_warning_then_an_unrelated_crash_steps_later_is_no_cuda_oom(rig: Rig) -> None:
    warn = (
        "2026-12-02T00:01:02 WARNING dflash.train.pipeline: drafter-0 (cuda:1): CUDA out of memory. Tried to "
        "allocate 2.00 GiB at step 4; retrying once with the batch halved"
    )
    rig.configure()
    rig.start()
    rig.fault(f"once:say\n{warn}")
    retry_until(lambda: warn in rig.log(1), 30)
    after = len(rig.steps(1))
    retry_until(lambda: len(rig.steps(1)) >= after + 2 * K, 30)  # the run went on: the warning was recovered
    rig.fault("once:value-error:shard 9 has no rows")
    retry_until(lambda: (rig.attempt(1) / "exit.json").exists(), 30)
    st = rig.status()
    assert (st["state"], st["cause"], st["detail"]) == (
        "crashed",
        "python-exception",
        "ValueError: shard 9 has no rows",
    )
    sup = rig.supervise(*FAST)  # a cuda-oom is not restarted by default; this crash is
    sup.event(r"restarted: attempt 2 started")
    [inc] = rig.incidents()
    assert (inc["cause"], inc["action"], inc["gpu"]) == ("python-exception", "restart", None)
