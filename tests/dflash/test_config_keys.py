"""Every key of a drafter's config.json is in dflash.model.config_keys' table, or refused in one line.

The configs below are written from the engines' code and the public cards (the shapes their tests and the
published drafters use); the walk fails on any key that is neither a table row nor refused.
"""

from __future__ import annotations

import copy
import json
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint.checkpoints import config_json
from dflash.model import config_keys
from dflash.model.contract import ContractError
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config

QWEN3 = {  # what z-lab's DFlashDraftModel.save_pretrained writes under transformers 4.57 (z-lab/Qwen3-8B-DFlash-b16)
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN35 = {  # z-lab's Qwen3.5 drafters: the block also in dflash_config, transformers 5 keys
    **{k: v for k, v in QWEN3.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")},
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 8, 15, 22, 29], "block_size": 16},
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000},
    "vocab_size": 248320,
    "transformers_version": "5.3.0",
}
GEMMA4 = {  # z-lab/gemma-4-31B-it-DFlash: mixed layers, causal only where sliding (vLLM's docstring)
    **QWEN35,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "sliding_window": 2048,
    "use_sliding_window": True,
}
DFLASH2 = {  # z-lab's Qwen3.8-DFlash2 (tests/fixtures/dflash2-config.json's keys)
    **QWEN35,
    "architectures": ["DFlash2DraftModel"],
    "dflash_config": {
        "mask_token_id": 248070,
        "target_layer_ids": [1, 8, 15, 22, 29],
        "block_size": 16,
        "conv_kernel_size": 4,
        "conv_group_size": 64,
        "selector_rank": 64,
        "selector_top_k": 32,
        "final_logit_softcapping": 30.0,
        "output_multiplier": 0.5,
    },
}
OURS_SERVED = {**QWEN3, "eagle_aux_hidden_state_layer_ids": [2, 10, 18, 26, 34]}  # contract.serving_keys adds it
MIMO = {  # XiaomiMiMo/MiMo-V2.5-Pro-FP4-DFlash (vLLM's docstring: sets use_swa, assumes non-causal)
    **QWEN35,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 8], "use_swa": True, "swa_window_size": 512},
    "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
}
SPECULATORS_32K = {  # RedHatAI/Qwen3-8B-speculator.dflash as vLLM converts it: an own 32K head
    **QWEN3,
    "draft_vocab_size": 32000,
    "has_own_lm_head": True,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33], "causal": False},
}
MUSE = {  # Muse-Glimmer / ModelOpt exports: all sliding, is_causal false (a two-sided window)
    **QWEN35,
    "layer_types": ["sliding_attention"] * 5,
    "sliding_window": 1024,
    "use_sliding_window": True,
    "is_causal": False,
}
VLLM_TEST = {  # vLLM's DFlash tests: causality by dflash_config.causal, the window by swa_window_size
    **GEMMA4,
    "dflash_config": {
        "mask_token_id": 248070,
        "target_layer_ids": [1, 8, 15, 22, 29],
        "causal": True,
        "swa_window_size": 2048,
        "attention_sink_bias": True,
        "attention_value_scale": 0.5,
    },
    "logit_scale": 2.0,
    "is_neox_style": True,
    "add_swa_attention_sink_bias": False,
    "target_hidden_size": 4096,
}
SGLANG_DOMINO = {  # SGLang's Domino projector (parse_dflash_draft_config)
    **QWEN35,
    "dflash_config": {
        "mask_token_id": 248070,
        "target_layer_ids": [1, 8],
        "mask_token": "<|MASK|>",
        "projector_type": "domino",
        "shift_label": True,
        "pure_draft_prefix_len": 1,
        "gru_hidden_dim": 256,
        "emb_dim": 128,
    },
}

CONFIGS = {
    "qwen3": QWEN3,
    "qwen3.5": QWEN35,
    "gemma4": GEMMA4,
    "dflash2": DFLASH2,
    "ours-served": OURS_SERVED,
    "mimo": MIMO,
    "speculators-32k": SPECULATORS_32K,
    "muse": MUSE,
    "vllm-test": VLLM_TEST,
    "sglang-domino": SGLANG_DOMINO,
}


def keys_of(data: t.Mapping[str, t.Any]) -> list[str]:
    out = []
    for k, v in data.items():
        out += [f"{k}.{i}" for i in v] if k == "dflash_config" else [k]
    return out


def without(data: dict[str, t.Any], name: str) -> dict[str, t.Any]:
    out = copy.deepcopy(data)
    if "." in name:
        outer, inner = name.split(".", 1)
        del out[outer][inner]
    else:
        del out[name]
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_key_of_the_engines_configs_is_a_row_or_refused_by_name(name: str) -> None:
    """Refusals peeled one at a time: each names its key; what is left passes; no key is outside the table."""
    data = copy.deepcopy(CONFIGS[name])
    table = {k.name for k in config_keys.KEYS}
    for key in keys_of(data):
        assert key in table, f"{name}: {key} is in no row of the table"
    refused = []
    while (line := config_keys.refusal(data)) is not None:
        assert "\n" not in line
        key = line.split(" ", 1)[0].rstrip(":")
        assert key in keys_of(data) and key not in refused, line
        refused.append(key)
        data = without(data, key)
    for key in refused:
        row = next(k for k in config_keys.KEYS if k.name == key)
        assert row.engines in CONFIGS_LINE[name][key], (key, CONFIGS_LINE[name][key])


def lines(name: str) -> dict[str, str]:
    data, out = copy.deepcopy(CONFIGS[name]), {}
    while (line := config_keys.refusal(data)) is not None:
        key = line.split(" ", 1)[0].rstrip(":")
        out[key] = line
        data = without(data, key)
    return out


CONFIGS_LINE = {name: lines(name) for name in CONFIGS}


def test_published_plain_drafters_pass_and_the_unimplemented_keys_are_refused_naming_their_engines() -> None:
    for name in ("qwen3", "qwen3.5", "gemma4", "ours-served", "muse"):  # muse: the drafter's is_causal refuses it
        assert CONFIGS_LINE[name] == {}, name
    assert set(CONFIGS_LINE["mimo"]) == {"dflash_config.use_swa", "quantization_config"}
    assert set(CONFIGS_LINE["speculators-32k"]) == set()  # an own 32K head: implemented (dflash.model.draft_vocab)
    line = config_keys.refusal(without(SPECULATORS_32K, "has_own_lm_head"))
    assert line is not None and "vLLM would put the target's lm_head in place of the drafter's own" in line
    line = config_keys.refusal({**SPECULATORS_32K, "draft_vocab_size": 200000})
    assert line is not None and line.startswith("draft_vocab_size = 200000 is no draft vocabulary below")
    assert set(CONFIGS_LINE["vllm-test"]) == {
        "dflash_config.causal",
        "dflash_config.attention_sink_bias",
        "dflash_config.attention_value_scale",
    }  # logit_scale 2.0 on a DFlash drafter: implemented
    assert CONFIGS_LINE["vllm-test"]["dflash_config.causal"].startswith(
        "dflash_config.causal = true makes layer 4 (full_attention) causal: every layer's causality, when is_causal "
        "is absent, honoured by vLLM"
    )
    assert set(CONFIGS_LINE["sglang-domino"]) == {
        f"dflash_config.{k}"
        for k in ("projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")
    }
    assert CONFIGS_LINE["dflash2"] == {}  # z-lab DFlash2: its softcap and multiplier are implemented


def test_neutral_values_pass_and_an_unknown_key_is_refused() -> None:
    neutral = {
        **QWEN3,
        "logit_scale": 1.0,
        "has_own_lm_head": False,
        "draft_vocab_size": 151936,
        "is_neox_style": True,
        "dflash_config": {**QWEN3["dflash_config"], "causal": False, "use_swa": False, "sample_from_anchor": False},
    }
    assert config_keys.refusal(neutral) is None
    assert config_keys.refusal({**QWEN3, "has_own_lm_head": 0}) is not None  # a flag is neutral only as false
    line = config_keys.refusal({**QWEN3, "dflash_config": {**QWEN3["dflash_config"], "new_thing": 3}})
    assert line is not None and line.startswith("dflash_config.new_thing: a key no table row covers")
    line = config_keys.refusal({**QWEN3, "eagle_aux_hidden_state_layer_ids": [1, 9, 17, 25, 33]})
    assert line is not None and "makes vLLM read target layers [1, 9, 17, 25, 33]" in line


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
        {"dflash2": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}},
    ],
    ids=["full", "sliding", "dflash2"],
)
def test_our_own_config_json_passes(kw: dict[str, t.Any]) -> None:
    c = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=511, **kw)
    assert config_keys.refusal(json.loads(config_json(c))) is None


def test_init_from_eval_and_export_refuse_a_logit_changing_key_in_one_line(tmp_path: Path) -> None:
    """One published folder (config.json + model.safetensors) with ``is_neox_style: false``: the same
    one-line refusal in all three readers, before anything is loaded or written."""
    from safetensors.torch import save_file

    from dflash.config import ConfigError, load_config
    from dflash.eval.evaluate import EvalError, load_setup
    from dflash.models import init_drafter, load_target
    from dflash.serve.export import ExportError, export

    cfg = draft_config_for(tiny_target_config(), num_layers=2, block_size=4, mask_token_id=511)
    torch.manual_seed(0)
    folder = tmp_path / "published"
    folder.mkdir()
    save_file(DFlashDraftModel(cfg).state_dict(), folder / "model.safetensors")
    data = json.loads(config_json(cfg))
    data["is_neox_style"] = False
    (folder / "config.json").write_text(json.dumps(data))
    one = r"is_neox_style = false: RoPE's rotate-half layout, honoured by vLLM \(.*\); not implemented here"
    with pytest.raises(ContractError, match=rf"^{one}"):
        config_keys.check_folder(folder)
    with pytest.raises(ExportError, match=rf"not exported: {one}") as e:
        export(folder, tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    with pytest.raises(EvalError, match=rf"^--drafter: {folder}: {one}"):
        load_setup(drafter=str(folder))
    run = load_config(
        Path(__file__).resolve().parents[2] / "configs" / "tiny-random.toml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"drafter.init_from={folder}",
            "devices.drafters=cpu",
            "devices.targets=cpu",
        ],
    )
    with pytest.raises(ConfigError, match=rf"^drafter\.init_from: {folder}: {one}"):
        init_drafter(run, load_target(run, "cpu"))


# ---- the engines' logit and embedding scales, implemented -------------------------------------------------

DFLASH2_SIZES = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}


def scaled(kind: str, **scales: t.Any) -> DFlashDraftModel:
    """A tiny drafter (seed 0) with the engines' scale keys: ``logit_scale`` top level, the rest in dflash_config."""
    top = {k: v for k, v in scales.items() if k == "logit_scale"}
    inner = {k: v for k, v in scales.items() if k != "logit_scale"}
    cfg = draft_config_for(
        tiny_target_config(),
        num_layers=2,
        block_size=4,
        mask_token_id=511,
        dflash2=DFLASH2_SIZES if kind == "dflash2" else None,
        **top,
    )
    cfg.dflash_config = {**(cfg.dflash_config or {}), **inner}
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


def test_a_dflash2_drafters_candidate_logits_are_the_engines_hand_computed() -> None:
    """vLLM's get_top_k_tokens and SGLang's _transform_unary_logits: x output_multiplier, then c*tanh(l/c).
    By hand: 0.5 x 40 = 20 -> 30 tanh(2/3) = 17.48349; 0.5 x -10 = -5 -> 30 tanh(-1/6) = -4.95421."""
    model = scaled("dflash2", output_multiplier=0.5, final_logit_softcapping=30.0)
    got = model.draft_logits(torch.tensor([[40.0, -10.0]]))
    assert torch.allclose(got, torch.tensor([[17.48349, -4.95421]]), atol=1e-4)
    # a DFlash drafter: vLLM's LogitsProcessor(scale=logit_scale): 2 x 3 = 6
    assert scaled("dflash", logit_scale=2.0).draft_logits(torch.tensor([3.0])).item() == 6.0
    plain = scaled("dflash")
    x = torch.tensor([1.0, 2.0])
    assert plain.draft_logits(x) is x  # the default drafter's logits are untouched (the golden loss stands)


def test_input_embedding_scale_multiplies_the_block_embedding() -> None:
    base, times2 = scaled("dflash2"), scaled("dflash2", input_embedding_scale=2.0)
    times2.load_state_dict(base.state_dict())
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 4, 64, generator=g)
    feats = torch.randn(1, 5, base.fc.in_features, generator=g)
    pos = torch.arange(9)[None]
    with torch.no_grad():
        want = base(position_ids=pos, noise_embedding=2 * noise, target_hidden=feats)
        got = times2(position_ids=pos, noise_embedding=noise, target_hidden=feats)
    assert torch.allclose(got, want, atol=1e-6)


def test_eval_and_training_score_the_logits_the_engines_draft_from() -> None:
    from dflash.eval.spec_decode import speculative_generate
    from dflash.model.loss import DraftHead, draft_head
    from dflash.model.target import TargetModel

    target = TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)
    model = scaled("dflash2", output_multiplier=3.0, final_logit_softcapping=0.05)
    res = speculative_generate(target, model, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6, keep_draft_logits=True)
    assert res.draft_logits and all(float(k.abs().max()) <= 0.05 + 1e-6 for k in res.draft_logits)  # within the cap
    head = target.head().lm_head
    assert draft_head(scaled("dflash"), head) is head
    shaped = draft_head(model, head)
    assert isinstance(shaped, DraftHead) and shaped.weight is head.weight
    h = torch.randn(3, 64)
    assert torch.equal(shaped(h), model.draft_logits(head(h)))


def test_the_scale_keys_are_read_kept_and_exported_and_refused_where_no_engine_reads_them(tmp_path: Path) -> None:
    from dflash.checkpoint.checkpoints import load_drafter, save_checkpoint
    from dflash.serve.speculators_format import speculators_config

    keys = {"output_multiplier": 0.5, "final_logit_softcapping": 30.0, "input_embedding_scale": 2.0}
    assert config_keys.refusal({**DFLASH2, "dflash_config": {**DFLASH2["dflash_config"], **keys}}) is None
    folder = save_checkpoint(tmp_path / "ck", step=1, drafter=scaled("dflash2", **keys), trainer_state={})
    data = json.loads((folder / "config.json").read_text())
    assert {k: data["dflash_config"][k] for k in keys} == keys and config_keys.refusal(data) is None
    assert load_drafter(folder).config.logit_softcap == 30.0  # init_from and eval read it back
    from dflash.serve.export import export

    out = export(folder, tmp_path / "out")
    served = json.loads((out / "config.json").read_text())
    assert {k: served["dflash_config"][k] for k in keys} == keys  # what vLLM and SGLang read
    assert "def draft_logits(" in (out / "dflash.py").read_text()  # the remote code computes them too
    with pytest.raises(ContractError, match=r"^--format speculators: dflash_config.output_multiplier = 0.5: "):
        speculators_config(data, verifier="t", verifier_architectures=["Qwen3ForCausalLM"], num_verifier_layers=4)
    line = config_keys.refusal({**QWEN3, "dflash_config": {**QWEN3["dflash_config"], "final_logit_softcapping": 30}})
    assert line is not None and "on a DFlash drafter: the engines read it for DFlash2 drafters only" in line
    line = config_keys.refusal({**DFLASH2, "logit_scale": 2.0})
    assert line is not None and line.startswith("logit_scale = 2.0 on a DFlash2 drafter")
    with pytest.raises(ValueError, match=r"^dflash_config.output_multiplier: expected a positive number, got -1"):
        scaled("dflash2", output_multiplier=-1).config._check_dflash_keys()
