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
    assert set(CONFIGS_LINE["speculators-32k"]) == {"draft_vocab_size", "has_own_lm_head"}
    assert "an own, smaller draft vocabulary" in CONFIGS_LINE["speculators-32k"]["draft_vocab_size"]
    assert set(CONFIGS_LINE["vllm-test"]) == {
        "dflash_config.causal",
        "dflash_config.attention_sink_bias",
        "dflash_config.attention_value_scale",
        "logit_scale",
    }
    assert CONFIGS_LINE["vllm-test"]["dflash_config.causal"].startswith(
        "dflash_config.causal = true makes layer 4 (full_attention) causal: every layer's causality, when is_causal "
        "is absent, honoured by vLLM"
    )
    assert set(CONFIGS_LINE["sglang-domino"]) == {
        f"dflash_config.{k}"
        for k in ("projector_type", "shift_label", "pure_draft_prefix_len", "gru_hidden_dim", "emb_dim")
    }
    assert {"dflash_config.final_logit_softcapping", "dflash_config.output_multiplier"} >= set(CONFIGS_LINE["dflash2"])


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
    """One published folder (config.json + model.safetensors) with ``has_own_lm_head: true``: the same
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
    data["has_own_lm_head"] = True
    (folder / "config.json").write_text(json.dumps(data))
    one = r"has_own_lm_head = true: the drafter's own lm_head, honoured by vLLM \(.*\); not implemented here"
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
