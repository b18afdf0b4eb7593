"""The side venvs of scripts/floor-venv hold what their tests need.

speculators 0.9.0 is installed there without torchvision and torchaudio (it declares both; PyPI's torchvision
fails to import beside the CPU torch): its DFlash config class and its z-lab converter must import without them.
"""

from __future__ import annotations

import sys

import pytest


@pytest.mark.speculators
def test_speculators_dflash_config_and_converter_import_without_torchvision_or_torchaudio() -> None:
    from speculators.convert.dflash import DFlashConverter
    from speculators.models.dflash import DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig(block_size=4, mask_token_id=511, aux_hidden_state_layer_ids=[2, 6])
    assert config.speculators_model_type == "dflash"
    assert (config.block_size, config.mask_token_id, config.aux_hidden_state_layer_ids) == (4, 511, [2, 6])
    assert callable(DFlashConverter)
    assert "torchvision" not in sys.modules and "torchaudio" not in sys.modules
