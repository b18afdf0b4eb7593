"""DFlash2 drafters (``drafter.kind = "dflash2"``): the block convolutions, the candidate selector, its training
objective and figures, tiny runs of both kinds and weightings through ``dflash train``, and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash.checkpoint import checkpoints as ckpt
from dflash.config import ConfigError, RunConfig
from dflash.eval.evaluate import evaluate
from dflash.eval.spec_decode import Sampler, draft_tokens, speculative_generate, target_greedy, target_sample
from dflash.model.drafter import (
    BlockConv,
    CandidateSelector,
    DFlashDraftModel,
    block_conv,
    draft_config_for,
    selector_walk,
)
from dflash.model.loss import dflash_loss, drafter_loss
from dflash.model.target import TargetModel, tiny_target_config
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}

pytestmark = pytest.mark.timeout(240)


def drafter(kind: str, *, block_size: int = 4, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = draft_config_for(
        tiny_target_config(),
        num_layers=2,
        block_size=block_size,
        mask_token_id=511,
        dflash2=DFLASH2 if kind == "dflash2" else None,
    )
    return DFlashDraftModel(cfg)


# ---- the convolution and the selector (pure) ---------------------------------------------


def test_block_conv_is_the_grouped_dynamic_convolution_inside_each_block() -> None:
    torch.manual_seed(0)
    block, taps, group, hidden = 4, 3, 2, 6
    x = torch.randn(2, 2 * block, hidden)
    delta = torch.randn(2, 2 * block, taps, hidden // group)
    base = torch.randn(taps, hidden)
    got = block_conv(x, delta, base, block_size=block, group_size=group)
    want = torch.zeros_like(x)
    for b in range(2):
        for q in range(2 * block):
            for tap in range(taps):
                if q % block - tap < 0:
                    continue  # never reaches into the previous block
                for c in range(hidden):
                    want[b, q, c] += (base[tap, c] + delta[b, q, tap, c // group]) * x[b, q - tap, c]
    assert torch.allclose(got, want, atol=1e-5)


def test_a_new_dflash2_drafter_computes_what_dflash_does() -> None:
    """Both convolutions start as the identity: with the shared weights equal, the outputs are equal."""
    d1, d2 = drafter("dflash"), drafter("dflash2")
    extra = set(d2.state_dict()) - set(d1.state_dict())
    assert extra == {
        *(
            f"layers.{i}.{c}.{w}"
            for i in range(2)
            for c in ("attention_conv", "mlp_conv")
            for w in ("base_kernel", "kernel_projection.weight")
        ),
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight",
    }
    d2.load_state_dict({**d2.state_dict(), **d1.state_dict()})
    conv = d2.layers[0].attention_conv
    assert isinstance(conv, BlockConv) and conv.base_kernel[:, 0].eq(1).all() and conv.base_kernel[:, 1:].eq(0).all()
    sel = d2.candidate_selector
    assert isinstance(sel, CandidateSelector) and 0.01 < float(sel.predecessor_codebook.detach().std()) < 0.03
    hidden = d1.config.hidden_size
    th, ne = torch.randn(1, 10, len(d1.target_layer_ids) * hidden), torch.randn(1, 8, hidden)
    pos = torch.arange(18)[None]
    assert torch.equal(d1(pos, None, ne, th), d2(pos, None, ne, th))
    assert d2.config.architectures == ["DFlash2DraftModel"] and d2.kind == "dflash2"


def test_the_walk_reranks_by_the_previous_token() -> None:
    vocab, rank = 6, 2
    sel = CandidateSelector(vocab_size=vocab, hidden_size=2, rank=rank, top_k=2)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.predecessor_codebook[0] = torch.tensor([1.0, 0.0])  # after token 0 ...
        sel.successor_codebook[2] = torch.tensor([10.0, 0.0])  # ... token 2 scores +10
        sel.successor_codebook[3] = torch.tensor([10.0, 0.0])  # (and 3, after a token that has a code)
    logits = torch.full((1, 2, vocab), -5.0)
    logits[0, 0, 1], logits[0, 0, 2] = 2.0, 1.0  # slot 1: unary 1 > 2
    logits[0, 1, 4], logits[0, 1, 3] = 2.0, 1.0  # slot 2: unary 4 > 3
    hidden = torch.ones(1, 2, 2)
    tokens, dist = selector_walk(sel, logits, hidden, torch.tensor([0]))
    assert tokens.tolist() == [[2, 4]]  # the anchor 0 lifts 2 over 1; after 2 (no code) slot 2 stays unary
    tokens, _ = selector_walk(sel, logits, hidden, torch.tensor([5]))
    assert tokens.tolist() == [[1, 4]]
    with torch.no_grad():
        sel.predecessor_codebook[1] = torch.tensor([1.0, 0.0])  # now after token 1, token 3 wins slot 2
    tokens, dist = selector_walk(sel, logits, hidden, torch.tensor([5]))
    assert tokens.tolist() == [[1, 3]] and dist[0, 1, 3] == 1 and dist.sum(-1).eq(1).all()
    tokens, dist = selector_walk(
        sel, logits, hidden, torch.tensor([5]), temperature=1.0, generator=torch.Generator().manual_seed(0)
    )
    assert (
        torch.allclose(dist.sum(-1), torch.ones(1, 2)) and (dist > 0).sum(-1).eq(2).all()
    )  # q lives on the K candidates


def test_the_selector_objective_injects_a_missing_label_and_counts_picks() -> None:
    torch.manual_seed(3)
    vocab, block, hidden_size = 12, 4, 8
    sel = CandidateSelector(vocab_size=vocab, hidden_size=hidden_size, rank=4, top_k=3)
    sel.reset_parameters(0.5)
    head = nn.Linear(hidden_size, vocab, bias=False).requires_grad_(False)
    hidden = torch.randn(1, 3, block, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, 3, block))
    weights = torch.ones(1, 3, block)
    weights[..., 0] = 0
    plain = dflash_loss(hidden, head, labels, weights, chunk_size=None)
    both = dflash_loss(hidden, head, labels, weights, chunk_size=2, selector=sel, selector_weight=0.5)
    logits = head(hidden).detach()
    top = logits.topk(3, dim=-1).indices
    in_top = (top == labels[..., None]).any(-1) & (weights > 0)
    assert both.in_top_k is not None and int(both.in_top_k) == int(in_top.sum())
    assert both.selector_correct is not None and 0 <= int(both.selector_correct) <= int(in_top.sum())
    assert both.loss > plain.loss  # the selector's cross-entropy is added
    both.loss.backward()
    assert sel.predecessor_codebook.grad is not None and sel.predecessor_codebook.grad.abs().sum() > 0


# ---- tiny runs ---------------------------------------------------------------------------


def tiny(tmp_path: Path, *overrides: str) -> RunConfig:
    return tiny_config(
        tmp_path, "log_every=2", "max_steps=4", "drafter.selector_rank=8", "drafter.selector_top_k=8", *overrides
    )


def records(tmp_path: Path) -> list[dict[str, object]]:
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "step" in r and "loss" in r]


@pytest.mark.parametrize(("kind", "weight"), [("dflash2", "decay"), ("dflash2", "dpace"), ("dflash", "dpace")])
def test_tiny_runs_of_each_kind_and_weighting(tmp_path: Path, kind: str, weight: str) -> None:
    run = Run(tiny(tmp_path, f"drafter.kind={kind}", f"loss.position_weight={weight}"), environ={})
    assert run.train() == 0
    recs = records(tmp_path)
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        assert isinstance(r["loss"], float) and r["loss"] == r["loss"]
        if kind == "dflash2":
            assert isinstance(r["sel_acc"], float) and 0.0 <= r["sel_acc"] <= 1.0
            assert isinstance(r["top_k_rate"], float) and 0.0 < r["top_k_rate"] <= 1.0
        else:
            assert "sel_acc" not in r and "top_k_rate" not in r
    saved = ckpt.load_checkpoint(ckpt.latest_complete(tmp_path / "ckpt"))
    data = json.loads((saved.path / "config.json").read_text())
    assert data["architectures"] == [("DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel")]
    assert ("selector_rank" in data["dflash_config"]) == (kind == "dflash2")


def test_a_dflash2_run_resumes_with_its_convolutions_and_selector(tmp_path: Path) -> None:
    first = Run(tiny(tmp_path, "drafter.kind=dflash2"), environ={})
    assert first.train() == 0
    weights = {k: v.clone() for k, v in first.drafters[0].model.state_dict().items()}
    assert not torch.equal(weights["layers.0.attention_conv.kernel_projection.weight"], torch.zeros(1))
    second = Run(tiny(tmp_path, "drafter.kind=dflash2", "max_steps=6"), environ={})
    assert second.start_step == 4
    got = second.drafters[0].model.state_dict()
    for k in ("candidate_selector.successor_codebook", "layers.1.mlp_conv.base_kernel"):
        assert torch.equal(got[k], weights[k]), k
    assert second.train() == 0
    with pytest.raises(ConfigError, match=r"^drafter.kind: the checkpoint .* has kind=dflash2, this run dflash"):
        Run(tiny(tmp_path, "max_steps=8"), environ={})


def test_bad_dflash2_and_loss_keys_are_one_line_config_errors(tmp_path: Path) -> None:
    for override, key in (
        ("drafter.kind=dflash3", "drafter.kind"),
        ("loss.position_weight=linear", "loss.position_weight"),
        ("loss.dpace_alpha=1.5", "loss.dpace_alpha"),
        ("drafter.conv_group_size=7", "drafter.conv_group_size"),
        ("drafter.conv_kernel_size=9", "drafter.conv_kernel_size"),
        ("drafter.selector_top_k=1000", "drafter.selector_top_k"),
    ):
        with pytest.raises(ConfigError, match=rf"^{key}: "):
            tiny(tmp_path, "drafter.kind=dflash2", override) if "kind=" not in override else tiny(tmp_path, override)


def test_dflash_train_cli_trains_a_dflash2_drafter_with_dpace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command in this process (test_train.py runs `python -m dflash train` as a process of its own)."""
    from dflash.__main__ import main

    args = ["train", "--config", str(TINY)]
    for o in (
        f"output_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        "log_every=2",
        "max_steps=4",
        "checkpoint.interval=0",
        "drafter.kind=dflash2",
        "drafter.selector_rank=8",
        "loss.position_weight=dpace",
        "loss.dpace_alpha=0.3",
    ):
        args += ["--set", o]
    monkeypatch.delenv("DFLASH_RUN_DIR", raising=False)
    capsys.readouterr()
    rc = main(args)
    out, err = capsys.readouterr()
    assert rc == 0, err[-2000:]
    steps = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2 and all(" | sel " in ln and " | top-k " in ln for ln in steps)


# ---- speculative decoding ----------------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)


def prompt(seed: int, length: int = 10) -> torch.Tensor:
    return torch.randint(0, 500, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def trained2(target: TargetModel) -> DFlashDraftModel:
    """A DFlash2 drafter trained a little on the target's own greedy text (blocks get accepted)."""
    d = drafter("dflash2", block_size=6)
    rows = [target_greedy(target, prompt(s), max_new_tokens=48) for s in (1, 2, 3)]
    input_ids = torch.cat(rows)
    loss_mask = torch.ones_like(input_ids)
    loss_mask[:, :10] = 0
    feats, head = target.features(input_ids), target.head()
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        out = drafter_loss(d, head, input_ids, loss_mask, feats, num_anchors=16, generator=g, chunk_size=8)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return d.eval()


def test_dflash2_decoding_is_the_targets_greedy_output_with_the_selectors_drafts(
    target: TargetModel, trained2: DFlashDraftModel
) -> None:
    for seed in (1, 9):
        p = prompt(seed)
        result = speculative_generate(target, trained2, p, max_new_tokens=40)
        assert torch.equal(result.tokens, target_greedy(target, p, max_new_tokens=40))
        assert sum(a + 1 for a in result.accept_lengths) == 39
    assert speculative_generate(target, trained2, prompt(1), max_new_tokens=40).tau > 1.5
    # The drafts are the selector's walk: a selector that favours token 7 after anything drafts 7s
    biased = drafter("dflash2", block_size=6)
    biased.load_state_dict(trained2.state_dict())
    sel = biased.candidate_selector
    assert sel is not None
    with torch.no_grad():
        sel.successor_codebook[:] = 0
        sel.successor_codebook[7] = 100.0
        sel.predecessor_codebook.fill_(1.0)
        sel.hidden_projection.weight.fill_(0.0)
        sel.hidden_projection.weight[:, 0] = 1.0
    hidden = torch.ones(1, 3, biased.config.hidden_size)
    logits = torch.zeros(1, 3, 512)
    logits[..., 7] = 1.0  # 7 among every slot's top-k
    assert draft_tokens(biased, hidden, logits, torch.tensor([0])).tolist() == [[7, 7, 7]]
    assert draft_tokens(drafter("dflash"), hidden, logits + torch.arange(512.0), torch.tensor([0])).tolist() == [
        [511, 511, 511]
    ]
    p = prompt(2)
    assert torch.equal(
        speculative_generate(target, biased, p, max_new_tokens=30).tokens, target_greedy(target, p, max_new_tokens=30)
    )


def test_dflash2_sampled_decoding_is_the_targets_own_sampling(target: TargetModel, trained2: DFlashDraftModel) -> None:
    p = prompt(1)
    sampler = Sampler(1.0, seed=0, stream=0)
    spec = speculative_generate(target, trained2, p, max_new_tokens=40, sampler=sampler)
    assert torch.equal(spec.tokens, target_sample(target, p, max_new_tokens=40, sampler=sampler))
    prompts = [prompt(s)[0].tolist() for s in (1, 2)]
    for temperature in (0.0, 1.0):
        report = evaluate(target, trained2, prompts, max_new_tokens=30, ddtree_budget=None, temperature=temperature)
        assert report.all_equal and report.tau >= 1.0


# ---- export and the contract -------------------------------------------------------------


def test_zlab_export_of_a_dflash2_drafter_and_the_contracts_refusals(tmp_path: Path, target_dir: Path) -> None:
    from dflash.__main__ import main
    from dflash.model import contract

    ck = ckpt.save_checkpoint(
        tmp_path / "ck",
        step=3,
        drafter=drafter("dflash2"),
        trainer_state={"config": {"target": {"path": str(target_dir)}}},
    )
    out = tmp_path / "zlab"
    assert main(["export", str(ck), str(out)]) == 0
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["DFlash2DraftModel"]
    assert {k: data["dflash_config"][k] for k in DFLASH2} == DFLASH2  # where vLLM and SGLang read them
    card = (out / "README.md").read_text()
    assert "This drafter is DFlash2: only vLLM's V2 model runner serves it" in card and "DFlash2DraftModel" in card
    from safetensors.torch import load_file

    shapes = {k: list(v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}
    assert shapes["layers.0.attention_conv.base_kernel"] == [2, 3, 64]
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == [2 * 3 * 4, 64]
    assert shapes["candidate_selector.predecessor_codebook"] == [512, 8]
    contract.check(data, shapes)
    refusals = [
        ({**data, "architectures": ["DFlashDraftModel"]}, shapes, r"architectures \['DFlashDraftModel'\] with DFlash2"),
        (
            {**data, "dflash_config": {k: v for k, v in data["dflash_config"].items() if k != "selector_top_k"}},
            shapes,
            r"but not \['selector_top_k'\]",
        ),
        (data, {**shapes, "candidate_selector.transition_bias": [4]}, r"^weights outside"),
        (data, {**shapes, "candidate_selector.successor_codebook": [512, 9]}, r"successor_codebook is \[512, 9\]"),
        (data, {k: v for k, v in shapes.items() if "mlp_conv" not in k}, r"^weights missing: layers.0.mlp_conv"),
        (
            {**data, "dflash_config": {k: v for k, v in data["dflash_config"].items() if k not in DFLASH2}},
            {k: v for k, v in shapes.items() if "conv" not in k and "selector" not in k},
            r"names DFlash2 but dflash_config has none",
        ),
    ]
    for bad, bad_shapes, message in refusals:
        with pytest.raises(contract.ContractError, match=message):
            contract.check(bad, bad_shapes)


# ---- compile -----------------------------------------------------------------------------


def test_a_compiled_dflash2_run_warms_up_and_trains(tmp_path: Path) -> None:
    """The convolutions trace inside each compiled layer (fullgraph: a graph break would fail here), warm-up
    compiles every shape class first, and the run trains without a recompile (aot_eager/inductor cost minutes
    on 2 shared cores: dynamo's tracing is what this checks)."""
    run = Run(
        tiny(
            tmp_path, "drafter.kind=dflash2", "compile=true", "compile_backend=eager", "activation_checkpointing=true"
        ),
        environ={},
    )
    assert all(layer._compiled_call_impl is not None for r in run.drafters for layer in r.model.layers)
    assert run.train() == 0
    assert [r["step"] for r in records(tmp_path)] == [2, 4]
