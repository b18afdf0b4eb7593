"""The side venvs of scripts/floor-venv hold what their tests need, and the floor run cannot pass by skipping.

speculators 0.9.0 is installed there without torchvision and torchaudio (it declares both; PyPI's torchvision
fails to import beside the CPU torch): its DFlash config class and its z-lab converter must import without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
VERSIONS = """
import json, importlib.metadata as md
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
print(json.dumps({n: version(n) for n in NAMES}))
"""


def versions(python: str, *names: str) -> dict[str, str | None]:
    code = f"NAMES = {list(names)!r}\n{VERSIONS}"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout))


def test_the_side_venvs_hold_the_versions_they_prove(floor_python: str, tf457_python: str) -> None:
    floor = versions(floor_python, "transformers", "torch", "speculators", "dflash")
    assert floor["transformers"] == "5.17.0" and floor["speculators"] == "0.9.0", floor
    assert str(floor["torch"]).startswith("2.13.0"), floor  # the wheel on disk; torch 2.11 is the GPU check's
    tf457 = versions(tf457_python, "transformers", "torch", "safetensors")
    assert str(tf457["transformers"]).startswith("4.57."), tf457


def test_the_floor_venv_has_every_test_requirement(floor_python: str) -> None:
    # pytest imports every module of tests/dflash before -m deselects, so the floor run needs all of [test]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in pyproject["optional-dependencies"]["test"]]
    got = versions(floor_python, *(r.name for r in reqs))
    wrong = {r.name: got[r.name] for r in reqs if got[r.name] is None or not r.specifier.contains(str(got[r.name]))}
    assert not wrong, f"in .venv-floor, not as [test] asks: {wrong}"


def test_the_floor_run_fails_under_ci_when_speculators_is_missing(floor_python: str, tmp_path: Path) -> None:
    # speculators hidden from the floor venv's interpreter (None in sys.modules: find_spec says not installed)
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["speculators"] = None\n')
    # a test of this module and one of test_speculators_format (a module-level importorskip there would skip)
    tests = [
        "tests/dflash/test_side_venvs.py::test_speculators_dflash_config_and_converter_import_without_torchvision_or_torchaudio",
        "tests/dflash/test_speculators_format.py::test_speculators_config_class_and_model_read_our_export[False]",
    ]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    argv = [floor_python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    ci = subprocess.run(argv, cwd=REPO, env={**env, "CI": "true"}, capture_output=True, text=True, timeout=300)
    # both fail in setup (a module-level importorskip would make one of them a skip)
    assert ci.returncode != 0 and "2 errors in" in ci.stdout, ci.stdout[-2000:]
    assert "CI=true and speculators is not installed" in ci.stdout, ci.stdout[-2000:]
    local = subprocess.run(argv, cwd=REPO, env={**env, "CI": ""}, capture_output=True, text=True, timeout=300)
    assert local.returncode == 0 and "2 skipped" in local.stdout, local.stdout[-2000:]


@pytest.mark.speculators
def test_speculators_dflash_config_and_converter_import_without_torchvision_or_torchaudio() -> None:
    from speculators.convert.dflash import DFlashConverter
    from speculators.models.dflash import DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig(block_size=4, mask_token_id=511, aux_hidden_state_layer_ids=[2, 6])
    assert config.speculators_model_type == "dflash"
    assert (config.block_size, config.mask_token_id, config.aux_hidden_state_layer_ids) == (4, 511, [2, 6])
    assert callable(DFlashConverter)
    assert "torchvision" not in sys.modules and "torchaudio" not in sys.modules
