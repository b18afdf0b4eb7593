"""ops.probe from recorded fact sets (tests/ops/facts/*.json, made by tests/ops/facts/record.py
against the real sshd + fake container + tmux) and from hand-written log tails."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from ops import diagnosis, probe, wire
from ops.exit_codes import ExitCode, exit_code_for_state
from ops.states import CAUSES, Action, Cause, State

FACTS = Path(__file__).with_name("facts")
RECORDED = sorted(FACTS.glob("*.json"))


def load(name: str) -> dict:
    return json.loads((FACTS / f"{name}.json").read_text())


def test_every_state_and_cause_of_the_contract_has_a_recorded_fact_set() -> None:
    seen = {
        (d["expect"]["state"], d["expect"].get("cause")) for d in map(lambda p: json.loads(p.read_text()), RECORDED)
    }
    for state in State:
        assert any(s == state for s, _ in seen), state
    for state, causes in CAUSES.items():
        for cause in causes:
            if (state, cause) == ("unreachable", "unknown"):
                continue  # only for errors the transport cannot name
            assert (state, cause) in seen, (state, cause)


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_fact_set(path: Path) -> None:
    doc = json.loads(path.read_text())
    want = doc["expect"]
    st = probe.classify(doc["facts"])
    got = st.to_json()
    assert (got["state"], got["cause"]) == (want["state"], want.get("cause")), st.lines()
    for key in ("gpu", "exit_code", "signal", "detail", "mode"):
        if key in want:
            assert got[key] == want[key], key
    if "tmux_server" in want:
        assert got["tmux"]["server"] == want["tmux_server"]
    if "tmux_session" in want:
        assert got["tmux"]["session"] == want["tmux_session"]
    if "progress_step_min" in want:
        assert got["progress"]["step"] >= want["progress_step_min"]
    # the JSON contract: stable keys, absent facts null, lists of strings
    assert set(got) >= {
        "host",
        "session",
        "state",
        "cause",
        "detail",
        "gpu",
        "exit_code",
        "signal",
        "attempt",
        "started_at",
        "ended_at",
        "tmux",
        "container",
        "progress",
        "log",
        "evidence",
        "checked_at",
    }
    assert set(got["tmux"]) == {"socket", "server", "session", "pane", "evidence"}
    assert got["tmux"]["server"] in ("alive", "dead", None)
    assert got["tmux"]["session"] in ("alive", "missing", None)
    assert got["tmux"]["pane"] in ("alive", "dead", None)
    assert got["container"] is None or got["container"]["status"] in ("running", "stopped", "missing", None)
    assert all(isinstance(e, str) for e in got["evidence"])
    assert got["mode"] in ("agent", "fallback")
    assert json.loads(json.dumps(got)) == got
    assert isinstance(exit_code_for_state(st.state), ExitCode)
    assert st.lines()[0] == st.headline() and st.headline()


STATUSES = FACTS / "status"  # what each fact set classified to when it was stored: JSON and the lines


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_recorded_fact_set_classifies_to_its_stored_status(path: Path) -> None:
    """The whole Status, not only its state: a change to how facts are read must not move a key or a line.
    A change that means to move them rewrites the stored file (``json.dumps({"json": st.to_json(),
    "lines": st.lines()}, indent=1, sort_keys=True)``) and says why."""
    st = probe.classify(json.loads(path.read_text())["facts"])
    want = json.loads((STATUSES / path.name).read_text())
    assert json.loads(json.dumps(st.to_json())) == want["json"]
    assert st.lines() == want["lines"]


def test_exit_codes_follow_the_state_table() -> None:
    table = {
        "running": 0,
        "stalled": 3,
        "succeeded": 4,
        "crashed": 5,
        "lost": 6,
        "not-started": 7,
        "stopped": 8,
        "container-down": 9,
        "unreachable": 10,
    }
    assert {s: int(exit_code_for_state(s)) for s in State} == table


def test_states_causes_and_actions_read_and_print_as_their_strings() -> None:
    """StrEnum members are the contract's strings: JSON, f-strings and comparisons are as before."""
    assert json.dumps({"state": State.NOT_STARTED, "cause": Cause.CUDA_OOM, "action": Action.STOP_THEN_RESTART}) == (
        '{"state": "not-started", "cause": "cuda-oom", "action": "stop-then-restart"}'
    )
    assert f"{State.CONTAINER_DOWN} {Cause.HOST_KEY} {Action.GIVE_UP}" == "container-down host-key give-up"
    assert "crashed" == State.CRASHED and State("lost") is State.LOST
    assert [str(a) for a in Action] == ["restart", "stop-then-restart", "start-container", "wait", "give-up", "done"]
    st = probe.classify(load(RECORDED[0].stem)["facts"])
    assert json.dumps(st.to_json()) == json.dumps(json.loads(json.dumps(st.to_json())))


def test_durable_evidence_decides_before_tmux() -> None:
    """The same dead-server tmux text, with and without an exit record."""
    doc = load("running-tmux-server-killed")
    facts = copy.deepcopy(doc["facts"])
    att = facts["agent"]["attempt"]
    att["exit"] = {"exit_code": 0, "signal": None, "ended_at": "2026-11-29T16:00:00Z", "oom_kill": 0}
    att["child"]["alive"] = att["runner"]["alive"] = False
    st = probe.classify(facts)
    assert st.state == "succeeded" and st.tmux.server == "dead" and st.tmux.evidence.startswith("no server running on")
    att["exit"] = None
    st = probe.classify(facts)
    assert (st.state, st.cause) == ("lost", "tmux-server-killed")


def test_a_run_is_never_ended_while_a_process_of_it_lives() -> None:
    """Its processes decide before the records do: the command and its keeper gone, or even an exit record
    written, a live member keeps the run open (crashed, orphans-left); the keeper alive and the command
    gone is a run that is ending."""
    facts = copy.deepcopy(load("crashed-orphans-left")["facts"])
    att = facts["agent"]["attempt"]
    trainer = att["members"][0]["pid"]
    st = probe.classify(facts)
    assert (st.state, st.cause, st.pid, st.fingerprint) == ("crashed", "orphans-left", trainer, "orphans-left")
    assert [m["pid"] for m in st.to_json()["members"]] == [trainer] and not st.stop_requested
    att["exit"] = {"exit_code": 0, "signal": None, "ended_at": "2026-11-29T16:00:00Z", "left": [], "killed": []}
    st = probe.classify(facts)
    assert (st.state, st.cause, st.exit_code) == ("crashed", "orphans-left", 0), "exit 0 with a live member"
    att["exit"] = None
    att["stop"] = {"requested_at": "2026-11-29T16:00:00Z", "reason": "stop", "grace": 60}
    st = probe.classify(facts)
    assert (st.state, st.cause) == ("crashed", "orphans-left") and st.stop_requested
    assert "run `dflashctl stop` again" in (st.detail or "")
    att["stop"] = None
    att["keeper"]["alive"] = True  # the keeper is ending them
    st = probe.classify(facts)
    assert st.state == "running" and st.pid == trainer
    assert any("the keeper ends them" in e for e in st.evidence), st.evidence
    att["members"] = []
    att["keeper"]["alive"] = False
    st = probe.classify(facts)
    assert (st.state, st.cause) == ("lost", "unknown"), "nothing of it lives: the old verdict"


def test_exit_json_names_what_the_command_left_and_what_had_to_be_killed() -> None:
    facts = copy.deepcopy(load("crashed-signal")["facts"])
    att = facts["agent"]["attempt"]
    att["run"]["tag"] = "dflash/1/0123456789ab"
    att["members"] = []
    left = [{"pid": 30, "start": 5, "argv": ["python", "/root/train.py"]}]
    att["exit"].update(left=left, killed=left)
    st = probe.classify(facts)
    assert (st.state, st.cause, st.signal) == ("crashed", "signal", 9) and st.members == []
    assert any("left 1 process running when it ended (pid 30 (python train.py))" in e for e in st.evidence)
    assert any("1 process had to be killed (SIGKILL): pid 30 (python train.py)" in e for e in st.evidence)


def test_stalled_only_after_hang_after_and_startup_grace() -> None:
    facts = copy.deepcopy(load("stalled")["facts"])
    assert probe.classify(facts).state == "stalled"
    facts["hang_after"] = 10**6
    assert probe.classify(facts).state == "running"
    facts["hang_after"] = 1
    facts["startup_grace"] = 10**6
    st = probe.classify(facts)
    assert st.state == "running" and any("inside startup_grace" in e for e in st.evidence)


def test_a_reused_pid_is_not_our_process() -> None:
    facts = copy.deepcopy(load("running")["facts"])
    att = facts["agent"]["attempt"]
    for key in ("child", "runner"):
        att[key].update(alive=False, same=False)  # as the agent reports a pid whose start time differs
    st = probe.classify(facts)
    assert (st.state, st.cause) == ("lost", "unknown")
    assert any("reused by another process" in e for e in st.evidence)


def test_stop_record_wins_over_the_exit_code() -> None:
    facts = copy.deepcopy(load("crashed-signal")["facts"])
    facts["agent"]["attempt"]["stop"] = {"requested_at": "2026-11-29T16:00:00Z", "reason": "stop", "grace": 60}
    st = probe.classify(facts)
    assert st.state == "stopped" and st.cause is None and st.signal == 9


def test_container_restart_beats_tmux_texts() -> None:
    st = probe.classify(load("lost-container-restart")["facts"])
    assert st.tmux.evidence.startswith("error connecting to") and "(No such file or directory)" in st.tmux.evidence
    assert st.container is not None and st.container.booted_at >= st.started_at


def test_hand_started_lost_explains_why_it_cannot_tell() -> None:
    a = probe.classify(load("hand-lost-server-killed")["facts"])
    b = probe.classify(load("hand-lost-command-exited")["facts"])
    assert a.tmux.evidence.split(" on ")[0] == b.tmux.evidence.split(" on ")[0] == "no server running"
    assert a.detail == b.detail and "only an exit record" in a.detail
    assert a.headline() == "lost: the run vanished (no exit record)"


def test_headlines() -> None:
    assert (
        probe.classify(load("crashed-cuda-oom")["facts"])
        .headline()
        .startswith("crashed: CUDA out of memory on GPU 5 (exit 1, ")
    )
    assert (
        probe.classify(load("crashed-signal")["facts"])
        .headline()
        .startswith("crashed: killed by signal 9 (SIGKILL) (signal 9, ")
    )
    assert probe.classify(load("succeeded")["facts"]).headline().startswith("succeeded (exit 0, ")
    assert (
        probe.classify(load("container-down-stopped")["facts"]).headline() == "container-down: container 200 is stopped"
    )
    assert probe.classify(load("unreachable-refused")["facts"]).headline().startswith("unreachable (refused): ")
    assert probe.classify(load("stopped")["facts"]).headline().startswith("stopped by dflashctl stop (")
    lines = probe.classify(load("running")["facts"]).lines()
    assert lines[0].startswith("running: step ") and "attempt 1, pid " in lines[0]
    assert [ln.split(":")[0].strip() for ln in lines[1:5]] == ["tmux", "container", "progress", "log"]


# ---------------------------------------------------------------------------------------------
# log tails


OOM_NEW = [
    "step 1199 | loss 2.31",
    "Traceback (most recent call last):",
    '  File "train.py", line 3, in <module>',
    "    loss.backward()",
    "    ^^^^^^^^^^^^^^^",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total capacity of 79.25 GiB",
]


@pytest.mark.parametrize(
    "lines, exit_code, signal, cause, gpu, detail_start",
    [
        (OOM_NEW, 1, None, "cuda-oom", 5, "torch.OutOfMemoryError: CUDA out of memory"),
        (
            [
                "Traceback (most recent call last):",
                "  x",
                "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 3; 7.79 GiB total capacity)",
            ],
            1,
            None,
            "cuda-oom",
            3,
            "RuntimeError: CUDA out of memory",
        ),
        (
            [
                "[rank0]: Traceback (most recent call last):",
                "[rank0]:   x",
                "[rank0]: torch.OutOfMemoryError: CUDA out of memory on device cuda:7",
            ],
            1,
            None,
            "cuda-oom",
            7,
            "torch.OutOfMemoryError",
        ),
        # torchrun: the worker's OOM, then torchrun's own traceback ending in ChildFailedError
        (
            OOM_NEW
            + [
                "Traceback (most recent call last):",
                "  y",
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: train.py FAILED",
            ],
            1,
            None,
            "cuda-oom",
            5,
            "torch.OutOfMemoryError",
        ),
        (
            [
                "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4, OpType=ALLREDUCE) ran for 600081 milliseconds before timing out."
            ],
            None,
            6,
            "nccl-timeout",
            None,
            "[Rank 3] Watchdog caught",
        ),
        (
            ["torch.distributed.DistBackendError: NCCL error in: NCCLUtils.hpp:275, unhandled system error"],
            1,
            None,
            "nccl-error",
            None,
            "torch.distributed.DistBackendError",
        ),
        (
            [
                "Traceback (most recent call last):",
                '  File "a.py", line 1',
                "ValueError: bad config value 3",
                "",
                "wandb: Waiting for W&B process to finish... (failed 1).",
            ],
            1,
            None,
            "python-exception",
            None,
            "ValueError: bad config value 3",
        ),
        (
            ["Traceback (most recent call last):", "  x", "KeyboardInterrupt"],
            None,
            2,
            "signal",
            None,
            "ended by signal 2",
        ),
        (["killed"], 137, None, "signal", None, "exit 137 = 128+9"),
        (["usage: train [-h]", "train: error: bad flag"], 2, None, "nonzero-exit", None, "train: error: bad flag"),
        ([], 3, None, "nonzero-exit", None, "exit code 3"),
    ],
)
def test_diagnose(
    lines: list[str], exit_code: int | None, signal: int | None, cause: str, gpu: int | None, detail_start: str
) -> None:
    d = diagnosis.diagnose(lines, exit_code=exit_code, signal=signal)
    assert (d.cause, d.gpu) == (cause, gpu)
    assert (d.detail or "").startswith(detail_start), d.detail


def test_host_oom_needs_the_cgroup_count_to_rise() -> None:
    d = diagnosis.diagnose(["step 1"], exit_code=None, signal=9, oom_before=2, oom_after=3)
    assert d.cause == "host-oom" and d.signal == 9 and "oom_kill rose from 2 to 3" in d.evidence[0]
    assert diagnosis.diagnose(["step 1"], exit_code=None, signal=9, oom_before=3, oom_after=3).cause == "signal"
    assert diagnosis.diagnose(["step 1"], exit_code=137, signal=None, oom_before=0, oom_after=1).cause == "host-oom"
    assert diagnosis.diagnose(["step 1"], exit_code=137, signal=None, oom_before=None, oom_after=1).cause == "signal"


def test_fingerprint_is_stable_across_numbers() -> None:
    a = diagnosis.diagnose(
        ["Traceback (most recent call last):", "  x", "ValueError: step 120 at 0x7f3a1c"], exit_code=1, signal=None
    )
    b = diagnosis.diagnose(
        ["Traceback (most recent call last):", "  x", "ValueError: step 5 at 0x7f0000"], exit_code=1, signal=None
    )
    c = diagnosis.diagnose(["Traceback (most recent call last):", "  x", "KeyError: 'x'"], exit_code=1, signal=None)
    assert a.fingerprint == b.fingerprint == "python-exception|ValueError: step # at <addr>"
    assert c.fingerprint != a.fingerprint


def test_last_exception_takes_the_last_traceback_only() -> None:
    lines = [
        "Traceback (most recent call last):",
        "  a",
        "KeyError: 1",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        "  b",
        "    c",
        "RuntimeError: wrapped",
    ]
    assert diagnosis.last_exception(lines) == "RuntimeError: wrapped"
    assert diagnosis.last_exception(["no traceback here"]) is None


def test_progress_from_metrics_then_log() -> None:
    last = {"step": 1200, "loss": 2.31, "ktok_s": 19.4, "at": "2026-11-29T15:39:58Z"}
    p = diagnosis.progress_of(wire.Metrics(mtime=None, last=last), None)
    assert p == diagnosis.Progress(1200, 2.31, 19.4, "2026-11-29T15:39:58Z")
    line = "step 120 | loss 2.314 | acc 0.61 | tau_tf 3.2 | 19.4 Ktok/s | queue 37/64 | drafters 3/3"
    p = diagnosis.progress_of(None, wire.Log(path=None, mtime=0, tail=("noise", line, "more noise")))
    assert p == diagnosis.Progress(120, 2.314, 19.4, "1970-01-01T00:00:00Z")
    assert diagnosis.progress_of(None, wire.Log(path=None, mtime=None, tail=("nothing",))) is None


def test_gpus_and_nvidia_smi_failures_are_reported() -> None:
    facts = copy.deepcopy(load("running")["facts"])
    facts["agent"]["gpus"] = [
        {
            "index": 5,
            "name": "NVIDIA H200",
            "memory_used_mib": 143602.0,
            "memory_total_mib": 143771.0,
            "utilization_pct": 0.0,
        }
    ]
    st = probe.classify(facts)
    assert st.to_json()["gpus"][0]["index"] == 5
    assert any(line.strip().startswith("gpu 5:") and "143602.0/143771.0 MiB, 0.0% util" in line for line in st.lines())
    facts["agent"]["gpus"] = {"error": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."}
    st = probe.classify(facts)
    assert st.gpus is None and any(e.startswith("nvidia-smi failed: NVIDIA-SMI has failed") for e in st.evidence)


def test_records_from_an_older_agent_are_checked_before_any_figure() -> None:
    """An agent from before the checked readers sends run.json / exit.json as they are on disk."""
    doc = load("crashed-nonzero-exit")
    facts = copy.deepcopy(doc["facts"])
    af = facts["agent"]["attempt"]
    af["run"].update(started_at=12345, pid="12", started_ts=float("nan"))
    af["exit"].update(exit_code=float("nan"), ended_at=["x"], ended_ts=1e400)
    af["stop"] = "not a record"
    st = probe.classify(facts)
    got = st.to_json()
    assert got["started_at"] is None and got["exit_code"] is None and got["ended_at"] is None, got
    text = "\n".join(got["evidence"])
    for line in ("run.json: started_at: expected a time", "exit.json: exit_code: expected a whole number"):
        assert line in text, text
    assert "stop.json: not a JSON object" in text, text
    json.dumps(got, allow_nan=False)  # no NaN reaches --json
    assert st.lines()


def test_a_mistyped_fact_of_the_agent_is_one_unreadable_record_line_not_a_figure_or_a_traceback() -> None:
    facts = copy.deepcopy(load("running")["facts"])
    facts["agent"]["attempt"]["child"]["pid"] = "109"  # a pid as a string: never shown as the run's pid
    facts["agent"]["attempt"]["members"] = ["junk"]
    facts["agent"]["tmux"]["panes"] = "junk"
    facts["agent"]["disk"] = {"path": "/r", "free": "lots", "full": False}
    st = probe.classify(facts)
    assert st.state == "running" and st.pid is None
    unreadable = [e for e in st.evidence if e.startswith("unreadable record: ")]
    assert unreadable == [
        "unreadable record: probe.attempt.child: pid: expected a whole number",
        "unreadable record: probe.attempt: members: expected a list of objects",
        "unreadable record: probe.disk: free: expected a whole number",
        "unreadable record: probe.tmux: panes: expected a list of objects",
    ]
    facts["agent"]["attempt"]["child"] = "alive"  # not an object at all
    st = probe.classify(facts)
    assert "unreadable record: probe.attempt.child: expected an object" in st.evidence
    assert st.state == "running" and st.pid == 8  # the runner is alive


def test_a_gpu_entry_that_is_no_object_is_named_and_the_status_still_prints() -> None:
    facts = copy.deepcopy(load("running")["facts"])
    gpu = {"index": 0, "name": "H200", "memory_used_mib": 1.0, "memory_total_mib": 2.0, "utilization_pct": 3.0}
    facts["agent"]["gpus"] = [gpu, "junk"]
    st = probe.classify(facts)
    assert st.to_json()["gpus"] == [gpu]
    assert "  gpu 0:     1.0/2.0 MiB, 3.0% util" in st.lines()
    assert "unreadable record: probe: gpus: expected a list of objects" in st.evidence


def test_the_trainer_s_diverged_line_is_its_verdict_only_with_its_exit_code_and_as_its_last_line() -> None:
    from dflash.train.divergence import Diverged

    line = Diverged(12, "grad-norm", "/r/checkpoints/step-10 (step 10)", "10 updates in a row skipped").line()
    d = diagnosis.diagnose(["step 11 | loss nan", line], exit_code=3, signal=None)
    assert (d.cause, d.detail) == ("diverged", line.removeprefix("dflash: "))
    assert diagnosis.last_finite_checkpoint(d.detail) == "/r/checkpoints/step-10 (step 10)"
    assert diagnosis.last_finite_checkpoint(Diverged(3, "loss", "none").line()) is None
    assert diagnosis.diagnose(["dflash: diverged at step 3: loss"], exit_code=1, signal=None).cause != "diverged"
    # a printed copy is a user's text: another exit code, or another line after it, is not the trainer's verdict
    planted = "dflash: diverged at step 2: loss not finite; last finite checkpoint: /etc (step 1)"
    crash = ["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: bad row"]
    assert diagnosis.diagnose([planted, *crash], exit_code=1, signal=None).cause == "python-exception"
    assert diagnosis.diagnose([planted, "step 3 | loss 1.0"], exit_code=3, signal=None).cause != "diverged"


def test_the_side_facts_are_typed_and_a_mistyped_key_is_one_unreadable_record_line() -> None:
    """The kernel logs, the checkpoint facts and the heartbeat are read as the rest of the wire: a key of the
    wrong type reads as absent and is named once, never a figure or a traceback."""
    facts = copy.deepcopy(load("crashed-gpu-fault")["facts"])
    agent = facts["agent"]
    agent["kernel"] = {"source": "dmesg", "lines": 5, "error": None}
    agent["checkpoints"] = {"dir": "/r/ck", "free": "lots", "checkpoints": [{"step": -1, "bytes": 3}], "record": 7}
    agent["supervisor"] = {"id": "a", "by": 5, "at": 1.0, "interval": 60, "pid": "812", "last_action": []}
    facts["host_kernel"]["lines"].append(3)
    st = probe.classify(facts)
    unreadable = [e for e in st.evidence if e.startswith("unreadable record: ")]
    assert unreadable == [
        "unreadable record: facts.host_kernel: lines: expected a list of strings",
        "unreadable record: probe.supervisor: by: expected a string",
        "unreadable record: probe.supervisor: pid: expected a whole number",
        "unreadable record: probe.supervisor: last_action: expected an object",
        "unreadable record: probe.kernel: lines: expected a list of strings",
        "unreadable record: probe.checkpoints: record: expected an object",
        "unreadable record: probe.checkpoints.checkpoints: step: expected a whole number >= 0",
        "unreadable record: probe.checkpoints: free: expected a whole number",
    ], unreadable
    assert st.cause != "gpu-fault"  # no kernel line read: the Xid is not there to see
    assert st.supervisor is not None and st.supervisor.by is None and st.supervisor.state == "stale"
    assert st.disk is not None and st.disk.free_bytes is None and st.disk.checkpoint_bytes is None


def test_a_recovered_cuda_oom_warning_is_not_the_cause_of_a_later_crash() -> None:
    warn = (
        "2026-12-02T00:01:02 WARNING dflash.train.pipeline: drafter-0 (cuda:1): CUDA out of memory. Tried to "
        "allocate 2.00 GiB at step 4; retrying once with the batch halved"
    )
    steps = [f"step {n} | loss 2.0 | acc 0.5 | 12.5 Ktok/s" for n in range(5, 43)]
    crash = ["Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: bad row"]
    d = diagnosis.diagnose([warn, *steps, *crash], exit_code=1, signal=None)
    assert (d.cause, d.detail) == ("python-exception", "ValueError: bad row")
    assert diagnosis.diagnose([*steps, warn], exit_code=1, signal=None).cause == "nonzero-exit"
