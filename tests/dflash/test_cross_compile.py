"""The compile gate (``python -m bench.cross_compile``) on a CUDA build of torch, no GPU: the flex kernels of the
compiled drafter step fit the RTX PRO 6000's (sm_120) 101,376 bytes per block at head dims 64, 128 and 256 with
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
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from dflash.train.compile import flex_bwd_smem, flex_fwd_smem

REPO = Path(__file__).resolve().parents[2]
SM120 = 101_376

pytestmark = pytest.mark.timeout(900)


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


def gate(python: str, tmp: Path, head_dim: int, *extra: str) -> tuple[int, list[dict[str, t.Any]], str]:
    out = tmp / f"rows-{head_dim}-{len(extra)}.json"
    argv = [python, "-m", "bench.cross_compile", "--capability", "12.0", "--head-dim", str(head_dim)]
    argv += ["--only", "flex", "--shapes", "1", "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=800)
    rows = json.loads(out.read_text()) if out.is_file() else []
    return proc.returncode, rows, proc.stdout[-3000:] + proc.stderr[-3000:]


def estimate(row: dict[str, t.Any], head_dim: int) -> int:
    tile = [int(x) for x in re.findall(r"\d+", row["tile"])]
    if row["kind"] == "flex fwd":
        return flex_fwd_smem(tile[0], tile[1], row["stages"], head_dim)
    return flex_bwd_smem(tile[0], tile[1], row["stages"], head_dim)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_flex_kernels_fit_sm120_with_the_projects_tiles(cuda_python: str, tmp_path: Path, head_dim: int) -> None:
    rc, rows, out = gate(cuda_python, tmp_path, head_dim)
    assert rc == 0, out
    kinds = {r["kind"] for r in rows}
    assert kinds == {"flex fwd", "flex bwd"}, out
    for r in rows:
        assert r["ok"] and r["limit"] == SM120 and 0 < r["shared"] <= SM120, r
        assert r["registers"] is not None and r["spill_bytes"] is not None, r  # cuobjdump read the cubin
        # the tiles are chosen by the estimate: it must stay above what Triton really takes
        assert estimate(r, head_dim) >= r["shared"], (r, estimate(r, head_dim))


def test_torchs_own_backward_tile_at_head_dim_256_exceeds_sm120(cuda_python: str, tmp_path: Path) -> None:
    rc, rows, out = gate(cuda_python, tmp_path, 256, "--options", "torch-default")
    assert rc == 1, out
    bad = [r for r in rows if not r["ok"]]
    assert bad and {r["kind"] for r in bad} == {"flex bwd"}, out
    assert all(r["shared"] > SM120 and "exceeds" in r["error"] for r in bad), bad
    assert "flex bwd" in out and "exceeds the device's 101,376 B" in out, out
    assert all(estimate(r, 256) >= r["shared"] for r in rows), rows


def test_a_cpu_torch_is_told_in_one_line_which_torch_the_gate_needs() -> None:
    import torch

    if torch.version.cuda:
        pytest.skip("this interpreter's torch is a CUDA build")
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cross_compile"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and "CPU build" in proc.stderr and "CUDA build of torch" in proc.stderr
