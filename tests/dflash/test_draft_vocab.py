"""An own, smaller draft vocabulary: the maps (hand-checked), the loss on a label outside it, and a tiny run
that trains, evaluates and exports one in the names, shapes and dtypes vLLM 0.34's loader reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.data.samples import Sample
from dflash.model import contract, draft_vocab
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.loss import dflash_loss
from dflash.model.target import tiny_target_config

MASK = 511


def own_drafter(n: int = 3) -> DFlashDraftModel:
    cfg = draft_config_for(
        tiny_target_config(), num_layers=1, block_size=4, mask_token_id=MASK, draft_vocab_size=n, has_own_lm_head=True
    )
    torch.manual_seed(0)
    return DFlashDraftModel(cfg)


def test_the_maps_are_the_most_frequent_ids_in_the_engines_offset_convention() -> None:
    counts = [0] * 512
    counts[1], counts[2], counts[3], counts[5], counts[6] = 5, 2, 5, 1, 7
    d2t, t2d = draft_vocab.maps(counts, 3)
    # by count: 6 (7), then 1 and 3 (5 each, the lower id first); sorted by id: draft 0, 1, 2 = target 1, 3, 6
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 2, 4]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [1, 3, 6]
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 6]  # vLLM compute_logits: targets = base + d2t
    assert draft_vocab.maps(counts, 3)[0].tolist() == d2t.tolist()  # deterministic
    # fewer distinct tokens than the draft vocabulary: the lowest unused ids fill it, as speculators does
    few = [0] * 512
    few[4] = 9
    assert (torch.arange(3) + draft_vocab.maps(few, 3)[0]).tolist() == [0, 1, 4]
    with pytest.raises(ValueError, match="draft_vocab_size: expected 1..512"):
        draft_vocab.maps(counts, 513)

    samples = [Sample([7, 2, 3, 2], [0, 1, 1, 1]), Sample([2, 600, 3], [1, 1, 0])]  # 600: past the vocabulary
    data = type("Data", (), {"__len__": lambda self: 2, "read": lambda self, i: samples[i]})()
    got = draft_vocab.supervised_counts(data, 512)
    assert got[2] == 3 and got[3] == 1 and got.sum() == 4  # supervised tokens only; 7 and the last 3 are not

    model = own_drafter()
    draft_vocab.install(model, d2t, t2d)
    assert draft_vocab.labels(model, torch.tensor([1, 3, 6, 2, 0])).tolist() == [0, 1, 2, -1, -1]
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.eye(3, model.config.hidden_size))
        full = model.engine_logits(
            torch.cat([logits, torch.zeros(1, model.config.hidden_size - 3)], dim=1), nn.Identity()
        )
    assert full.shape == (1, 512) and full[0, [1, 3, 6]].tolist() == [0.5, 2.0, -1.0]
    assert int(full[0].argmax()) == 3 and torch.isinf(full).sum() == 509  # draft 1 -> target 3, -inf elsewhere


def test_a_label_outside_the_draft_vocabulary_has_no_loss_and_counts_as_a_miss() -> None:
    """No logit exists for it, so no gradient target; a served drafter can never propose it, so the metrics
    (accuracy, teacher-forced tau) count it as a miss rather than leaving it out."""
    torch.manual_seed(0)
    head = nn.Linear(8, 3, bias=False)
    hidden = torch.randn(1, 1, 4, 8)
    weights = torch.ones(1, 1, 4)
    best = head(hidden).argmax(-1)  # [1, 1, 4]: the drafter's picks, all "right" below except slot 2
    labels = best.clone()
    labels[0, 0, 2] = -1  # a target token outside the draft vocabulary
    terms = dflash_loss(hidden, head, labels, weights, chunk_size=None)
    kept = weights.clone()
    kept[0, 0, 2] = 0
    without = dflash_loss(hidden, head, best, kept, chunk_size=None)
    assert torch.allclose(terms.loss, without.loss) and terms.weight_sum.item() == 3.0
    assert terms.scored_per_slot.tolist() == [1, 1, 1, 1] and terms.correct_per_slot.tolist() == [1, 1, 0, 1]
    assert terms.accepted_sum.item() == 1  # slot 1 right, slot 2 the miss: the prefix stops there


def vllm_loaded_names(weights: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """The parameter names vLLM 0.34 loads a DFlash folder's weights into, written from
    ``DFlashQwen3ForCausalLM.load_weights`` (vllm/model_executor/models/qwen3_dflash.py lines 981-1003): a name
    with "t2d" is skipped, "d2t" becomes "draft_id_to_target_id", "lm_head" stays, every other gets "model."."""
    out = {}
    for name, w in weights.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        out[name] = tuple(w.shape)
    return out


def test_a_tiny_run_with_an_own_draft_vocabulary_trains_evaluates_and_exports_what_vllm_loads(
    tmp_path: Path, target_dir: Path
) -> None:
    from safetensors.torch import load_file

    from dflash.__main__ import main
    from dflash.checkpoint.checkpoints import load_drafter
    from dflash.models import init_drafter, load_target
    from dflash.train.run import Run
    from tests.dflash.conftest import tiny_config

    n = 64
    cfg = tiny_config(
        tmp_path,
        "checkpoint.resume=never",
        "devices.drafters=cpu",
        "devices.targets=cpu",
        "max_steps=2",
        "log_every=1",
        f"drafter.draft_vocab_size={n}",
    )
    run = Run(cfg, environ={})
    assert run.train() == 0
    model = run.drafters[0].model
    # the draft vocabulary: the n most frequent supervised tokens of the data, counted as draft_vocab does
    counts = draft_vocab.supervised_counts(run.dataset, 512)
    d2t, t2d = draft_vocab.maps(counts, n)
    assert torch.equal(model.d2t.cpu(), d2t) and torch.equal(model.t2d.cpu(), t2d)
    covered = int(counts[t2d.numpy()].sum())
    assert covered == int(sum(sorted(counts)[-n:])) < int(counts.sum())  # the most covered; a real cut
    records = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(math.isfinite(r.get("loss", math.nan)) for r in records)

    ckpt = tmp_path / "ckpt"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 40, 41, 42 + i]}) + "\n" for i in range(2)))
    report = tmp_path / "eval.json"
    assert (
        main(["eval", "--drafter", str(ckpt), "--prompts", str(prompts), "--max-new", "8", "--json", str(report)]) == 0
    )
    assert math.isfinite(json.loads(report.read_text())["tau"])

    out = tmp_path / "served"
    assert main(["export", str(ckpt), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] == n and config["has_own_lm_head"] is True and config["vocab_size"] == 512
    weights = load_file(str(out / "model.safetensors"))
    # What vLLM 0.34 builds and loads (qwen3_dflash.py): lm_head = ParallelLMHead(draft_vocab_size, hidden_size);
    # draft_id_to_target_id = Parameter(zeros(draft_vocab_size, dtype=long)), loaded from "d2t"; "t2d" skipped;
    # every other name gets "model." in front, so the three stay at the top level.
    assert weights["lm_head.weight"].shape == (n, 64) and weights["lm_head.weight"].dtype == torch.bfloat16
    assert weights["d2t"].shape == (n,) and weights["d2t"].dtype == torch.int64
    assert weights["t2d"].shape == (512,) and weights["t2d"].dtype == torch.bool and int(weights["t2d"].sum()) == n
    assert torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)
    assert set(weights) == contract.weight_names(config)
    loaded = vllm_loaded_names(weights)
    assert {"lm_head.weight", "draft_id_to_target_id"} <= set(loaded) and "t2d" not in loaded
    assert all(k.startswith("model.") for k in set(loaded) - {"lm_head.weight", "draft_id_to_target_id"})
    card = (out / "README.md").read_text()
    assert "Not SGLang" in card and "sglang.launch_server" not in card
    # the exported folder is a published drafter: a warm start keeps its maps, eval reads them
    assert torch.equal(load_drafter(out).d2t, d2t)
    warm = tiny_config(tmp_path / "warm", "devices.drafters=cpu", "devices.targets=cpu", f"drafter.init_from={out}")
    init = init_drafter(warm, load_target(warm, "cpu"))
    assert torch.equal(init.d2t, d2t) and torch.equal(init.t2d, t2d) and init.config.draft_vocab == n
    again = tmp_path / "again.json"
    args = ["eval", "--drafter", str(out), "--target", str(target_dir), "--prompts", str(prompts), "--max-new", "8"]
    assert main([*args, "--json", str(again)]) == 0
    assert math.isfinite(json.loads(again.read_text())["tau"])


def test_the_contract_refuses_an_own_vocabulary_vllm_would_misread() -> None:
    from dflash.checkpoint.checkpoints import config_json
    from dflash.serve.speculators_format import speculators_config

    model = own_drafter()
    data = json.loads(config_json(model.config))
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert contract.own_vocab_shapes(data) == {"lm_head.weight": [3, 64], "d2t": [3], "t2d": [512]}
    contract.check(data, shapes)
    with pytest.raises(contract.ContractError, match="^draft_vocab_size 3 without has_own_lm_head true: vLLM"):
        contract.check({**data, "has_own_lm_head": False}, shapes)
    with pytest.raises(contract.ContractError, match=r"^lm_head.weight is \[4, 64\], not \[3, 64\]"):
        contract.check(data, {**shapes, "lm_head.weight": [4, 64]})
    assert contract.sglang_command(target="t", drafter="d", block_size=4, own_vocab=True) is None
    # --format speculators: N at the top (vLLM update_dflash copies it), has_own_lm_head in the layer config
    # (the dict vLLM builds the drafter's config from; update_dflash does not copy it from the top)
    spec = speculators_config(data, verifier="t", verifier_architectures=["Qwen3ForCausalLM"], num_verifier_layers=8)
    assert spec["draft_vocab_size"] == 3 and spec["transformer_layer_config"]["has_own_lm_head"] is True


def test_the_run_config_refuses_a_draft_vocabulary_it_cannot_train(tmp_path: Path) -> None:
    from dflash.config import ConfigError
    from tests.dflash.conftest import tiny_config

    with pytest.raises(ConfigError, match=r"^drafter.draft_vocab_size: must be below the vocabulary \(512\)"):
        tiny_config(tmp_path, "drafter.draft_vocab_size=512")
    with pytest.raises(ConfigError, match="^drafter.draft_vocab_size: a dflash2 drafter reranks"):
        tiny_config(tmp_path, "drafter.draft_vocab_size=64", "drafter.kind=dflash2", "drafter.conv_group_size=8")
    assert tiny_config(tmp_path).drafter.draft_vocab_size is None  # unset: the target's vocabulary and lm_head


def test_eval_untrained_refuses_a_run_whose_draft_vocabulary_is_counted_at_its_start(tmp_path: Path) -> None:
    from dflash.eval.evaluate import EvalError, load_setup
    from tests.dflash.conftest import TINY

    text = TINY.read_text().replace('"tiny-data.jsonl"', json.dumps(str(TINY.parent / "tiny-data.jsonl")))
    config = tmp_path / "run.toml"
    config.write_text(text.replace("num_anchors = 16", "num_anchors = 16\ndraft_vocab_size = 64"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 40, 41]}) + "\n")
    with pytest.raises(EvalError, match="^--untrained: drafter.draft_vocab_size: the draft vocabulary is counted"):
        load_setup(drafter=None, untrained=True, config=str(config), prompts=str(prompts))
