"""Sliding-window drafters from the run config (``drafter.sliding_window``, ``drafter.layer_types``): the keys reach
config.json and every export as the engines read them, training and ``dflash eval`` mask as the engines do, and a
compiled sliding drafter never recompiles after its warm-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from dflash.__main__ import main
from dflash.checkpoint.checkpoints import latest_complete, save_checkpoint
from dflash.config import ConfigError, RunConfig
from dflash.model import config_keys
from dflash.model.drafter import _inference_mask
from dflash.model.loss import mask_mod, sample_anchors, training_block_mask, training_mask
from dflash.models import drafter_spec, initial_drafter, load_target
from dflash.train.compile import compiled_entries, warm_up_shapes
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

pytestmark = pytest.mark.timeout(300)

SLIDING, FULL = "sliding_attention", "full_attention"


def served_config(tmp_path: Path, target_dir: Path, *overrides: str) -> RunConfig:
    """The tiny run on a real target folder (what an export names as the verifier)."""
    return tiny_config(tmp_path, "target.tiny=none", f"target.path={target_dir}", *overrides)


@pytest.mark.parametrize(
    ("keys", "types"),
    [
        (["drafter.sliding_window=64"], [SLIDING, SLIDING]),  # unset layer_types with a window: every layer
        (["drafter.sliding_window=64", f"drafter.layer_types={SLIDING},{FULL}"], [SLIDING, FULL]),
    ],
    ids=["all-sliding", "mixed"],
)
def test_the_sliding_keys_reach_config_json_and_every_export_as_the_engines_read_them(
    tmp_path: Path, target_dir: Path, keys: list[str], types: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = served_config(tmp_path, target_dir, *keys)
    spec = drafter_spec(cfg, load_target(cfg, "cpu"))
    model = initial_drafter(spec.config, seed=0)
    assert model.layer_types == types and model.sliding_window == 64
    ck = save_checkpoint(
        tmp_path / "ck", step=1, drafter=model, trainer_state={"config": {"target": {"path": str(target_dir)}}}
    )
    assert main(["export", str(ck), str(tmp_path / "zlab")]) == 0
    for folder in (ck, tmp_path / "zlab"):
        data = json.loads((folder / "config.json").read_text())
        # vLLM _resolve_layer_attention / SGLang: layer_types per layer, sliding_window their window (SGLang's
        # window_left = sliding_window - 1: the query and the window - 1 keys before it); no is_causal, so
        # every engine makes the sliding layers causal and the full ones non-causal, as trained
        assert data["layer_types"] == types and data["sliding_window"] == 64 and data["use_sliding_window"] is True
        assert "is_causal" not in data and "causal" not in data["dflash_config"]
        config_keys.check_folder(folder)  # every key a published drafter may carry, read our way
    card = (tmp_path / "zlab" / "README.md").read_text()
    assert f"- sliding window: 64 tokens on {types.count(SLIDING)} of 2 layers" in card
    spec_out = tmp_path / "spec"
    code = main(["export", str(ck), str(spec_out), "--format", "speculators"])
    if types.count(SLIDING) == len(types):
        assert code == 0
        data = json.loads((spec_out / "config.json").read_text())
        assert data["sliding_window_non_causal"] is False  # vLLM: dflash_config.causal = True for every layer
        layer = data["transformer_layer_config"]
        assert layer["layer_types"] == types and layer["sliding_window"] == 64
    else:  # one causal flag for every layer in that layout: refused in one line (the z-lab format serves it)
        assert code != 0 and "mix sliding and full attention" in capsys.readouterr().err


def test_init_from_keeps_the_warm_starts_layers_and_refuses_other_sliding_keys_in_one_line(
    tmp_path: Path, target_dir: Path
) -> None:
    cfg = served_config(tmp_path, target_dir, "drafter.sliding_window=64")
    target = load_target(cfg, "cpu")
    model = initial_drafter(drafter_spec(cfg, target).config, seed=0)
    warm = save_checkpoint(tmp_path / "warm", step=1, drafter=model, trainer_state={})
    same = drafter_spec(served_config(tmp_path, target_dir, f"drafter.init_from={warm}"), target)
    assert same.config.layer_types == [SLIDING, SLIDING] and same.config.sliding_window == 64
    refusals = [
        ("drafter.sliding_window=32", "sliding_window is 64, but drafter.sliding_window is 32"),
        (
            f"drafter.layer_types={FULL},{FULL}",
            f"layer_types is {[SLIDING, SLIDING]}, but drafter.layer_types is {[FULL, FULL]}",
        ),
    ]
    for key, line in refusals:
        with pytest.raises(ConfigError) as e:
            drafter_spec(served_config(tmp_path, target_dir, f"drafter.init_from={warm}", key), target)
        assert str(e.value) == f"drafter.init_from: {warm}: {line}"


@pytest.mark.parametrize("window", [5, 12])
def test_training_and_eval_masks_of_a_sliding_layer_are_the_engines_window(window: int) -> None:
    """vLLM, SGLang and speculators serve a sliding layer's query at position p with the keys at (p - window, p].
    Training: the block's query at p = anchor + k sees the target context before its anchor and its own block's
    slots up to itself, i.e. context positions (p - window, anchor) and block positions [anchor, p]: together
    exactly (p - window, p], once each. Checked past the window, for the dense mask (CPU) and the flex
    BlockMask (the GPU's), and for the mask ``dflash eval`` decodes with (the drafter's KV cache)."""
    seq, block = 60, 4
    loss_mask = torch.ones(2, seq)
    loss_mask[:, : window + 3] = 0  # every anchor lies past the window
    anchors = sample_anchors(loss_mask, num_anchors=6, block_size=block, generator=torch.Generator().manual_seed(3))
    assert anchors.valid.all() and int(anchors.positions.min()) > window
    dense = training_mask(anchors, seq_len=seq, block_size=block, sliding_window=window)[:, 0]
    flex = training_block_mask(anchors, seq_len=seq, block_size=block, sliding_window=window)
    q_len, kv_len = dense.shape[1], dense.shape[2]
    mod = mask_mod(anchors, seq_len=seq, block_size=block, sliding_window=window)
    tiles = flex.to_dense()[:, 0]  # [Bt, Q tiles, KV tiles]: a visible pair lies in a kept tile
    for b in range(2):
        from_flex = mod(torch.tensor(b), torch.tensor(0), torch.arange(q_len)[:, None], torch.arange(kv_len)[None])
        assert torch.equal(from_flex, dense[b])
        rows, cols = dense[b].nonzero(as_tuple=True)
        assert tiles[b, rows // 128, cols // 128].all()
        for q in range(q_len):
            n, k = divmod(q, block)
            anchor = int(anchors.positions[b, n])
            p = anchor + k
            seen = [kv if kv < seq else anchor + (kv - seq) % block for kv in dense[b, q].nonzero().flatten().tolist()]
            assert all(kv < seq or (kv - seq) // block == n for kv in dense[b, q].nonzero().flatten().tolist())
            assert sorted(seen) == list(range(p - window + 1, p + 1)), (b, q)
    # dflash eval: the cache holds the context (positions 0 .. start - 1) then the block, key index = position
    start = 40
    eval_mask = _inference_mask(block, start + block, window, torch.device("cpu"))[0, 0]
    for k in range(block):
        p = start + k
        assert eval_mask[k].nonzero().flatten().tolist() == list(range(p - window + 1, p + 1))


def test_an_uncompiled_sliding_drafter_trains_and_compiles_nothing(tmp_path: Path) -> None:
    """Compile off (the CPU default): mixed sliding and full layers train, and nothing is compiled on the way
    (compiled runs: the 8,192-token test below)."""
    torch._dynamo.reset()
    overrides = ["drafter.sliding_window=16", f"drafter.layer_types={SLIDING},{FULL}", "max_steps=3"]
    run = Run(tiny_config(tmp_path, *overrides, 'devices.targets=["cpu"]', 'devices.drafters=["cpu"]'), environ={})
    assert [r.model.layer_types for r in run.drafters] == [[SLIDING, FULL]]
    graphs = counters["stats"]["unique_graphs"]
    assert run.train() == 0
    assert counters["stats"]["unique_graphs"] == graphs


def long_data(path: Path, *, samples: int, length: int) -> Path:
    """Token records of ``length`` tokens (random ids below the tiny target's MASK row), supervised after 16."""
    g = torch.Generator().manual_seed(5)
    with path.open("w") as f:
        for _ in range(samples):
            ids = torch.randint(0, 500, (length,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 16 + [1] * (length - 16)}) + "\n")
    return path


def test_a_sliding_drafter_trains_at_8192_tokens_resumes_and_never_recompiles_after_warm_up(tmp_path: Path) -> None:
    """Samples of 8,192 tokens (64x the short runs' longest compile shape), a sliding and a full layer, compiled
    (dynamo traces and guards with ``eager`` as with inductor): one warm-up shape for one row, and nothing
    compiled after it (the run sets fail_on_recompile: a miss would fail it; the dynamo cache does not grow),
    and the resumed run goes on from the checkpoint."""
    torch._dynamo.reset()
    data = long_data(tmp_path / "long.jsonl", samples=2, length=8192)
    keys = [
        f"data.path={data}",
        "data.max_length=8192",
        "data.batch_size=1",
        "target.tiny.max_position_embeddings=8192",
        # the target's forward is quadratic in the length: 2 of 4 layers (its features' last), 2 heads
        "target.tiny.num_layers=4",
        "target.tiny.num_heads=2",
        "target.tiny.num_kv_heads=1",
        'devices.targets=["cpu"]',
        'devices.drafters=["cpu"]',
        "drafter.sliding_window=64",
        f"drafter.layer_types={SLIDING},{FULL}",
        "compile=true",
        "compile_backend=eager",
        "optim.sequences_per_update=1",
        "checkpoint.resume=auto",
        "queue.capacity=1",  # one forward made ahead at most
    ]
    first = Run(tiny_config(tmp_path, *keys, "max_steps=2"), environ={})
    assert first.start_step == 0 and first.drafters[0].model.layer_types == [SLIDING, FULL]
    assert first._warm_up()
    assert first.warmed is not None and [seq for _, seq, _ in first.warmed.shapes] == [8192]
    graphs, entries = counters["stats"]["unique_graphs"], compiled_entries()
    assert first.train() == 0
    resumed = Run(tiny_config(tmp_path, *keys, "max_steps=3"), environ={})
    assert resumed.start_step == 2
    assert resumed.train() == 0
    assert counters["stats"]["unique_graphs"] == graphs and compiled_entries() == entries
    last = latest_complete(tmp_path / "ckpt")
    assert last is not None and last.name == "step-3"


@pytest.mark.parametrize("max_length", [4096, 32768, 65536])
def test_the_warm_up_classes_do_not_grow_with_max_length(max_length: int) -> None:
    """The recipes' long runs (2,048 anchors of 16, flex attention, several rows): the same 12 classes as at 4K,
    the longest at max_length itself; dense attention: 2."""
    flex = warm_up_shapes(rows=4, max_length=max_length, num_anchors=2048, block_size=16, flex=True)
    assert len(flex) == 12 and max(seq for _, seq, _ in flex) == max_length
    assert max(blocks for _, _, blocks in flex) == 2048
    assert len(warm_up_shapes(rows=4, max_length=max_length, num_anchors=2048, block_size=16, flex=False)) == 2
