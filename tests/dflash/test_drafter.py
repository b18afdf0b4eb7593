"""The drafter: z-lab parameter names, config keys, what it owns, attention wiring, clear errors."""

from __future__ import annotations

import pytest
import torch

from dflash.model.drafter import DFlashDraftConfig, DFlashDraftModel, DraftCache, draft_config_for
from dflash.model.target import TargetModel, tiny_target_config

# floor (scripts/test runs it again in .venv-floor): the drafter's config is a transformers config (a dataclass under
# @strict on 5.x) and its layers are Qwen3's
pytestmark = pytest.mark.floor

MASK = 511

# z-lab dflash/model.py: DFlashDraftModel.{layers, norm, fc, hidden_norm}; Qwen3DFlashDecoderLayer.{self_attn,
# mlp, input_layernorm, post_attention_layernorm}; Qwen3DFlashAttention.{q,k,v,o}_proj + {q,k}_norm.
ZLAB_LAYER_NAMES = [
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.k_norm.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.v_proj.weight",
]
ZLAB_NAMES = sorted(
    ["fc.weight", "hidden_norm.weight", "norm.weight"]
    + [f"layers.{i}.{name}" for i in range(2) for name in ZLAB_LAYER_NAMES]
)


def config(**kw) -> DFlashDraftConfig:
    args = dict(num_layers=2, block_size=4, mask_token_id=MASK)
    args.update(kw)
    return draft_config_for(tiny_target_config(), **args)


def test_parameter_names_and_shapes_are_zlab_and_nothing_of_the_target() -> None:
    model = DFlashDraftModel(config())
    state = model.state_dict()
    assert sorted(state) == ZLAB_NAMES
    assert state["fc.weight"].shape == (64, 2 * 64)  # n target layers * H -> H, no bias
    assert state["layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # GQA: 2 kv heads
    assert state["layers.0.self_attn.q_norm.weight"].shape == (16,)  # per-head RMSNorm
    assert state["layers.0.mlp.gate_proj.weight"].shape == (128, 64)
    assert not any("embed" in name or "lm_head" in name for name in state)


def test_config_carries_the_dflash_keys() -> None:
    cfg = config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    data = cfg.to_dict()
    assert data["model_type"] == "qwen3"
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert data["block_size"] == 4 and data["num_target_layers"] == 8
    assert data["dflash_config"] == {"mask_token_id": MASK, "target_layer_ids": [1, 5]}
    assert data["layer_types"] == ["sliding_attention", "full_attention"] and data["sliding_window"] == 8
    assert cfg.hidden_size == 64 and cfg.vocab_size == 512 and cfg.num_key_value_heads == 2
    assert cfg.rope_parameters["rope_theta"] == tiny_target_config().rope_parameters["rope_theta"]


def test_config_defaults_derive_layer_ids_from_the_target() -> None:
    cfg = draft_config_for(tiny_target_config(num_hidden_layers=36), num_layers=5, block_size=16, mask_token_id=7)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.layer_types == ["full_attention"] * 5
    assert cfg.sliding_window is None


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(mask_token_id=512), r"dflash_config.mask_token_id: expected an integer in \[0, 512\), got 512"),
        (dict(block_size=1), "block_size: must be >= 2"),
        (dict(layer_types=["full_attention"]), "layer_types: expected 2 entries"),
        (dict(layer_types=["full_attention", "linear_attention"]), r"layer_types\[1\]"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (dict(target_layer_ids=[1, 9]), "target_layer_ids: 9 is out of range"),
    ],
)
def test_bad_config_values_are_named(kw: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        config(**kw)


def test_wrong_feature_width_is_a_clear_error() -> None:
    model = DFlashDraftModel(config())
    with pytest.raises(ValueError, match=r"target_hidden: expected 128 features \(2 target layers \[1, 5\]"):
        model(torch.arange(9)[None], noise_embedding=torch.randn(1, 4, 64), target_hidden=torch.randn(1, 5, 64 * 3))


def qkv_of(model: DFlashDraftModel, layer: int, x: torch.Tensor, ctx: torch.Tensor, positions: torch.Tensor):
    """Recompute one layer's q/k/v by hand from the module's weights (z-lab's formulas)."""
    attn = model.layers[layer].self_attn
    b, q_len, _ = x.shape
    cos, sin = model.rotary_emb(x, positions)

    def rope(t, c, s):
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * c[:, None] + rotated * s[:, None]

    q = attn.q_norm(attn.q_proj(x).view(b, q_len, -1, 16)).transpose(1, 2)
    k = torch.cat([attn.k_proj(ctx), attn.k_proj(x)], dim=1)
    k = attn.k_norm(k.view(b, k.shape[1], -1, 16)).transpose(1, 2)
    v = torch.cat([attn.v_proj(ctx), attn.v_proj(x)], dim=1).view(b, -1, 2, 16).transpose(1, 2)
    return rope(q, cos[:, -q_len:], sin[:, -q_len:]), rope(k, cos, sin), v


def test_queries_come_from_the_block_and_keys_from_context_then_block() -> None:
    torch.manual_seed(0)
    model = DFlashDraftModel(config())
    x = torch.randn(1, 4, 64)
    ctx = torch.randn(1, 6, 64)
    positions = torch.arange(10)[None]
    cos_sin = model.rotary_emb(x, positions)
    q, k, v = qkv_of(model, 0, x, ctx, positions)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # no mask: full layer
    attn = model.layers[0].self_attn
    expected = attn.o_proj(expected.transpose(1, 2).reshape(1, 4, 64))
    assert torch.allclose(attn(x, ctx, cos_sin), expected, atol=1e-5)


def test_sliding_layer_at_inference_is_causal_within_window() -> None:
    torch.manual_seed(0)
    model = DFlashDraftModel(config(layer_types=["sliding_attention", "full_attention"], sliding_window=5))
    x, ctx, positions = torch.randn(1, 4, 64), torch.randn(1, 6, 64), torch.arange(10)[None]
    q, k, v = qkv_of(model, 0, x, ctx, positions)
    q_pos = torch.arange(6, 10)[:, None]
    k_pos = torch.arange(10)[None, :]
    allowed = (k_pos <= q_pos) & (q_pos - k_pos < 5)
    attn = model.layers[0].self_attn
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    expected = attn.o_proj(out.transpose(1, 2).reshape(1, 4, 64))
    assert torch.allclose(attn(x, ctx, model.rotary_emb(x, positions)), expected, atol=1e-5)


def test_cached_forward_equals_uncached() -> None:
    torch.manual_seed(0)
    model = DFlashDraftModel(config(layer_types=["sliding_attention", "full_attention"], sliding_window=5))
    ctx = torch.randn(1, 9, 128)
    block = torch.randn(1, 4, 64)
    whole = model(torch.arange(13)[None], noise_embedding=block, target_hidden=ctx)
    cache = model.new_cache()
    model(
        torch.arange(5 + 4)[None],
        noise_embedding=torch.randn(1, 4, 64),
        target_hidden=ctx[:, :5],
        past_key_values=cache,
    )
    cache.crop(5)
    assert cache.get_seq_length() == 5
    split = model(torch.arange(5, 13)[None], noise_embedding=block, target_hidden=ctx[:, 5:], past_key_values=cache)
    assert torch.allclose(whole, split, atol=1e-5)


def test_draft_cache_crop_keeps_the_prefix() -> None:
    cache = DraftCache(1)
    cache.update(0, torch.arange(6.0).view(1, 1, 6, 1), torch.zeros(1, 1, 6, 1))
    cache.crop(4)
    k, _ = cache.update(0, torch.full((1, 1, 2, 1), 9.0), torch.zeros(1, 1, 2, 1))
    assert k.flatten().tolist() == [0, 1, 2, 3, 9, 9]


def test_drafter_runs_in_bfloat16_against_a_bfloat16_target() -> None:
    target = TargetModel.from_config(tiny_target_config(), dtype=torch.bfloat16, num_draft_layers=2)
    model = DFlashDraftModel(config()).to(torch.bfloat16)
    ids = torch.randint(0, 500, (1, 6))
    out = model(
        torch.arange(10)[None],
        noise_embedding=target.head().embed(torch.tensor([[3, MASK, MASK, MASK]])),
        target_hidden=target.features(ids),
    )
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
