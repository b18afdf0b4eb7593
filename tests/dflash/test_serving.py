"""Exports every engine reads the same way (dflash.model.contract, --format speculators, the card)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash.__main__ import main
from dflash.checkpoint.checkpoints import (
    CheckpointWriteError,
    CheckpointWriter,
    check_servable,
    save_checkpoint,
    snapshot,
)
from dflash.model import contract
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config

MASK = 511
SLIDING = {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 5}

# floor (scripts/test runs it again in .venv-floor): the exported config.json is transformers' to_dict of the drafter
# config
pytestmark = [pytest.mark.floor, pytest.mark.timeout(240)]


def drafter(vocab_size: int = 512, mask: int = MASK, **kw: object) -> DFlashDraftModel:
    cfg = draft_config_for(
        tiny_target_config(vocab_size=vocab_size), num_layers=2, block_size=4, mask_token_id=mask, **kw
    )
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


def checkpoint(root: Path, model: DFlashDraftModel, target: dict[str, object]) -> Path:
    """A checkpoint whose trainer state names the run's target, as training writes it."""
    return save_checkpoint(root, step=5, drafter=model, trainer_state={"config": {"target": target}})


def only_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    return err[0]


def test_checkpoint_and_export_give_vllm_the_trained_layers_and_sglang_one_block_size(
    tmp_path: Path, target_dir: Path
) -> None:
    ck = checkpoint(tmp_path / "ck", drafter(), {"path": str(target_dir)})
    assert main(["export", str(ck), str(tmp_path / "out")]) == 0
    for folder in (ck, tmp_path / "out"):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["dflash_config"]["target_layer_ids"] == [1, 5]
        # vLLM captures the residual stream entering layer k: the output of layer k-1 = z-lab id k-1
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 6]
        assert cfg["dflash_config"]["block_size"] == cfg["block_size"] == 4


def test_export_refuses_a_mask_id_past_the_targets_vocabulary(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a drafter made for a 1024-token vocabulary (init_from another family's), trained against a 512-token target
    ck = checkpoint(tmp_path / "ck", drafter(vocab_size=1024, mask=600), {"path": str(target_dir)})
    out = tmp_path / "out"
    assert main(["export", str(ck), str(out)]) == 2
    assert only_line(capsys) == (
        f"dflash: {out}: not exported: dflash_config.mask_token_id 600 is not below the target's vocabulary "
        "size 512: SGLang cannot resize the target's embeddings and vLLM embeds the MASK row with them"
    )
    assert not out.exists() and not list(tmp_path.glob(".tmp-export-*"))


def test_export_refuses_an_fc_that_does_not_match_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    narrow = {"tiny": {"vocab_size": 512, "hidden_size": 32, "num_layers": 8}}  # the run's target: hidden 32
    ck = checkpoint(tmp_path / "ck", drafter(), narrow)
    out = tmp_path / "out"
    assert main(["export", str(ck), str(out)]) == 2
    assert only_line(capsys) == (
        f"dflash: {out}: not exported: fc.weight is [64, 128], not [hidden_size 64, target_hidden_size 32 x 2 "
        "target layers]: vLLM and SGLang size fc from target_layer_ids and refuse it"
    )
    assert not out.exists()


def _mask_past_vocab(m: DFlashDraftModel) -> None:
    m.config.dflash_config["mask_token_id"] = 512  # type: ignore[index]


def _window_dropped(m: DFlashDraftModel) -> None:
    m.config.sliding_window = None


def _extra_weight(m: DFlashDraftModel) -> None:
    m.register_parameter("mask_embedding", torch.nn.Parameter(torch.zeros(64)))


def _fc_resized(m: DFlashDraftModel) -> None:
    m.fc = torch.nn.Linear(3 * 64, 64, bias=False)


@pytest.mark.parametrize(
    ("spoil", "sliding", "line"),
    [
        (
            _mask_past_vocab,
            False,
            "dflash_config.mask_token_id 512 is not below the drafter's vocabulary size 512: SGLang cannot resize "
            "the target's embeddings and vLLM embeds the MASK row with them",
        ),
        (
            _window_dropped,
            True,
            "layer_types[0] is sliding_attention but sliding_window is None: vLLM refuses a sliding layer without "
            "a window and SGLang builds its causal window from it",
        ),
        (
            _extra_weight,
            False,
            "weights outside z-lab's DFlashDraftModel names: mask_embedding: SGLang skips them silently (serving "
            "random weights in their place) and vLLM refuses them",
        ),
        (
            _fc_resized,
            False,
            "fc.weight is [64, 192], not [hidden_size 64, target_hidden_size 64 x 2 target layers]: vLLM and "
            "SGLang size fc from target_layer_ids and refuse it",
        ),
    ],
    ids=["mask", "window", "weight-name", "fc"],
)
def test_checkpoint_save_refuses_what_an_engine_would_refuse_or_get_wrong(
    tmp_path: Path, spoil: object, sliding: bool, line: str
) -> None:
    model = drafter(**(SLIDING if sliding else {}))
    spoil(model)  # type: ignore[operator]
    with pytest.raises(contract.ContractError) as caught:
        save_checkpoint(tmp_path / "ck", step=1, drafter=model, trainer_state={})
    assert str(caught.value) == line
    assert not (tmp_path / "ck").exists()  # refused before anything is written
    with pytest.raises(contract.ContractError) as at_start:  # what dflash train checks before step 1
        check_servable(model, model.config)
    assert str(at_start.value) == line

    writer = CheckpointWriter(tmp_path / "bg")  # the trainer's background writer says the same line
    writer.submit(snapshot(model, step=2, trainer_state={}))
    with pytest.raises(CheckpointWriteError, match=f"could not be written to {tmp_path / 'bg'}: ContractError: "):
        writer.wait()
    assert not (tmp_path / "bg").exists()


def test_the_model_card_gives_the_exact_vllm_and_sglang_command_lines_and_the_eval_figures(
    tmp_path: Path, target_dir: Path
) -> None:
    ck = checkpoint(tmp_path / "ck", drafter(), {"path": str(target_dir)})
    report = tmp_path / "eval.json"
    report.write_text(
        json.dumps(
            {
                "tau": 3.27,
                "num_prompts": 8,
                "prompts": "eval.jsonl",
                "max_new_tokens": 64,
                "target": str(target_dir),
                "all_equal": True,
                "position_acceptance": [0.81, 0.55, 0.30],
            }
        )
    )
    out = tmp_path / "served"
    assert main(["export", str(ck), str(out), "--eval", str(report)]) == 0
    card = (out / "README.md").read_text()
    assert (
        f'vllm serve {target_dir} --speculative-config \'{{"method": "dflash", "model": "{out}", '
        '"num_speculative_tokens": 3}\''
    ) in card.splitlines()
    # the global flag reaches only the target's backend since vLLM PR #39930: never on the command line
    assert not [ln for ln in card.splitlines() if "vllm serve" in ln and "--attention-backend" in ln]
    assert '`"attention_backend": "FLASH_ATTN"` inside `--speculative-config`' in card
    assert (
        f"python -m sglang.launch_server --model-path {target_dir} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {out} --speculative-num-draft-tokens 4"
    ) in card.splitlines()
    assert "tau 3.27" in card and "Acceptance by draft position (1..B-1): 0.81 0.55 0.30" in card

    named = tmp_path / "Qwen3-tiny-DFlash-b4"  # vLLM detects the method from such a path
    assert main(["export", str(ck), str(named)]) == 0
    card = (named / "README.md").read_text()
    assert (
        f'vllm serve {target_dir} --speculative-config \'{{"model": "{named}", "num_speculative_tokens": 3}}\''
    ) in card.splitlines()

    assert "- trained context: unknown" in card.splitlines()  # a run that does not record data.max_length
    assert "- sliding window: none (every layer attends to the whole context)" in card.splitlines()

    mixed = save_checkpoint(
        tmp_path / "mixed",
        step=5,
        drafter=drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=5),
        trainer_state={"config": {"target": {"path": str(target_dir)}, "data": {"max_length": 4096}}},
    )
    assert main(["export", str(mixed), str(tmp_path / "m")]) == 0
    card = (tmp_path / "m" / "README.md").read_text()
    # no prefix (vLLM 0.34 has only the V2 runner and refuses =0); the note says what a build before 0.33 needs
    assert "VLLM_USE_V2_MODEL_RUNNER" not in card.split("```bash")[1].split("```")[0]
    assert "on a build before 0.33 put `VLLM_USE_V2_MODEL_RUNNER=1` in front" in card
    assert "- trained context: 4096 tokens (data.max_length)" in card.splitlines()
    assert (
        "- sliding window: 5 tokens on 1 of 2 layers (the engine must serve them as sliding, causal layers)"
    ) in card.splitlines()
    assert "Acceptance past the trained context is not measured" in card


@pytest.mark.parametrize("sliding", [False, True])
def test_export_format_speculators_writes_the_layout_vllm_serves_alone(
    tmp_path: Path, target_dir: Path, sliding: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = checkpoint(tmp_path / "ck", drafter(**(SLIDING if sliding else {})), {"path": str(target_dir)})
    zlab, spec = tmp_path / "zlab", tmp_path / "spec"
    assert main(["export", str(ck), str(zlab)]) == 0
    assert main(["export", str(ck), str(spec), "--format", "speculators"]) == 0
    assert f"in the speculators layout (vllm serve {spec}" in capsys.readouterr().out
    assert sorted(p.name for p in spec.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["speculators_config"]["verifier"] == {
        "architectures": ["Qwen3ForCausalLM"],
        "name_or_path": str(target_dir),
    }
    assert cfg["speculators_config"]["algorithm"] == "dflash"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["aux_hidden_state_layer_ids"] == [2, 6]  # vLLM: eagle aux = these, dflash target_layer_ids = these - 1
    assert cfg["mask_token_id"] == MASK and cfg["block_size"] == 4
    assert cfg["draft_vocab_size"] == 512 and cfg["target_hidden_size"] == 64
    # vLLM: dflash_config.causal = not this, for every layer; full layers were trained non-causal, sliding causal
    assert cfg["sliding_window_non_causal"] is (not sliding)
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and layer["hidden_size"] == 64
    assert layer["layer_types"] == (SLIDING["layer_types"] if sliding else ["full_attention"] * 2)
    assert not {"dflash_config", "block_size", "auto_map", "architectures", "num_target_layers"} & set(layer)
    ours, theirs = load_file(str(spec / "model.safetensors")), load_file(str(zlab / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert f"vllm serve {spec}" in (spec / "README.md").read_text().splitlines()
    assert not [ln for ln in (spec / "README.md").read_text().splitlines() if "--attention-backend" in ln]


def test_export_format_speculators_refuses_in_one_line_what_it_cannot_write(
    tmp_path: Path, target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mixed = drafter(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    mixed_ck = checkpoint(tmp_path / "mixed", mixed, {"path": str(target_dir)})
    last = checkpoint(tmp_path / "last", drafter(target_layer_ids=[1, 7]), {"path": str(target_dir)})
    tiny = checkpoint(tmp_path / "tiny", drafter(), {"tiny": {"vocab_size": 512, "hidden_size": 64, "num_layers": 8}})
    capsys.readouterr()
    assert main(["export", str(mixed_ck), str(tmp_path / "a"), "--format", "speculators"]) == 2
    assert only_line(capsys).startswith(
        f"dflash: {tmp_path / 'a'}: not exported: --format speculators: layer_types ['sliding_attention', "
        "'full_attention'] mix sliding and full attention; vLLM's speculators reader sets one causal flag"
    )
    assert main(["export", str(last), str(tmp_path / "b"), "--format", "speculators"]) == 2
    assert only_line(capsys).startswith(
        f"dflash: {tmp_path / 'b'}: not exported: --format speculators: target_layer_ids [1, 7] read the target's "
        "last layer (7)"
    )
    assert main(["export", str(tiny), str(tmp_path / "c"), "--format", "speculators"]) == 2
    assert only_line(capsys) == (
        "dflash: --format speculators: name the target it serves with (speculators_config.verifier): "
        "--verifier PATH (the run's target is not a local folder)"
    )
    assert (
        main(["export", str(tiny), str(tmp_path / "d"), "--format", "speculators", "--verifier", "Qwen/Qwen3-8B"]) == 2
    )
    assert only_line(capsys) == (
        "dflash: --verifier Qwen/Qwen3-8B: not a local folder: give --verifier a local folder of the target "
        "(its config.json is checked against the drafter)"
    )
    assert main(["export", str(tiny), str(tmp_path / "e"), "--verifier", str(target_dir)]) == 2
    assert only_line(capsys) == "dflash: --verifier goes with --format speculators"
    assert not any((tmp_path / n).exists() for n in "abcde")
    assert (
        main(["export", str(tiny), str(tmp_path / "f"), "--format", "speculators", "--verifier", str(target_dir)]) == 0
    )


def test_contract_names_unknown_and_missing_weights_by_layer_order() -> None:
    data = json.loads(
        json.dumps(
            {
                "num_hidden_layers": 12,
                "hidden_size": 8,
                "vocab_size": 10,
                "block_size": 2,
                "dflash_config": {"mask_token_id": 9, "target_layer_ids": [1]},
            }
        )
    )
    names = contract.weight_names(data)
    shapes = {n: (8, 8) for n in names}
    with pytest.raises(contract.ContractError, match=r"^weights missing: layers\.2\.input_layernorm\.weight, "):
        contract.check(data, {k: v for k, v in shapes.items() if not k.startswith(("layers.2.", "layers.10."))})
    extra = {**shapes, "model.layers.0.mlp.up_proj.weight": (8, 8), "lm_head.weight": (10, 8)}
    with pytest.raises(
        contract.ContractError, match=r"^weights outside z-lab's DFlashDraftModel names: lm_head\.weight, model\."
    ):
        contract.check(data, extra)


def test_contract_keeps_and_refuses_a_dflash_config_block_size_that_differs() -> None:
    data = {"block_size": 16, "dflash_config": {"mask_token_id": 1, "target_layer_ids": [1], "block_size": 8}}
    keyed = contract.serving_keys(data)
    assert keyed["dflash_config"]["block_size"] == 8 and keyed["eagle_aux_hidden_state_layer_ids"] == [2]
    with pytest.raises(contract.ContractError, match=r"^dflash_config\.block_size 8 differs from block_size 16: "):
        contract.check({**keyed, "vocab_size": 4}, {})
