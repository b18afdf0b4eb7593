"""pyproject.toml's requirements admit the environments our users share with the engines they serve with
(../shared/research/serving.md section 0), and `dflashctl deploy --install` asks for the same ranges."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ops.deploy import REQUIRED_MODULES

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]

# (torch, transformers) each of them installs; speculators 0.9.0 and z-lab's pin are tested in side venvs
ENGINES = {
    "vllm 0.33.0": ("2.14.0", "5.20.0"),
    "sglang 0.5.23": ("2.14.1", "5.19.0"),
    "the lent H200 image": ("2.11.0", "5.17.0"),
    "speculators 0.9.0": ("2.14.1", "5.19.0"),
    "CI (.venv)": ("2.13.0", "5.24.0"),
}


def requirements(entries: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(e) for e in entries]
    return {r.name: r for r in reqs}


# the base install (the operator's dflashctl) and the training core, the [train] extra
TRAINING = PYPROJECT["dependencies"] + PYPROJECT["optional-dependencies"]["train"]
OPERATOR = {"click", "paramiko", "proxmoxer", "requests", "numpy"}


def test_the_base_install_is_the_operators_and_train_is_the_training_core() -> None:
    base = requirements(PYPROJECT["dependencies"])
    assert set(base) == OPERATOR, sorted(base)
    assert {"torch", "transformers", "safetensors", "accelerate"} == set(
        requirements(PYPROJECT["optional-dependencies"]["train"])
    )
    # the tests train tiny models: [test] pulls the training core
    assert "dflash[train]" in PYPROJECT["optional-dependencies"]["test"]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_dependencies_admit_the_engines_torch_and_transformers(engine: str) -> None:
    torch, transformers = ENGINES[engine]
    deps = requirements(TRAINING)
    assert deps["torch"].specifier.contains(torch), (engine, str(deps["torch"]))
    assert deps["transformers"].specifier.contains(transformers), (engine, str(deps["transformers"]))
    for extra, entries in PYPROJECT["optional-dependencies"].items():
        for req in requirements(entries).values():
            if req.name == "transformers":
                assert req.specifier.contains(transformers), (engine, extra, str(req))


def test_deploy_installs_the_ranges_pyproject_declares() -> None:
    deps = requirements(TRAINING)
    for module, entry in REQUIRED_MODULES.items():
        req = Requirement(entry)
        if req.name == "torch":  # unpinned on purpose: a GPU box brings its own CUDA build
            assert not req.specifier
            continue
        assert req.specifier == deps[req.name].specifier, (module, entry, str(deps[req.name]))
