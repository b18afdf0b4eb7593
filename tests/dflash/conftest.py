"""Fixtures the training-core tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash.config import RunConfig, load_config
from dflash.model.target import tiny_target_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"


def tiny_config(root: Path, *overrides: str) -> RunConfig:
    """The tiny random run (configs/tiny-random.toml) writing under ``root`` (``run/``, ``ckpt/``), a
    checkpoint only at the end; ``overrides`` come last, so they win. Test modules import it
    (``from tests.dflash.conftest import tiny_config``)."""
    return load_config(
        TINY,
        [f"output_dir={root / 'run'}", f"checkpoint.dir={root / 'ckpt'}", "checkpoint.interval=0", *overrides],
    )


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (tiny, random) Qwen3 target folder, as a run's target.path names one."""
    folder = tmp_path_factory.mktemp("target") / "Qwen3-tiny"
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_target_config()).save_pretrained(folder)
    return folder
