"""bench/gpu_smoke.py on the CPU: its arguments, the real pipeline tiny, the runner + probe path, its output.

The GPU half (compile, MFU, a real CUDA OOM) needs a GPU; ``--cpu`` runs the same code with compile off and
the injected OOM text, so a broken script is caught here. One run of ~25 s (a training run in-process and a
`dflash train` subprocess under the runner): the cost of testing the script end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def test_cpu_run_reports_every_figure_and_status_reads_the_oom() -> None:
    p = smoke("--cpu", "--quick", "--json", "--steps", "4")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["train_exit"] == 0 and r["steps"] == 4
    # the GPU configuration's vocabulary and MASK rule (the data held the published MASK id)
    assert (r["vocab_size"], r["mask_token_id"], r["mask_token_id_expected"]) == (151936, 151669, 151669)
    assert "vocabulary 151936, MASK id 151669" in p.stderr
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
    assert "step 4 |" in p.stderr  # the run's own log lines go to stderr with --json


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
