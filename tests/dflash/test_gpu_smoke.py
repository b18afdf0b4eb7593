"""bench/gpu_smoke.py and bench/device_check.sh on the CPU: their arguments, the real pipeline tiny, the runner
+ probe path, their output.

The GPU half (compile, MFU, a real CUDA OOM) needs a GPU; ``--cpu`` runs the same code with compile off and
the injected OOM text, so a broken script is caught here. ONE end-to-end run serves the module:
``bench/device_check.sh --cpu --steps 4`` (what a lent GPU box runs in one call: carried wheels, the flex
probe, then the smoke with its forced OOM, a `dflash train` subprocess under the runner), whose figures
file and log are the smoke's own ``--json`` object and report; the smoke's figures and the check's
plumbing are asserted on it by two tests (two runs cost ~40 s of CPU where this one costs ~25).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing as t
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def smoke(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_smoke", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def device_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "device_check.sh"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **(env or {})},
        cwd=ROOT,
    )


def tiny_wheel(folder: Path) -> Path:
    """A pure-Python wheel as pip downloads one (a module, METADATA, WHEEL, RECORD)."""
    folder.mkdir()
    path = folder / "carried_probe-1.0-py3-none-any.whl"
    files = {
        "carried_probe.py": "CARRIED = True\n",
        "carried_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: carried-probe\nVersion: 1.0\n",
        "carried_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "carried_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, "carried_probe-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return path


class Checked(t.NamedTuple):
    proc: subprocess.CompletedProcess[str]
    out: Path  # $OUT: flex_probe.json, gpu_smoke.json, gpu_smoke.log


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> Checked:
    """``bench/device_check.sh --cpu --steps 4`` with one carried wheel and $OUT: the whole check tiny on the
    CPU, the forced OOM included (~25 s of CPU on 2 idle cores; minutes on a shared, loaded box)."""
    root = tmp_path_factory.mktemp("device_check")
    tiny_wheel(root / "wheels")
    out = root / "out"
    p = device_check(
        "--cpu",
        "--steps",
        "4",
        # the probe's 60 s budget is for a GPU; on a loaded 2-core CI box its CPU compile took longer
        env={"OUT": str(out), "DEVICE_CHECK_WHEELS": str(root / "wheels"), "DEVICE_CHECK_PROBE_S": "500"},
    )
    return Checked(p, out)


@pytest.mark.timeout(900)  # the module's one device_check run: minutes on a shared, loaded box
def test_cpu_run_reports_every_figure_and_status_reads_the_oom(checked: Checked) -> None:
    p = checked.proc
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((checked.out / "gpu_smoke.json").read_text())
    log = (checked.out / "gpu_smoke.log").read_text()  # the smoke's stderr (its report, with --json)
    assert r["train_exit"] == 0 and r["steps"] == 4
    # the GPU configuration's vocabulary and MASK rule (the data held the published MASK id)
    assert (r["vocab_size"], r["mask_token_id"], r["mask_token_id_expected"]) == (151936, 151669, 151669)
    assert "vocabulary 151936, MASK id 151669" in log
    c = r["class_check"]  # dense attention on the CPU: the classes are the rows (1 and 2)
    assert c["classes"] == c["warmed"] == 2 and c["unchecked"] == [] and c["entries_added_by_feed"] == 0
    assert [b["ok"] for b in c["batches"]] == [True, True] and all(b["fed"] != b["warmed"] for b in c["batches"])
    assert r["ktok_s"] > 0 and r["drafter_step_s"] > 0 and r["drafter_step_tflop"] > 0
    assert r["mfu"] is None and r["peak_from"] == "cpu"  # no peak known for a CPU
    assert r["recompiles_after_warmup"] == 0 and r["compile_s"] is not None
    avg = r["averaging"]
    assert avg["replicas"] == 2 and not avg["copied_replica"]  # two real drafter replicas
    assert avg["bit_identical"] and avg["equals_cpu_mean"] and avg["copy_bound_s"] > 0 and avg["round_s"] > 0
    oom = r["oom"]
    assert (oom["state"], oom["cause"], oom["gpu"]) == ("crashed", "cuda-oom", 0), oom
    assert "CUDA out of memory" in oom["detail"] and oom["runner_exit"] not in (None, 0)
    assert {c["name"] for c in r["checks"]} >= {"training exited 0", "status: crashed / cuda-oom on GPU 0"}
    assert all(c["ok"] for c in r["checks"])
    assert "step 4 |" in log  # the run's own log lines go to stderr with --json


@pytest.mark.timeout(900)
def test_device_check_installs_the_carried_wheels_and_writes_its_figures_under_out(checked: Checked) -> None:
    """The whole check's plumbing, tiny on the CPU (``--cpu``): carried wheels installed into a folder of
    their own, the checkout imported without an install, the JSON under $OUT."""
    p, out = checked
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "device_check: installed 1 carried wheels: carried_probe-1.0-py3-none-any.whl"
    assert lines[1].startswith(f"device_check: python {sys.version.split()[0]}, torch {torch.__version__}")
    assert "device_check: ok   training exited 0" in lines
    # the probe first, then one line per part of the smoke
    assert lines[2:5] == [
        "flex_probe: cpu, capability None, shared memory per block (opt-in) None bytes",
        *(ln for ln in lines[3:5] if ln.startswith("flex_probe: ok   ")),
    ]
    assert "device_check: part flex probe: ok" in lines
    parts = [ln.split(" (")[0] for ln in lines if ln.startswith("device_check: part ") and "probe" not in ln]
    assert parts == [
        "device_check: part training: ok",
        "device_check: part averaging: ok",
        "device_check: part forced OOM: ok",
        "device_check: part class check: ok",
    ]
    probe = json.loads((out / "flex_probe.json").read_text())
    assert [c["ok"] for c in probe["cases"]] == [True, True]
    assert lines[-1] == f"device_check: figures in {out / 'gpu_smoke.json'} (exit 0)"
    r = json.loads((out / "gpu_smoke.json").read_text())
    assert r["vocab_size"] == 151936 and r["class_check"]["classes"] == 2 and all(c["ok"] for c in r["checks"])
    assert "vocabulary 151936, MASK id 151669" in (out / "gpu_smoke.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the check measures (minutes) instead")
def test_device_check_without_cuda_says_so_in_one_line() -> None:
    p = device_check()
    assert (p.returncode, p.stdout, p.stderr) == (0, "device_check: no CUDA device: nothing to check\n", "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the script measures (minutes) instead")
def test_without_cuda_it_says_so_in_one_line() -> None:
    p = smoke("--no-oom")
    assert (p.returncode, p.stdout, p.stderr) == (0, "no CUDA device: nothing to measure\n", "")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu", "--steps", "0"], "--steps must be at least 1, got 0"),
        (["--cpu", "--hidden", "100"], "--hidden must be a multiple of 64 (the head width), got 100"),
        (["--cpu", "--seq-len", "10"], "--seq-len must be at least twice --block-size (16), got 10"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    p = smoke(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines()[-1] == f"bench/gpu_smoke.py: error: {message}"


def test_help_documents_the_options() -> None:
    p = smoke("--help")
    assert p.returncode == 0
    for opt in (
        "--cpu",
        "--quick",
        "--json",
        "--steps",
        "--peak-tflops",
        "--oom-margin-gib",
        "--no-oom",
        "--keep",
        "MFU",
    ):
        assert opt in p.stdout, opt
