"""The compile gate (``python -m bench.cross_compile``) on a CUDA build of torch, no GPU: the flex kernels of the
compiled drafter step fit the RTX PRO 6000's (sm_120) 101,376 bytes per block at head dims 128 and 256 (the
targets users train for; head dim 64, the tiny models', is the bench's: ~40 s of CPU here for no new risk) with
the project's tiles, torch's own backward tile at head dim 256 does not (the gate can fail, and the override is
why a head-dim-256 drafter trains there), and ``compile.flex_*_smem``'s estimate stays above every measured
figure (the tiles are chosen by it).

Runs in .venv-cuda (scripts/floor-venv cuda: torch 2.14.1+cu130 from the wheel on this machine's disk); where
that wheel is not on disk the tests skip saying so, and under CI=true a missing .venv-cuda beside the wheel fails.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from dflash.train.compile import flex_bwd_smem, flex_fwd_smem

REPO = Path(__file__).resolve().parents[2]
SM120 = 101_376

# The gate's process: ~120 s of CPU (torch 2.14.1, one core), and on a machine shared by others its wall time
# is theirs to decide, so the guard is its CPU time (RLIMIT_CPU) and the wall limits are far above it.
GATE_CPU_S = 600
# one worker for the module (scripts/test: --dist loadgroup), so the module's one gate process runs once
pytestmark = [pytest.mark.timeout(3600), pytest.mark.xdist_group("cross_compile")]


def cuda_wheel() -> Path:
    """The CUDA torch wheel scripts/floor-venv builds .venv-cuda from (its CUDA_TORCH line: one place)."""
    m = re.search(r"^CUDA_TORCH=(\S+)$", (REPO / "scripts" / "floor-venv").read_text(), re.M)
    assert m, "scripts/floor-venv names no CUDA_TORCH"
    return Path(m.group(1))


@pytest.fixture(scope="module")
def cuda_python() -> str:
    python = REPO / ".venv-cuda" / "bin" / "python"
    if not os.access(python, os.X_OK):
        reason = f"{python} does not exist (scripts/floor-venv cuda builds it)"
        if not cuda_wheel().is_file():
            pytest.skip(f"{cuda_wheel()} is not on this machine: no CUDA torch to run the gate with")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason)
    return str(python)


CASES = ("128", "256", "256:torch-default")


@pytest.fixture(scope="module")
def gate(cuda_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, list[dict[str, t.Any]], str]:
    """One gate process for every row the tests read (torch's and Triton's start-up paid once: CPU time)."""
    out = tmp_path_factory.mktemp("gate") / "rows.json"
    argv = [cuda_python, "-m", "bench.cross_compile", "--capability", "12.0", "--only", "flex", "--shapes", "1"]
    argv += [*(a for c in CASES for a in ("--case", c)), "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def cpu_limit() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (GATE_CPU_S, GATE_CPU_S + 10))

    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=3000, preexec_fn=cpu_limit)
    rows = json.loads(out.read_text()) if out.is_file() else []
    text = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "Traceback" not in text, text
    return proc.returncode, rows, text


def estimate(row: dict[str, t.Any]) -> int:
    tile = [int(x) for x in re.findall(r"\d+", row["tile"])]
    if row["kind"] == "flex fwd":
        return flex_fwd_smem(tile[0], tile[1], row["stages"], row["head_dim"])
    return flex_bwd_smem(tile[0], tile[1], row["stages"], row["head_dim"])


@pytest.mark.parametrize("head_dim", [128, 256])
def test_the_flex_kernels_fit_sm120_with_the_projects_tiles(
    gate: tuple[int, list[dict[str, t.Any]], str], head_dim: int
) -> None:
    _, all_rows, out = gate
    rows = [r for r in all_rows if r["head_dim"] == head_dim and r["options"] == "project"]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"flex fwd", "flex bwd"}, out
    for r in rows:
        assert r["ok"] and r["limit"] == SM120 and 0 < r["shared"] <= SM120, r
        assert r["registers"] is not None and r["spill_bytes"] is not None, r  # cuobjdump read the cubin
        # the tiles are chosen by the estimate: it must stay above what Triton really takes
        assert estimate(r) >= r["shared"], (r, estimate(r))


def test_torchs_own_backward_tile_at_head_dim_256_exceeds_sm120(gate: tuple[int, list[dict[str, t.Any]], str]) -> None:
    rc, all_rows, out = gate
    assert rc == 1, out
    rows = [r for r in all_rows if r["options"] == "torch-default"]
    assert rows and all(r["head_dim"] == 256 for r in rows), out
    bad = [r for r in all_rows if not r["ok"]]
    assert bad and all(r["options"] == "torch-default" for r in bad), out  # the only failures: torch's tiles
    assert {r["kind"] for r in bad} == {"flex bwd"}, out
    assert all(r["shared"] > SM120 and "exceeds" in r["error"] for r in bad), bad
    assert "head dim 256 flex bwd" in out and "exceeds the device's 101,376 B" in out, out
    assert all(estimate(r) >= r["shared"] for r in rows), rows


def test_a_cpu_torch_is_told_in_one_line_which_torch_the_gate_needs() -> None:
    import torch

    if torch.version.cuda:
        pytest.skip("this interpreter's torch is a CUDA build")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cross_compile"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and "CPU build" in proc.stderr and "CUDA build of torch" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--case", "256:ours"], "argument --case: '256:ours': want HEAD_DIM or HEAD_DIM:project|torch-default"),
        (["--set", "bwd_num_warps=x"], "argument --set: 'bwd_num_warps=x': want KEY=INT, KEY a flex tile option"),
    ],
)
def test_a_bad_case_or_tile_option_is_one_line_before_any_compile(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cross_compile", *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.strip().splitlines()[-1].startswith(f"python -m bench.cross_compile: error: {message}"), proc
