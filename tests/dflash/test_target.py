"""The frozen target: layer choice, features (pre-final-norm, offset 1), head, greedy generation."""

from __future__ import annotations

import pytest
import torch

from dflash.model.target import TargetModel, build_target_layer_ids, default_mask_token_id, tiny_target_config

# floor (scripts/test runs it again in .venv-floor): target loading (from_pretrained, device_map through accelerate),
# hooks on Qwen3 layers, generate and its cache
pytestmark = pytest.mark.floor


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)


@pytest.mark.parametrize(
    ("layers", "draft", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B drafter (SpecForge configs/qwen3-8b-dflash.json)
        (64, 5, [1, 16, 31, 46, 61]),  # Qwen3.6-27B drafter
        (8, 2, [1, 5]),
        (24, 1, [12]),
        (8, 3, [1, 3, 5]),
    ],
)
def test_build_target_layer_ids_matches_zlab(layers: int, draft: int, expected: list[int]) -> None:
    assert build_target_layer_ids(layers, draft) == expected


@pytest.mark.parametrize(("layers", "draft", "needle"), [(3, 2, "num_target_layers"), (8, 0, "num_draft_layers")])
def test_build_target_layer_ids_rejects_bad_sizes(layers: int, draft: int, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        build_target_layer_ids(layers, draft)


def test_default_layer_ids_and_feature_width(target: TargetModel) -> None:
    assert target.layer_ids == [1, 5]
    feats = target.features(torch.randint(0, 500, (2, 9)))
    assert feats.shape == (2, 9, 2 * 64)
    assert target.feature_size == 128 and target.hidden_size == 64 and target.vocab_size == 512


def test_features_are_pre_norm_layer_outputs_in_given_order() -> None:
    target = TargetModel.from_config(tiny_target_config(), seed=0, layer_ids=[5, 0, 3])
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(lambda mod, args, out, i=i: captured.__setitem__(i, out))
        for i, layer in enumerate(target.layers)
    ]
    ids = torch.randint(0, 500, (1, 11))
    try:
        with torch.no_grad():
            full = target.model(ids, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    feats = target.features(ids)
    h = 64
    for slot, layer in enumerate([5, 0, 3]):
        part = feats[..., slot * h : (slot + 1) * h]
        assert torch.allclose(part, captured[layer], atol=1e-6)  # the decoder layer's own output
        assert torch.allclose(part, full.hidden_states[layer + 1], atol=1e-6)  # z-lab's index id+1
    # Not the final-normed state: that is what transformers puts last, and what serving never reads.
    assert not torch.allclose(captured[7], full.hidden_states[8], atol=1e-3)


def test_last_layer_is_refused_because_transformers_returns_it_normed() -> None:
    with pytest.raises(ValueError, match="target_layer_ids: 7 is out of range"):
        TargetModel.from_config(tiny_target_config(), layer_ids=[1, 7])


def test_features_have_no_grad_and_final_hidden_is_lm_head_input(target: TargetModel) -> None:
    ids = torch.randint(0, 500, (1, 6))
    feats, final = target.features(ids, return_final=True)
    assert not feats.requires_grad and not final.requires_grad
    with torch.no_grad():
        logits = target.model(ids).logits
    assert torch.allclose(target.lm_head(final), logits, atol=1e-5)
    # The early stop after the last needed layer changes nothing.
    assert torch.equal(target.features(ids), feats)


def test_target_is_frozen_and_in_eval(target: TargetModel) -> None:
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())


def test_head_shares_weights_but_moving_it_leaves_the_target_alone(target: TargetModel) -> None:
    head = target.head()
    assert head.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[3, 4, 511]])
    assert torch.equal(head.embed(ids), target.embed_tokens(ids))
    assert not any(p.requires_grad for p in head.parameters())
    moved = head.to(torch.float64)
    assert moved.lm_head.weight.dtype == torch.float64
    assert target.lm_head.weight.dtype == torch.float32 and target.embed_tokens.weight.dtype == torch.float32


def test_generate_greedy_equals_argmax_without_cache(target: TargetModel) -> None:
    prompt = torch.randint(0, 500, (1, 5))
    out = target.generate_greedy(prompt, 12)
    assert out.shape == (1, 17) and torch.equal(out[:, :5], prompt)
    seq = prompt
    with torch.no_grad():
        for _ in range(12):
            seq = torch.cat([seq, target.model(seq).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, seq)


def test_generate_greedy_stops_after_a_stop_token(target: TargetModel) -> None:
    prompt = torch.randint(0, 500, (1, 5))
    full = target.generate_greedy(prompt, 10)
    stop = int(full[0, 8])
    out = target.generate_greedy(prompt, 10, stop_token_ids=[stop])
    first = int((full[0, 5:] == stop).nonzero()[0]) + 5
    assert torch.equal(out, full[:, : first + 1])


def test_mask_token_id_is_the_last_row_and_must_be_unused() -> None:
    assert default_mask_token_id(151936, tokenizer_size=151669) == 151935
    assert default_mask_token_id(512) == 511
    with pytest.raises(ValueError, match="no unused row"):
        default_mask_token_id(512, tokenizer_size=512)


def test_from_config_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = TargetModel.from_config(tiny_target_config(num_hidden_layers=4), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = TargetModel.from_config(tiny_target_config(num_hidden_layers=4), seed=7)
    c = TargetModel.from_config(tiny_target_config(num_hidden_layers=4), seed=8)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_from_pretrained_reads_a_local_checkpoint(tmp_path, target: TargetModel) -> None:
    target.model.save_pretrained(tmp_path)
    loaded = TargetModel.from_pretrained(str(tmp_path), dtype=torch.float32, layer_ids=[1, 5])
    ids = torch.randint(0, 500, (1, 7))
    assert torch.allclose(loaded.features(ids), target.features(ids), atol=1e-6)
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_from_pretrained_off_the_cpu_never_holds_the_weights_in_host_memory(tmp_path) -> None:
    """Loading for another device reads each tensor into place: host memory never holds the model.

    ``meta`` stands in for a GPU (the same ``device_map`` path, and nothing is allocated anywhere). A bf16
    checkpoint loaded as fp32 makes every tensor a new host tensor on the old path (load, then
    ``.to(device)``): the peak RSS grew by 53 MB there, by nothing now.
    """
    import subprocess
    import sys
    import textwrap

    cfg = tiny_target_config(vocab_size=100_000, hidden_size=256, num_hidden_layers=2, intermediate_size=256)
    TargetModel.from_config(cfg, seed=0, layer_ids=[0], dtype=torch.bfloat16).model.save_pretrained(tmp_path)
    fp32 = 2 * sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    assert fp32 > 200e6
    code = textwrap.dedent(f"""
        import resource, torch
        from dflash.model.target import TargetModel
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        t = TargetModel.from_pretrained({str(tmp_path)!r}, dtype=torch.float32, device="meta", layer_ids=[0])
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(after - before, sorted({{p.device.type for p in t.model.parameters()}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    grown, devices = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert devices == "['meta']"
    assert int(grown) < fp32 / 16, f"peak host memory grew by {int(grown) / 1e6:.0f} MB loading {fp32 / 1e6:.0f} MB"
