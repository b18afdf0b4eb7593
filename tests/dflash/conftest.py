"""Fixtures the training-core tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash.model.target import tiny_target_config


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (tiny, random) Qwen3 target folder, as a run's target.path names one."""
    folder = tmp_path_factory.mktemp("target") / "Qwen3-tiny"
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_target_config()).save_pretrained(folder)
    return folder
