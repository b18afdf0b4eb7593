"""A GPU that failed in hardware: the driver's words (NVIDIA's Xid catalogue texts, as the kernel logs them)
in a log tail or a kernel log make a crash `gpu-fault`; the kernel log's reader (ops/far/kernel_log.py) with
a stand-in journalctl/dmesg on PATH; the policy gives up; doctor's gpu-health reads real `nvidia-smi -q`."""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ops import diagnosis, errors, gpu_health, probe
from ops.exit_codes import ExitCode, exit_code_for_error
from ops.far import kernel_log
from ops.hosts import parse_inventory
from ops.states import CAUSES, Cause, State
from ops.supervise.policy import GIVE_UP, WAIT, Options, Policy
from testkit.hostsfile import dump_hosts
from testkit.nvidia_smi import FakeGpu, report

TRACEBACK = [
    "step 41 | loss 2.1 | acc 0.5 | tau_tf 2.0 | 12.5 Ktok/s | queue 3/8 | drafters 1/1",
    "Traceback (most recent call last):",
    '  File "/root/dflash/dflash/train.py", line 88, in step',
    "    loss.backward()",
]
CUDA_LAUNCH = "RuntimeError: CUDA error: unspecified launch failure"
CUDA_ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
ASYNC = "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect."

# As the driver writes them (dmesg's stamp in front); texts from NVIDIA's Xid catalogue and published logs
XID = {
    79: "[ 8123.456789] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.",
    48: "[ 8123.456789] NVRM: Xid (PCI:0000:18:00): 48, pid=2345, name=python3, An uncorrectable double bit error "
    "(DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
    63: "[ 8123.456790] NVRM: Xid (PCI:0000:18:00): 63, pid=2345, name=python3, Row Remapper: New row "
    "(0x0000000000b8a4f0) marked for remapping, reset gpu to activate.",
    64: "[ 8123.456790] NVRM: Xid (PCI:0000:18:00): 64, pid=2345, name=python3, Row Remapper: Failed to remap row.",
    94: "[ 8123.456791] NVRM: Xid (PCI:0000:b3:00): 94, pid=3456, name=python, Contained: CE User Channel (0x9). "
    "RST: No, D-RST: No",
    95: "[ 8123.456791] NVRM: Xid (PCI:0000:b3:00): 95, pid='<unknown>', name=<unknown>, Uncontained: FBHUB. "
    "RST: Yes, D-RST: No",
    119: "[ 8123.456792] NVRM: Xid (PCI:0000:41:00): 119, pid=4567, name=python, Timeout after 6s of waiting for RPC "
    "response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20800a4c 0x4).",
    120: "[ 8123.456792] NVRM: Xid (PCI:0000:41:00): 120, pid=4567, name=python, GSP task timeout @ pc:0x4b3c, task: 1",
    154: "[ 8123.456793] NVRM: Xid (PCI:0000:04:00): 154, pid=1, name=python, GPU recovery action changed from 0x0 "
    "(None) to 0x1 (GPU Reset Required)",
}


def diag(lines: list[str], exit_code: int = 1) -> diagnosis.Diagnosis:
    return diagnosis.diagnose(lines, exit_code=exit_code, signal=None)


@pytest.mark.parametrize("xid", sorted(XID))
def test_each_hardware_xid_is_a_gpu_fault_that_outranks_the_exception(xid: int) -> None:
    d = diagnosis.find([XID[xid], CUDA_LAUNCH, ASYNC])  # a kernel log's lines
    assert d is not None and d.xid == xid
    assert d.bus_id == XID[xid].split("PCI:")[1].split(")")[0]
    assert d.text.startswith("NVRM: Xid") and d.fingerprint == f"gpu-fault|xid {xid}|{d.bus_id}"


def test_the_first_xid_is_the_cause_of_those_after_it() -> None:
    d = diagnosis.find([XID[48], XID[63], XID[94]])
    assert d is not None and d.xid == 48


@pytest.mark.parametrize(
    "line",
    [
        CUDA_ECC,
        "torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered",
        "CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered",
        "NCCL WARN Cuda failure 'uncorrectable ECC error encountered'",
        "[  412.1] NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
    ],
)
def test_the_cuda_texts_of_a_dead_gpu_are_a_gpu_fault_without_an_xid(line: str) -> None:
    f = diagnosis.find([line])
    assert f is not None and f.xid is None
    if "NVRM" in line:
        assert f.bus_id == "0000:3b:00"
    else:  # the program's own words: its last exception
        d = diag([*TRACEBACK, line, ASYNC])
        assert d.cause == (Cause.NONZERO_EXIT if line.startswith("NCCL") else Cause.GPU_FAULT) and d.xid is None


def test_an_unspecified_launch_failure_is_a_gpu_fault_only_beside_an_xid() -> None:
    assert diag([*TRACEBACK, CUDA_LAUNCH, ASYNC]).cause == Cause.PYTHON_EXCEPTION
    app_xid = "NVRM: Xid (PCI:0000:3b:00): 13, pid=1234, name=python, Graphics SM Warp Exception on (GPC 0, TPC 0)"
    assert diag([*TRACEBACK, "RuntimeError: CUDA error: an illegal memory access", app_xid]).cause != Cause.GPU_FAULT
    f = diagnosis.find([app_xid, CUDA_LAUNCH])
    assert f is not None and (f.xid, f.line) == (13, CUDA_LAUNCH)


def test_a_recovery_that_needs_nothing_is_no_fault() -> None:
    ok = "NVRM: Xid (PCI:0000:04:00): 154, pid=1, name=x, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
    assert diag([*TRACEBACK, "KeyError: 'x'", ok]).cause == Cause.PYTHON_EXCEPTION


def test_gpu_fault_is_a_crashed_cause_and_its_headline_names_gpu_and_xid() -> None:
    assert Cause.GPU_FAULT in CAUSES[State.CRASHED]
    st = probe.Status("pve", "dflash", State.CRASHED, cause=Cause.GPU_FAULT, gpu=3, gpu_bus_id="0000:3b:00", xid=79)
    st.exit_code = 1
    assert st.headline() == "crashed: GPU fault: Xid 79 (fallen off the bus) on GPU 3 (PCI 0000:3b:00) (exit 1)"
    assert {"gpu": 3, "gpu_bus_id": "0000:3b:00", "xid": 79}.items() <= st.to_json().items()


def _facts(tail: list[str], host_kernel: dict[str, object] | None, gpus: list[dict[str, object]] | None) -> dict:
    run = {"pid": 10, "child_pid": 11, "started_ts": 1000.0, "started_at": "2026-11-29T16:00:00Z", "attempt": 1}
    ended = {"exit_code": 1, "signal": None, "ended_at": "2026-11-29T16:26:03Z"}
    facts = {
        "host": "pve",
        "session": "dflash",
        "checked_at": 2000.0,
        "agent": {
            "now": 2000.0,
            "gpus": gpus,
            "kernel": {
                "source": None,
                "lines": [],
                "error": "dmesg: read kernel buffer failed: Operation not permitted",
            },
            "attempt": {"attempt": 1, "dir": "/r/attempt-1", "run": run, "exit": ended, "log": {"tail": tail}},
        },
    }
    if host_kernel is not None:
        facts["host_kernel"] = host_kernel
    return facts


def test_the_host_kernel_log_turns_a_cuda_exception_into_a_gpu_fault_on_the_gpu_nvidia_smi_names() -> None:
    gpus = [
        {"index": 0, "pci_bus_id": "00000000:18:00.0"},
        {"index": 1, "pci_bus_id": "00000000:3B:00.0"},
    ]
    journal = f"2026-11-29T16:26:02+0000 pve kernel: {XID[79].split('] ', 1)[1]}"
    st = probe.classify(_facts([*TRACEBACK, CUDA_LAUNCH, ASYNC], {"lines": [journal], "error": None}, gpus))
    assert (st.state, st.cause, st.xid, st.gpu_bus_id, st.gpu) == (State.CRASHED, Cause.GPU_FAULT, 79, "0000:3b:00", 1)
    assert f"the host's kernel log: {journal}" in st.evidence
    assert f"the program's last error (python-exception): {CUDA_LAUNCH}" in st.evidence

    # nothing from the driver: the container's refused dmesg is said, the cause stays the exception
    st = probe.classify(_facts([*TRACEBACK, CUDA_LAUNCH, ASYNC], {"lines": [], "error": None}, gpus))
    assert st.cause == Cause.PYTHON_EXCEPTION
    assert any("container's kernel log could not be read (dmesg: read kernel buffer failed" in e for e in st.evidence)


# --------------------------------------------------------------------------------------------
# The kernel log's reader, with stand-ins on PATH


def _bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **scripts: str) -> None:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (d / name).write_text(f"#!/bin/sh\n{body}\n")
        (d / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(d))  # nothing else: a missing one is really missing


def test_journalctl_gives_the_nvrm_lines_since_the_attempt_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = tmp_path / "args"
    _bin(
        tmp_path,
        monkeypatch,
        journalctl=f'echo "$@" > {args}\n'
        "echo '2026-12-02T00:31:00+0000 pve kernel: mlx5_core 0000:ab:00.0: Port: 1 Link ACTIVE'\n"
        f"echo '2026-12-02T00:31:02+0000 pve kernel: {XID[79].split('] ', 1)[1]}'",
    )
    got = kernel_log.read(1795999999.7)
    assert (
        got["source"] == "journalctl" and got["error"] is None and len(got["lines"]) == 1 and "Xid" in got["lines"][0]
    )
    assert args.read_text().split() == [
        "-k",
        "--since",
        "@1795999999",
        "-o",
        "short-iso",
        "--no-pager",
        "--grep",
        "NVRM",
    ]


def test_no_readable_kernel_log_is_no_evidence_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _bin(tmp_path, monkeypatch)
    assert kernel_log.read(0.0) == {"source": None, "lines": [], "error": "no journalctl or dmesg"}
    _bin(
        tmp_path,
        monkeypatch,
        journalctl="echo 'No journal files were found.' >&2; echo '-- No entries --'",
        dmesg="echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1",
    )
    got = kernel_log.read(0.0)
    assert got["lines"] == [] and got["error"] == (
        "journalctl: No journal files were found.; dmesg: dmesg: read kernel buffer failed: Operation not permitted"
    )


def test_dmesg_lines_before_the_attempt_are_not_its_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    old, new = (time.strftime("%Y-%m-%dT%H:%M:%S,000000+00:00", time.gmtime(x)) for x in (now - 7200, now))
    _bin(
        tmp_path,
        monkeypatch,
        dmesg=f"echo '{old} {XID[48].split('] ', 1)[1]}'; echo '{new} {XID[79].split('] ', 1)[1]}'",
    )
    got = kernel_log.read(now - 60)
    assert got["source"] == "dmesg" and [x.split(": ")[2][:2] for x in got["lines"]] == ["79"]


STORM = "2026-12-02T00:31:02+0000 pve kernel: NVRM: Xid (PCI:0000:41:00): 13, pid=4242, name=python, Graphics "
STORM += "Exception: ESR 0x504648=0x80000000 0x504650=0x0 0x504644=0xd3eff2 0x50464c=0x17f"
PROBE = (
    "import time, json; from ops.far import kernel_log; t0 = time.monotonic(); got = kernel_log.read(0.0); "
    "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0].split()[1]; "  # peak RSS, KiB
    "print(json.dumps({'got': got, 's': time.monotonic() - t0, 'rss': int(hwm)}))"
)
ROOT = Path(kernel_log.__file__).resolve().parents[2]
PROBE_MEMORY = 400 << 20  # the probe's address space (prlimit --as): the whole 534 MB log cannot fit in it


def test_an_xid_storm_of_hundreds_of_mb_is_streamed_in_bounded_memory_and_time_its_writer_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 534 MB kernel log of one application Xid repeated (as a storm writes it): read at every probe of a
    crashed run, it cost 1.2-1.7 GB and 8-13 s when held whole. Streamed: the first lines kept, the reading
    stopped at the cap and the writer killed before it finished."""
    done = tmp_path / "finished"
    _bin(
        tmp_path,
        monkeypatch,
        journalctl=f'echo "$@" > {tmp_path / "args"}\nyes {shlex.quote(STORM)} | head -c 534000000\necho > {done}',
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"}
    argv = ["prlimit", f"--as={PROBE_MEMORY}", "--", sys.executable, "-c", PROBE]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    got = res["got"]
    assert got["source"] == "journalctl" and got["error"] is None
    assert len(got["lines"]) == kernel_log.MAX_LINES and all(": 13, pid=4242" in x for x in got["lines"])
    assert res["rss"] < 100 << 10, res  # KiB: the whole log is 534 MB
    assert res["s"] < 5.0, res
    time.sleep(0.5)
    assert not done.exists()  # killed at the cap, not read to its end
    assert "--grep NVRM" in (tmp_path / "args").read_text()  # the journal asked for the driver's lines only


def test_a_storm_on_one_gpu_does_not_hide_another_gpus_xid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's log is every container's: another container's storm fills the first lines, this run's Xid
    (another GPU) comes after them and is kept; so is a line with no newline, cut."""
    ours = f"2026-12-02T00:31:09+0000 pve kernel: {XID[79].split('] ', 1)[1]}"
    _bin(
        tmp_path,
        monkeypatch,
        journalctl=f"yes {shlex.quote(STORM)} | head -n 3000\necho {shlex.quote(ours)}\n"
        "head -c 10000000 /dev/zero | tr '\\0' N",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # the stand-in's yes and head
    got = kernel_log.read(0.0)
    assert got["lines"][-1] == ours and len(got["lines"]) == kernel_log.MAX_LINES + 1
    assert all(len(x) <= kernel_log.MAX_CHARS for x in got["lines"])


def test_journalctl_without_pattern_matching_is_asked_again_and_no_match_is_an_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    xid = f"2026-12-02T00:31:02+0000 pve kernel: {XID[79].split('] ', 1)[1]}"
    _bin(
        tmp_path,
        monkeypatch,
        journalctl='case "$*" in *--grep*) echo "Compiled without pattern matching support" >&2; exit 1;; esac\n'
        f"echo {shlex.quote(xid)}",
    )
    assert kernel_log.read(0.0) == {"source": "journalctl", "lines": [xid], "error": None}
    # journalctl --grep exits 1 when nothing matched, as grep does: no Xid, not an unreadable log
    _bin(tmp_path, monkeypatch, journalctl="echo '-- No entries --'; exit 1", dmesg="exit 1")
    assert kernel_log.read(0.0) == {"source": "journalctl", "lines": [], "error": None}


def test_dmesg_is_read_to_its_end_where_the_attempts_lines_are(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dmesg prints the ring oldest first: the attempt's Xid comes after more lines than journalctl's cap."""
    now = time.time()
    old, new = (time.strftime("%Y-%m-%dT%H:%M:%S,000000+00:00", time.gmtime(x)) for x in (now - 7200, now))
    many = kernel_log.MAX_READ_LINES + 10
    _bin(
        tmp_path,
        monkeypatch,
        dmesg=f"yes {shlex.quote(old + ' usb 1-1: new device')} | head -n {many}\necho '{new} {XID[79].split('] ', 1)[1]}'",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # the stand-in's yes and head
    monkeypatch.setattr(
        kernel_log.shutil, "which", lambda name: str(tmp_path / "bin" / name) if name == "dmesg" else None
    )
    got = kernel_log.read(now - 60)
    assert got["source"] == "dmesg" and len(got["lines"]) == 1 and ": 79, pid=1234" in got["lines"][0]


def test_a_journal_cut_at_the_cap_before_any_nvrm_line_is_said_not_taken_for_no_xid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bin(
        tmp_path,
        monkeypatch,
        journalctl='case "$*" in *--grep*) echo "journalctl: unrecognized option \'--grep\'" >&2; exit 1;; esac\n'
        f"yes 'pve kernel: usb 1-1: new device' | head -n {kernel_log.MAX_READ_LINES + 10}\n"
        f"echo {shlex.quote(XID[79])}",
        dmesg="echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    monkeypatch.setattr(kernel_log.shutil, "which", lambda name: str(tmp_path / "bin" / name))
    got = kernel_log.read(0.0)
    assert got["lines"] == [] and got["error"] == (
        "journalctl: stopped at the cap of what is read, no NVRM line before it; "
        "dmesg: dmesg: read kernel buffer failed: Operation not permitted"
    )


def test_a_kernel_log_reader_that_hangs_is_killed_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bin(tmp_path, monkeypatch, journalctl="exec /bin/sleep 30", dmesg="exit 1")
    monkeypatch.setattr(kernel_log, "TIMEOUT", 0.5)
    t0 = time.monotonic()
    got = kernel_log.read(0.0)
    assert time.monotonic() - t0 < 5 and got["lines"] == [] and "did not answer within 0.5s" in got["error"]


def test_the_kernel_log_is_read_for_an_attempt_that_failed_only() -> None:
    run = {"started_ts": 5.0}
    assert kernel_log.since_failed({"run": run, "exit": {"exit_code": 1}}) == 5.0
    assert kernel_log.since_failed({"run": run, "exit": {"exit_code": None, "signal": 9}}) == 5.0
    assert kernel_log.since_failed({"run": run, "exit": {"exit_code": 0}}) is None
    assert kernel_log.since_failed({"run": run, "exit": None}) is None
    assert kernel_log.since_failed({"run": {"started_ts": float("nan")}, "exit": {"exit_code": 1}}) is None


# --------------------------------------------------------------------------------------------
# The policy


def test_the_supervisor_never_restarts_into_a_failed_gpu() -> None:
    st = probe.Status("pve", "dflash", State.CRASHED, cause=Cause.GPU_FAULT, attempt=2, gpu=1, xid=79)
    st.exit_code, st.gpu_bus_id = 1, "0000:3b:00"
    d = Policy(Options(), rng=random.Random(1)).observe(st, 100.0)
    assert d.action == GIVE_UP and d.new
    assert "not restarted into a failed GPU: crashed: GPU fault: Xid 79 (fallen off the bus) on GPU 1" in d.reason
    watching = Policy(Options(), rng=random.Random(1), keep_watching=True)
    assert watching.observe(st, 100.0).action == GIVE_UP
    again = watching.observe(st, 130.0)
    assert again.action == WAIT and "gave up on attempt 2 (GPU fault)" in again.reason
    assert exit_code_for_error(errors.GpuFaultGiveUp("x")) == ExitCode.GPU_FAULT == 13


# --------------------------------------------------------------------------------------------
# doctor's gpu-health, from real `nvidia-smi -q -d ECC,ROW_REMAPPER,PERFORMANCE` texts


@pytest.mark.parametrize("driver", ["535.129.03", "470.223.02"])
def test_gpu_health_judges_each_gpu(driver: str) -> None:
    text = report(
        [
            FakeGpu("00000000:18:00.0"),
            FakeGpu("00000000:3B:00.0", volatile_dram_uncorrectable=2, aggregate_dram_uncorrectable=2),
            FakeGpu("00000000:86:00.0", aggregate_dram_uncorrectable=1, remap_pending=True),
            FakeGpu("00000000:AF:00.0", thermal_slowdown=True),
            FakeGpu("00000000:D8:00.0", remap_failed=True),
        ],
        driver=driver,
    )
    got = gpu_health.parse(text)
    assert [(g.index, g.bus_id, g.status) for g in got] == [
        (0, "00000000:18:00.0", "ok"),
        (1, "00000000:3B:00.0", "fail"),
        (2, "00000000:86:00.0", "warn"),
        (3, "00000000:AF:00.0", "warn"),
        (4, "00000000:D8:00.0", "fail"),
    ]
    assert got[0].line() == "GPU 0 (00000000:18:00.0): ok"  # "SW Power Cap: Active" is a GPU at work, not a fault
    assert "2 uncorrectable ECC error(s) since the driver loaded" in got[1].line()
    assert got[2].why == (
        "1 uncorrectable ECC error(s) in its lifetime",
        "a row remap is pending: reset the GPU to apply it",
    )
    assert got[3].why == ("clocks slowed: HW Slowdown, HW Thermal Slowdown",)
    assert got[4].why == ("a row remapping failed (the GPU needs service)",)


def test_doctor_says_gpu_health_per_gpu_through_the_fake_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ops import doctor
    from testkit.nvidia_smi import install

    gpus = [FakeGpu("00000000:18:00.0"), FakeGpu("00000000:3B:00.0", remap_failed=True)]
    install(tmp_path / "bin", [*gpus, FakeGpu("00000000:5E:00.0", lost=True)])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    text = dump_hosts(None, {"l": {"transport": "local", "workdir": str(tmp_path / "w"), "command": "true"}})
    rep = doctor.diagnose(parse_inventory(text, path=None, base=tmp_path).get())
    health = next(c for c in rep.checks if c.name == "gpu-health")
    # the lost GPU's line (stderr, exit 15) is a verdict of its own, not "nvidia-smi failed"
    assert health.status == "fail" and health.detail.split("\n") == [
        "GPU 0 (00000000:18:00.0): ok",
        "GPU 1 (00000000:3B:00.0): fail: a row remapping failed (the GPU needs service)",
        "GPU ? (00000000:5E:00.0): fail: does not answer: Unknown Error",
    ]
    text = rep.render().splitlines()
    at = next(i for i, x in enumerate(text) if "gpu-health" in x)
    assert text[at].split()[:2] == ["FAIL", "gpu-health"] and text[at + 1].strip() == health.detail.split("\n")[1]


def test_the_give_up_incident_and_its_notification_name_the_gpu_and_the_xid() -> None:
    from ops.notify import message_for
    from ops.supervise.state import incident_for

    st = probe.Status("pve", "dflash", State.CRASHED, cause=Cause.GPU_FAULT, attempt=2, gpu=1, xid=48)
    st.exit_code, st.gpu_bus_id, st.detail = 1, "0000:18:00", XID[48].split("] ", 1)[1]
    d = Policy(Options(), rng=random.Random(1)).observe(st, 100.0)
    inc = incident_for(st, d, 100.0, restarts=0, opts=Options())
    assert (inc["action"], inc["cause"], inc["gpu"], inc["gpu_bus_id"], inc["xid"]) == (
        "give-up",
        "gpu-fault",
        1,
        "0000:18:00",
        48,
    )
    msg = message_for(inc)
    assert msg.title.startswith(
        "dflash pve/dflash: gave up: not restarted into a failed GPU: crashed: GPU fault: Xid 48 (uncorrectable ECC "
        "error (double bit, DBE)) on GPU 1 (PCI 0000:18:00)"
    )
    assert "crashed (gpu-fault), attempt 2: NVRM: Xid (PCI:0000:18:00): 48" in msg.body and msg.level == "failure"


def test_a_session_started_by_hand_names_the_xid_its_pane_shows() -> None:
    """No run record: the pane's text is the log, and its Xid and bus id reach the Status as a run's do."""
    pane = {"pane_pid": "77", "pane_dead": "1", "pane_dead_status": "1", "pane_dead_signal": ""}
    facts = {
        "host": "pve",
        "session": "dflash",
        "checked_at": 2000.0,
        "agent": {
            "now": 2000.0,
            "tmux": {"exit_code": 0, "panes": [pane]},
            "pane_capture": {"lines": [*TRACEBACK, CUDA_LAUNCH]},
            "kernel": {"source": "dmesg", "lines": [XID[95]], "error": None},
            "attempt": None,
        },
    }
    st = probe.classify(facts)
    assert (st.state, st.cause, st.xid, st.gpu_bus_id) == (State.CRASHED, Cause.GPU_FAULT, 95, "0000:b3:00")


def test_a_printed_driver_text_is_a_user_s_text_not_a_gpu_fault() -> None:
    """A data sample that holds the driver's words, then an unrelated crash: the crash is the exception's."""
    sample = "sample 12: 'uncorrectable ECC error encountered' / NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus."
    lines = [*TRACEBACK[:1], sample, *TRACEBACK[1:], "ValueError: bad row"]
    assert diag(lines).cause == Cause.PYTHON_EXCEPTION
    st = probe.classify(_facts(lines, None, None))
    assert (st.state, st.cause) == (State.CRASHED, Cause.PYTHON_EXCEPTION), st.lines()


def test_an_xid_of_another_container_s_gpu_is_not_this_run_s() -> None:
    """The host's kernel log holds every container's Xids: only this run's GPUs (bus id) or pids count."""
    gpus = [{"index": 0, "pci_bus_id": "00000000:18:00.0"}]
    other = "2026-11-29T16:26:02+0000 pve kernel: " + XID[79].split("] ", 1)[1]  # 0000:3b:00, pid 1234
    kernel = {"source": "journalctl", "lines": [other], "error": None}
    st = probe.classify(_facts([*TRACEBACK, CUDA_LAUNCH, ASYNC], kernel, gpus))
    assert (st.state, st.cause, st.xid) == (State.CRASHED, Cause.PYTHON_EXCEPTION, None), st.lines()
    assert any("not this run's" in e for e in st.evidence), st.evidence
    facts = _facts([*TRACEBACK, CUDA_LAUNCH, ASYNC], kernel, [{"index": 1, "pci_bus_id": "00000000:3B:00.0"}])
    assert probe.classify(facts).xid == 79  # the run's own GPU: its fault


# ---------------------------------------------------------------------------------------------
# --on-gpu-fault exclude: the policy, the health check before the restart, the messages


def _fault(attempt: int, bus: str | None = "0000:18:00") -> probe.Status:
    st = probe.Status("pve", "dflash", State.CRASHED, cause=Cause.GPU_FAULT, attempt=attempt, gpu=1, xid=48)
    st.exit_code, st.gpu_bus_id, st.detail = 1, bus, XID[48].split("] ", 1)[1]
    st.fingerprint = f"gpu-fault|xid 48|{bus}"
    return st


def test_on_gpu_fault_exclude_restarts_once_per_gpu_and_gives_up_when_nothing_is_left() -> None:
    opts = Options(on_gpu_fault="exclude", backoff=0)
    p = Policy(opts, rng=random.Random(1))
    d = p.observe(_fault(2), 100.0)
    assert d.action == "restart" and d.reason.startswith("GPU 0000:18:00.0 excluded (--on-gpu-fault exclude); restart")
    p.recovered(100.0, d.action, attempt=3)
    p.excluded = {"0000:18:00.0": 2}  # what the loop wrote before the start, read back at the next probe
    again = p.observe(_fault(3), 200.0)
    assert again.action == GIVE_UP and again.reason.startswith(
        "a second fault on GPU 0000:18:00.0, which the run already leaves out (excluded after attempt 2)"
    )
    # the same crash judged again (the supervisor restarted before its restart): still a restart
    q = Policy(opts, rng=random.Random(1))
    q.excluded = {"0000:18:00.0": 2}
    assert q.observe(_fault(2), 100.0).action == "restart"
    assert (
        Policy(opts)
        .observe(_fault(2, bus=None), 1.0)
        .reason.endswith(
            "the driver named no PCI bus id, so no GPU can be left out (--on-gpu-fault exclude): reset the GPU or "
            "reboot the host, then `dflashctl start`"
        )
    )
    # the trainer's own line: the excluded GPUs leave no drafter -> give up as a GPU fault (exit 13)
    line = (
        "dflash: DFLASH_EXCLUDED_GPUS=0000:18:00.0 leaves no drafter device of 4 targets ['cuda:0'] + 1 drafters "
        "['cuda:1'] (excluded: cuda:1 (0000:18:00.0)); the run cannot start"
    )
    st = probe.Status("pve", "dflash", State.CRASHED, cause=Cause.NONZERO_EXIT, attempt=4, exit_code=1, detail=line)
    d = Policy(opts).observe(st, 1.0)
    assert (d.action, d.kind) == (GIVE_UP, "gpu-fault") and "no GPU left for the run" in d.reason
    st.exit_code = 2
    assert Policy(opts).observe(st, 1.0).action == "restart"  # not the trainer's verdict (exit 1)
    with pytest.raises(errors.ConfigError) as e:
        Options(on_gpu_fault="skip")
    assert e.value.path == "--on-gpu-fault"


def test_before_the_restart_the_failed_gpu_and_any_gpu_the_health_check_fails_are_excluded_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ops.remote import connect
    from ops.supervise import Supervisor
    from ops.supervise.exclusions import Exclusions
    from ops.supervise.loop import gpu_check
    from testkit.nvidia_smi import install

    gpus = [
        FakeGpu("00000000:18:00.0"),
        FakeGpu("00000000:3B:00.0", volatile_dram_uncorrectable=2),
        FakeGpu("00000000:5E:00.0"),
    ]
    install(tmp_path / "bin", gpus)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    text = dump_hosts(None, {"l": {"transport": "local", "workdir": str(tmp_path / "w"), "command": "true"}})
    host = parse_inventory(text, path=None, base=tmp_path).get()
    sup = Supervisor(host, "s", Options(on_gpu_fault="exclude"), state_dir=tmp_path / "state", emit=lambda _: None)
    inc: dict[str, object] = {}
    added, excluded = sup._exclude(connect(host), _fault(2), inc)
    assert [(e.bus_id, e.xid, e.attempt) for e in added] == [("0000:18:00.0", 48, 2), ("0000:3b:00.0", None, 2)]
    assert added[1].why == "gpu-health: 2 uncorrectable ECC error(s) since the driver loaded (reset the GPU)"
    assert inc["excluded_gpus"] == ["0000:18:00.0", "0000:3b:00.0"] and excluded == added
    assert inc["gpu_health"] == [
        "gpu-health: GPU 0 (00000000:18:00.0): ok",
        "gpu-health: GPU 1 (00000000:3B:00.0): fail: 2 uncorrectable ECC error(s) since the driver loaded (reset the GPU)",
        "gpu-health: GPU 2 (00000000:5E:00.0): ok",
    ]
    # a GPU that does not answer: nvidia-smi exits 15 with its line on stderr and still judges the others
    install(tmp_path / "bin", [*gpus, FakeGpu("00000000:AF:00.0", lost=True)])
    found, said = gpu_check(connect(host))
    assert [(g.index, g.bus_id, g.status) for g in found][-1] == (None, "00000000:AF:00.0", "fail")
    assert said[-1] == "gpu-health: GPU ? (00000000:AF:00.0): fail: does not answer: Unknown Error"
    kept = Exclusions(tmp_path / "state" / "supervise" / "l.s", "l", "s")
    assert kept.load() == tuple(added) and (kept.path.stat().st_mode & 0o777) == 0o600
    # a crash of another kind later: no check, nothing added, the next attempt still runs without them
    other = probe.Status("l", "s", State.CRASHED, cause=Cause.PYTHON_EXCEPTION, attempt=3, exit_code=1)
    assert sup._exclude(connect(host), other, {}) == ([], list(added))
    assert [e.bus_id for e in kept.include("3b:00")] == ["0000:3b:00.0"]
    assert [e.bus_id for e in kept.load()] == ["0000:18:00.0"]


def test_the_restart_message_says_which_gpu_the_next_attempt_runs_without() -> None:
    from ops.notify import message_for
    from ops.supervise.state import incident_for

    opts = Options(on_gpu_fault="exclude")
    st = _fault(2)
    inc = incident_for(st, Policy(opts).observe(st, 1.0), 1.0, restarts=0, opts=opts)
    inc.update(outcome="done", next_attempt=3, excluded="GPU 0000:18:00.0 (Xid 48) excluded; attempt 3 runs without it")
    inc["gpu_health"] = ["gpu-health: GPU 0 (00000000:18:00.0): ok"]
    msg = message_for(inc)
    assert msg.title.endswith("; GPU 0000:18:00.0 (Xid 48) excluded; attempt 3 runs without it"), msg.title
    assert "gpus: GPU 0000:18:00.0 (Xid 48) excluded; attempt 3 runs without it\n  gpu-health: GPU 0" in msg.body
