"""Checkpoints: round trip, exact resume, z-lab layout (loaded by the reference with strict=True),
atomic writes, and latest_complete never picking a half-written one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import zlab_reference
from safetensors.torch import load_file
from test_drafter import ZLAB_NAMES
from transformers import Qwen3Config

from dflash.checkpoint.checkpoints import (
    latest_complete,
    load_checkpoint,
    load_drafter,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from dflash.checkpoint.manifest import CheckpointError
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.loss import drafter_loss
from dflash.model.target import TargetModel, tiny_target_config

# floor (scripts/test runs it again in .venv-floor): save_pretrained / config.json and z-lab's class loading our
# weights: transformers' own serialisation
pytestmark = pytest.mark.floor

MASK = 511


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)


def new_drafter(seed: int = 0, **kw) -> DFlashDraftModel:
    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=MASK, **kw)
    torch.manual_seed(seed)
    return DFlashDraftModel(cfg)


def draft_hidden(model, target: TargetModel, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(seed))
    block = torch.tensor([[int(ids[0, -1]), MASK, MASK, MASK]])
    with torch.no_grad():
        return model(
            position_ids=torch.arange(13)[None],
            noise_embedding=target.head().embed(block),
            target_hidden=target.features(ids),
        )


def test_round_trip_gives_the_same_logits(tmp_path, target: TargetModel) -> None:
    drafter = new_drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    path = save_checkpoint(tmp_path, step=7, drafter=drafter, trainer_state={"data_position": 123})
    assert path == tmp_path / "step-7" and latest_complete(tmp_path) == path
    loaded = load_drafter(path)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert loaded.config.sliding_window == 5 and loaded.config.layer_types == drafter.config.layer_types
    assert torch.equal(draft_hidden(loaded, target), draft_hidden(drafter, target))
    bf16 = load_drafter(path, dtype=torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16


def test_files_config_keys_and_parameter_names_are_zlab(tmp_path) -> None:
    path = save_checkpoint(tmp_path, step=1, drafter=new_drafter(), trainer_state={})
    assert sorted(os.listdir(path)) == [
        "checkpoint.json",
        "config.json",
        "dflash.py",
        "model.safetensors",
        "trainer_state.pt",
    ]
    assert sorted(load_file(path / "model.safetensors")) == ZLAB_NAMES
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 5], "block_size": 4}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 6]  # vLLM reads these layer ids as they are
    assert cfg["layer_types"] == ["full_attention", "full_attention"] and cfg["sliding_window"] is None
    assert cfg["rope_theta"] == 10000.0  # for transformers 4.x readers
    assert cfg["dtype"] == "float32" and cfg["tie_word_embeddings"] is False


@pytest.mark.parametrize("sliding", [False, True])
def test_zlab_reference_loads_our_checkpoint_strictly_and_agrees(tmp_path, target: TargetModel, sliding: bool) -> None:
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5) if sliding else {}
    drafter = new_drafter(seed=3, **kw)
    path = save_checkpoint(tmp_path, step=1, drafter=drafter, trainer_state={})
    reference = zlab_reference.DFlashDraftModel(Qwen3Config.from_pretrained(path))
    result = reference.load_state_dict(load_file(path / "model.safetensors"), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert reference.mask_token_id == MASK and reference.block_size == 4 and reference.target_layer_ids == [1, 5]
    _, info = zlab_reference.DFlashDraftModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = draft_hidden(drafter, target, seed=5)
    theirs = draft_hidden(reference.eval(), target, seed=5)
    assert torch.allclose(ours, theirs, atol=1e-5)
    head = target.head()
    assert torch.equal(head.logits(ours).argmax(-1), head.logits(theirs).argmax(-1))


def test_we_load_a_drafter_saved_by_the_zlab_class(tmp_path, target: TargetModel) -> None:
    source = save_checkpoint(tmp_path / "ours", step=1, drafter=new_drafter(seed=4), trainer_state={})
    reference = zlab_reference.DFlashDraftModel.from_pretrained(source)
    reference.save_pretrained(tmp_path / "zlab")  # a published-drafter folder: no trainer state, no manifest
    loaded = load_drafter(tmp_path / "zlab")
    assert torch.allclose(draft_hidden(loaded, target), draft_hidden(reference.eval(), target), atol=1e-6)


def train_steps(drafter, opt, target: TargetModel, generator: torch.Generator, n: int) -> None:
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(9))
    mask = torch.ones_like(ids)
    feats, head = target.features(ids), target.head()
    for _ in range(n):
        out = drafter_loss(drafter, head, ids, mask, feats, num_anchors=6, generator=generator, chunk_size=4)
        opt.zero_grad()
        out.loss.backward()
        opt.step()


def test_resume_continues_exactly_as_if_never_stopped(tmp_path, target: TargetModel) -> None:
    drafter = new_drafter()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    train_steps(drafter, opt, target, g, 3)
    save_checkpoint(
        tmp_path,
        step=3,
        drafter=drafter,
        trainer_state={"step": 3, "rng": rng_state(g), "data": [4, 5]},
        optimizer_state=opt.state_dict(),
    )
    train_steps(drafter, opt, target, g, 2)

    ckpt = load_checkpoint(latest_complete(tmp_path))
    assert ckpt.step == 3 and ckpt.trainer_state["data"] == [4, 5]
    resumed = DFlashDraftModel(ckpt.config)
    resumed.load_state_dict(ckpt.state_dict, strict=True)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(ckpt.optimizer_state)
    g2 = torch.Generator()
    restore_rng_state(ckpt.trainer_state["rng"], g2)
    train_steps(resumed, opt2, target, g2, 2)
    for (name, a), b in zip(drafter.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_latest_complete_never_picks_a_half_written_checkpoint(tmp_path) -> None:
    drafter = new_drafter()
    good = save_checkpoint(tmp_path, step=8, drafter=drafter, trainer_state={}, keep=None)
    # A save that died before its rename.
    tmp = tmp_path / f".tmp-step-9-{os.getpid()}"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    # A directory with everything but the manifest (the manifest is written last).
    partial = save_checkpoint(tmp_path / "src", step=10, drafter=drafter, trainer_state={})
    partial.rename(tmp_path / "step-10")
    (tmp_path / "step-10" / "checkpoint.json").unlink()
    # Truncated weights (a copy cut short).
    cut = save_checkpoint(tmp_path / "src", step=11, drafter=drafter, trainer_state={})
    cut.rename(tmp_path / "step-11")
    weights = tmp_path / "step-11" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    # A manifest of another step.
    moved = save_checkpoint(tmp_path / "src", step=5, drafter=drafter, trainer_state={})
    moved.rename(tmp_path / "step-12")
    assert latest_complete(tmp_path) == good
    with pytest.raises(CheckpointError, match="model.safetensors has 100 bytes"):
        load_checkpoint(tmp_path / "step-11")
    with pytest.raises(CheckpointError, match="no checkpoint.json"):
        load_checkpoint(tmp_path / "step-10")
    assert latest_complete(tmp_path / "nowhere") is None


def test_a_failed_save_leaves_no_trace_and_the_previous_one_stands(tmp_path) -> None:
    drafter = new_drafter()
    good = save_checkpoint(tmp_path, step=1, drafter=drafter, trainer_state={})
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises for a lambda; the point is what is left
        save_checkpoint(tmp_path, step=2, drafter=drafter, trainer_state={"bad": lambda: None})  # unpicklable
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    assert latest_complete(tmp_path) == good


def test_keep_prunes_the_oldest_and_a_dead_writers_temp_dir_is_removed(tmp_path) -> None:
    drafter = new_drafter()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".tmp-step-3-{int(dead.stdout)}"
    stale.mkdir(parents=True)
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step=step, drafter=drafter, trainer_state={"s": step}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-3", "step-4"]
    save_checkpoint(tmp_path, step=4, drafter=drafter, trainer_state={"s": "again"}, keep=2)
    assert load_checkpoint(tmp_path / "step-4").trainer_state == {"s": "again"}


def test_trainer_state_must_load_without_arbitrary_pickles(tmp_path) -> None:
    path = save_checkpoint(
        tmp_path, step=1, drafter=new_drafter(), trainer_state={"when": __import__("datetime").date(2026, 1, 1)}
    )
    with pytest.raises(CheckpointError, match="weights_only=True"):
        load_checkpoint(path)
