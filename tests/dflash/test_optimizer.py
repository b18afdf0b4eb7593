"""``optim.name = "muon"``: Muon on the drafter's hidden matrices, AdamW on the rest, through the real run on the
tiny target: it trains, averaging leaves each replica its own momentum, a NaN update is skipped, and a resumed
replica takes the same next step as the one that kept going."""

from __future__ import annotations

import io
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.config import ConfigError
from dflash.data.samples import collate
from dflash.train.optimizer import DrafterOptimizer, muon_split
from dflash.train.replicas import DrafterReplica, FeatureBatch
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

pytestmark = pytest.mark.timeout(240)


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest() -> None:
    named = [
        ("layers.0.self_attn.q_proj.weight", torch.zeros(64, 64)),
        ("fc.weight", torch.zeros(64, 128)),
        ("layers.0.input_layernorm.weight", torch.zeros(64)),
        ("layers.0.self_attn.q_proj.bias", torch.zeros(64)),
        ("selector.predecessor_codebook", torch.zeros(512, 32)),  # a table indexed by token
        ("embed_tokens.weight", torch.zeros(512, 64)),
        ("lm_head.weight", torch.zeros(512, 64)),
        ("conv.base_kernel", torch.zeros(2, 4, 64)),  # 3-D
        ("gate.weight", torch.zeros(1, 64)),  # a vector stored as a matrix
    ]
    assert muon_split(named) == ([0, 1], [2, 3, 4, 5, 6, 7, 8])
    o = tiny_config(Path("/nonexistent"), "optim.name=muon", "optim.lr=1e-3", "optim.muon_lr=1e-2").optim
    opt = DrafterOptimizer([n for n, _ in named], [p for _, p in named], o, device="cpu")
    assert opt.muon is not None and opt.adamw is not None
    opt.set_lr(5e-4)  # the schedule's lr: Muon's on the same schedule, 10x
    assert [g["lr"] for g in opt.adamw.param_groups] == [5e-4]
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(5e-3)]
    assert opt.muon.defaults["adjust_lr_fn"] == "match_rms_adamw"


def payload(run: Run) -> FeatureBatch:
    batch = collate([run.dataset.read(i) for i in range(4)], index=0)
    return FeatureBatch(batch.input_ids, batch.loss_mask, run.targets[0].produce(batch).features, 0)


def momenta(r: DrafterReplica) -> list[torch.Tensor]:
    assert r.optimizer.muon is not None
    return [r.optimizer.muon.state[p]["momentum_buffer"].clone() for p in r.optimizer.muon.param_groups[0]["params"]]


def state_of(r: DrafterReplica) -> list[torch.Tensor]:
    """Everything the next update reads: masters, Muon's momentum, AdamW's moments and step."""
    adamw = t.cast(torch.optim.AdamW, r.optimizer.adamw)
    moments = [v.clone() for s in adamw.state.values() for v in s.values()]
    return [m.detach().clone() for m in r.masters] + momenta(r) + moments


def test_muon_trains_averages_weights_not_momentum_and_resumes_to_the_same_next_step(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "max_steps=4", "average_every=2", "optim.name=muon", "log_every=2")
    first = Run(cfg, environ={}, stream=io.StringIO())
    names = set(first.drafters[0].optimizer.muon_names)
    assert "fc.weight" in names and "layers.1.mlp.down_proj.weight" in names and len(names) == 15
    before = [m.detach().clone() for m in first.drafters[0].masters]
    assert first.train() == 0
    a, b = first.drafters
    assert a.trained and b.trained
    assert all(torch.isfinite(m).all() for m in a.masters)
    assert not any(torch.equal(x, y) for x, y in zip(before, a.masters)), "every trainable tensor moved"
    # averaging: the same weights in both replicas, each its own (non-zero) momentum
    assert all(torch.equal(x, y) for x, y in zip(a.masters, b.masters))
    ma, mb = momenta(a), momenta(b)
    assert all(m.abs().sum() > 0 for m in ma + mb)
    assert not any(torch.equal(x, y) for x, y in zip(ma, mb)), "momentum is per replica, never averaged"

    saved = ckpt.load_checkpoint(ckpt.latest_complete(tmp_path / "ckpt"))
    (opt,) = saved.optimizer_state["replicas"]
    assert set(opt) == {"muon", "adamw"}
    second = Run(cfg, environ={}, stream=io.StringIO())
    assert second.start_step == 4
    for r in second.drafters:  # every replica gets the saved replica's state: the first one's
        assert all(torch.equal(x, y) for x, y in zip(state_of(r), state_of(a)))
    r = second.drafters[0]  # and its anchor generator: its next step is the first one's
    x = payload(first)
    la, lr_ = float(a.step(x, step=5).loss), float(r.step(x, step=5).loss)
    assert la == lr_ and all(torch.equal(p, q) for p, q in zip(state_of(a), state_of(r))), "the same next step"

    # a NaN update never reaches the weights nor Muon's momentum (nor AdamW's step count)
    kept = state_of(r)
    r.poison = lambda step: step == 6
    assert int(t.cast(torch.Tensor, r.step(x, step=6).nonfinite)) == 1
    assert all(torch.equal(p, q) for p, q in zip(kept, state_of(r)))

    with pytest.raises(ConfigError, match=r"^optim.name: the checkpoint .* was trained with muon, this run adamw;"):
        Run(tiny_config(tmp_path, "max_steps=4"), environ={}, stream=io.StringIO())
