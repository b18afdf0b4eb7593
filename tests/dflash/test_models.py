"""One builder of a run's models (``dflash.models``): ``dflash eval --untrained --config`` measures the drafter
``dflash train`` starts from: the same MASK id, the same drafter config, the same weights."""

from __future__ import annotations

import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.config import load_config, parse_config, to_dict
from dflash.eval.evaluate import load_setup
from dflash.train.run import Run

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "configs" / "tiny-data.jsonl"

# floor (scripts/test runs it again in .venv-floor): the target and the drafter built through transformers' loading
# (from_pretrained, configs)
pytestmark = [pytest.mark.floor, pytest.mark.timeout(240)]


def write_config(tmp_path: Path, name: str, *, vocab_size: int, seed: int, drafter: str = "") -> Path:
    """A tiny run (one target, one drafter) as a TOML file: what `dflash eval --config` reads."""
    path = tmp_path / f"{name}.toml"
    path.write_text(
        f"""seed = {seed}
max_steps = 1
output_dir = "{tmp_path / name}"

[target]
dtype = "float32"

[target.tiny]
vocab_size = {vocab_size}
hidden_size = 64
intermediate_size = 128
num_layers = 4
num_heads = 4
num_kv_heads = 2
head_dim = 16

[drafter]
layers = 1
block_size = 8
dtype = "float32"
{drafter}

[data]
path = "{DATA}"
max_length = 64
batch_size = 4

[devices]
targets = ["cpu"]
drafters = ["cpu"]

[checkpoint]
dir = "{tmp_path / name / "ckpt"}"
interval = 0
resume = "never"
"""
    )
    return path


def assert_same_step_0(config: Path) -> tuple[Run, t.Any]:
    run = Run(load_config(config), environ={})  # what `dflash train --config` builds, before its first step
    s = load_setup(drafter=None, untrained=True, config=str(config), prompts=str(DATA), limit=1)
    assert s.drafter.mask_token_id == run.mask_token_id
    assert s.drafter.config.to_dict() == run.draft_config.to_dict()
    trained = run.drafters[0].model.state_dict()
    measured = s.drafter.state_dict()
    assert list(measured) == list(trained)
    for name, w in measured.items():
        assert torch.equal(w, trained[name]), name
    return run, s


def test_eval_untrained_takes_the_published_mask_id_as_training_does(tmp_path: Path) -> None:
    # A Qwen3-size vocabulary (151,936 rows) at a tiny width: published Qwen3 drafters' MASK is 151669, not
    # the last row; training takes it (no tokenizer says the row is in use), so eval's step 0 must too.
    run, _ = assert_same_step_0(write_config(tmp_path, "qwen3-vocab", vocab_size=151936, seed=3))
    assert run.mask_token_id == 151669


def test_eval_untrained_starts_from_the_warm_start_as_training_does(tmp_path: Path) -> None:
    # drafter.init_from: step 0 is that drafter's weights, not a seeded init of its config.
    first = Run(load_config(write_config(tmp_path, "first", vocab_size=512, seed=1)), environ={})
    with torch.no_grad():
        for p in first.drafters[0].model.parameters():
            p.add_(0.25)  # weights no seeded init gives
    saved = ckpt.save_checkpoint(tmp_path / "warm", step=1, drafter=first.drafters[0].model, trainer_state={})
    config = write_config(tmp_path, "second", vocab_size=512, seed=2, drafter=f'init_from = "{saved}"')
    run, s = assert_same_step_0(config)
    assert run.init_drafter is not None
    assert torch.equal(s.drafter.fc.weight, run.init_drafter.fc.weight)


def test_a_config_saved_with_a_checkpoint_parses_back_to_itself() -> None:
    # eval reads the run's config from the checkpoint's trainer state (to_dict: tuples, not TOML's lists)
    cfg = load_config(REPO / "configs" / "tiny-random.toml")
    assert parse_config(to_dict(cfg)) == cfg
