"""torch.compile + activation checkpointing on the real tiny drafter: the same loss and gradients as neither.

Inductor needs minutes to compile even these tiny layers on this 2-core box (measured: 161 s, identical loss,
gradients within 7.5e-8), so the test compiles with ``aot_eager``: dynamo tracing plus AOTAutograd's joint
forward/backward graph, which is where compile and checkpointing used to clash ("a different number of
tensors was saved during the original forward and recomputation").

The checkpoint must be INSIDE the compiled layer, whatever the transformers version: the drafter layer
checkpoints its own forward (not transformers' GradientCheckpointingLayer, whose ``__call__`` put the
checkpoint around the compiled call in 5.x), so dynamo's graph holds the ``tag_activation_checkpoint`` op.
"""

from __future__ import annotations

import copy
import io
import typing as t
from pathlib import Path

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from dflash.config import load_config
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.loss import drafter_loss
from dflash.model.target import TargetModel, tiny_target_config
from dflash.train.compile import prepare_drafter
from dflash.train.run import Run

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def parts() -> dict[str, object]:
    target = TargetModel.from_config(tiny_target_config(initializer_range=0.1), seed=0, num_draft_layers=2)
    cfg = draft_config_for(
        target.model.config, num_layers=2, block_size=8, mask_token_id=511, target_layer_ids=target.layer_ids
    )
    torch.manual_seed(0)
    drafter = DFlashDraftModel(cfg)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 500, (2, 40), generator=g)
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[:, :5] = 0
    return {"drafter": drafter, "head": target.head(), "ids": ids, "mask": mask, "feats": target.features(ids)}


def loss_and_grads(
    parts: dict[str, object], *, checkpointing: bool, compile: bool, graphs: list[torch.fx.GraphModule] | None = None
) -> tuple[float, list[torch.Tensor], int]:
    model = copy.deepcopy(parts["drafter"])
    assert isinstance(model, DFlashDraftModel)
    model.train()
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def recording(gm: torch.fx.GraphModule, example_inputs: list[t.Any]) -> t.Any:
        if graphs is not None:
            graphs.append(gm)
        return aot_eager(gm, example_inputs)

    prepare_drafter(model, activation_checkpointing=checkpointing, compile=compile, backend=recording, dynamic=False)
    calls = [0]
    if not compile:  # count MLP calls: checkpointing runs each layer again in the backward
        # (a pre-hook: early-stopping recomputation ends inside the MLP, before a forward hook would run)
        model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    out = drafter_loss(
        model,
        parts["head"],
        parts["ids"],
        parts["mask"],
        parts["feats"],
        num_anchors=8,
        gamma=4.0,
        generator=torch.Generator().manual_seed(1),
        chunk_size=4,
    )
    out.loss.backward()
    return float(out.loss.detach()), [p.grad.clone() for p in model.parameters()], calls[0]


def checkpoints_in(graphs: list[torch.fx.GraphModule]) -> int:
    return sum(n.target is torch.ops.higher_order.tag_activation_checkpoint for g in graphs for n in g.graph.nodes)


@pytest.mark.floor  # floor: transformers' Qwen3 modules inside the compiled layer
def test_compile_with_checkpointing_matches_neither(parts: dict[str, object]) -> None:
    torch._dynamo.reset()
    plain, plain_grads, plain_calls = loss_and_grads(parts, checkpointing=False, compile=False)
    ac, ac_grads, ac_calls = loss_and_grads(parts, checkpointing=True, compile=False)
    compiled_graphs: list[torch.fx.GraphModule] = []
    compiled, compiled_grads, _ = loss_and_grads(parts, checkpointing=False, compile=True, graphs=compiled_graphs)
    torch._dynamo.reset()  # the same layer code again, with checkpointing: compile it afresh
    both_graphs: list[torch.fx.GraphModule] = []
    both, both_grads, _ = loss_and_grads(parts, checkpointing=True, compile=True, graphs=both_graphs)
    assert (plain_calls, ac_calls) == (1, 2), "checkpointing recomputes the layer in the backward"
    # the checkpoint is in the compiled layer's graph (one per graph), and only when asked for
    assert both_graphs and checkpoints_in(both_graphs) == len(both_graphs)
    assert compiled_graphs and checkpoints_in(compiled_graphs) == 0
    assert ac == plain
    assert compiled == pytest.approx(plain, abs=1e-6) and both == pytest.approx(plain, abs=1e-6)
    for a, b, c, d in zip(plain_grads, ac_grads, compiled_grads, both_grads):
        assert torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6) and torch.allclose(a, d, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in both_grads)


@pytest.mark.floor  # floor: transformers' own checkpointing switch differs by release
def test_checkpointing_does_not_come_from_transformers(parts: dict[str, object]) -> None:
    model = copy.deepcopy(parts["drafter"])
    assert isinstance(model, DFlashDraftModel)
    prepare_drafter(model, activation_checkpointing=True, compile=False)
    assert all(
        not isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing for layer in model.layers
    )
    prepare_drafter(model, activation_checkpointing=False, compile=False)
    assert not any(layer.gradient_checkpointing for layer in model.layers)


def test_compiled_drafters_train_in_threads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two compiled, checkpointed drafters train in their threads; warm-up (minutes of serial compiles
    before step 1 on the 5 + 3 box) says in its start-up line how many compiles come."""
    cfg = load_config(
        REPO / "configs" / "tiny-random.toml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}",
            "max_steps=4",
            "log_every=2",
            "checkpoint.interval=0",
            "compile=true",
            "compile_backend=eager",
            "activation_checkpointing=true",
        ],
    )
    out = io.StringIO()
    run = Run(cfg, environ={}, stream=out)
    assert all(layer._compiled_call_impl is not None for r in run.drafters for layer in r.model.layers)
    torch._dynamo.reset()  # another test's compiled layer code in this process would be a recompile here
    try:
        with caplog.at_level("INFO", logger="dflash.train"):
            assert run.train() == 0
    finally:
        torch._dynamo.reset()
    assert out.getvalue().count("| drafters 2/2") == 2
    assert len(run.drafters[0].trained) + len(run.drafters[1].trained) == 4
    (line,) = [m for m in caplog.messages if m.startswith("compiling the drafter before step 1: ")]
    assert line.startswith("compiling the drafter before step 1: 2 batch shapes x 1 drafter device(s)")
    assert run.warmed is not None and len(run.warmed.shapes) == 2
