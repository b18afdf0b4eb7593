"""Updates the size the recipe used (gradient accumulation, one weight sum, epochs)."""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.config import ConfigError, RunConfig, load_config
from dflash.data.samples import collate
from dflash.train.replicas import FeatureBatch
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-random.toml"

pytestmark = pytest.mark.timeout(240)


def tiny(tmp_path: Path, *overrides: str) -> RunConfig:
    return tiny_config(tmp_path, "log_every=1", "checkpoint.resume=never", *overrides)


def batches(run: Run) -> tuple[FeatureBatch, FeatureBatch, FeatureBatch]:
    """Rows 0..7 as one batch, and the same padded rows as two batches of 4 (same features)."""
    b = collate([run.dataset.read(i) for i in range(8)], index=0)
    feats = t.cast(torch.Tensor, run.targets[0].model.features(b.input_ids, b.attention_mask))
    whole = FeatureBatch(b.input_ids, b.loss_mask, feats, index=0)
    first = FeatureBatch(b.input_ids[:4], b.loss_mask[:4], feats[:4], index=1)
    second = FeatureBatch(b.input_ids[4:], b.loss_mask[4:], feats[4:], index=2)
    return whole, first, second


def grads(run: Run, j: int) -> list[torch.Tensor]:
    return [m.grad.clone() for m in run.drafters[j].masters]  # type: ignore[union-attr]


def test_one_update_with_accumulation_equals_one_update_on_the_concatenated_batch(tmp_path: Path) -> None:
    # num_anchors above any row's candidate count: every candidate is an anchor, so the anchors do not
    # depend on how the rows are split. eps = 1 makes AdamW's first update depend on the gradient's scale
    # (with a tiny eps it is ~lr * sign(g), blind to the normalisation).
    run = Run(
        tiny(
            tmp_path,
            "max_steps=1",
            "drafter.num_anchors=1000",
            "devices.drafters=cpu,cpu",
            "optim.eps=1.0",
            "optim.grad_clip=0",
            "optim.warmup_ratio=0",
        ),
        environ={},
    )
    whole, first, second = batches(run)
    r0, r1 = run.drafters

    # the gradients: accumulate(first, second) == accumulate(whole)
    fig_acc = r0.accumulate([first, second])
    g_acc = grads(run, 0)
    fig_one = r1.accumulate([whole])
    g_one = grads(run, 1)
    for a, b in zip(g_acc, g_one):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(fig_acc["loss"], fig_one["loss"], rtol=1e-5, atol=1e-7)
    # ... and they differ from the mean of per-batch normalised gradients (what a per-batch loss gives)
    per_batch = []
    for fb in (first, second):
        r0.accumulate([fb])
        per_batch.append(grads(run, 0))
    mean = [(a + b) / 2 for a, b in zip(*per_batch)]
    assert max(float((a - b).abs().max()) for a, b in zip(mean, g_one)) > 1e-5 * max(
        float(g.abs().max()) for g in g_one
    )

    # one optimizer update each: the same weights after
    r0.step([first, second], step=1)
    r1.step(whole, step=1)
    for a, b in zip(r0.model.parameters(), r1.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert r0.trained == [1, 2] and r1.trained == [0]


def test_a_global_step_is_one_update_of_k_batches(tmp_path: Path) -> None:
    out = io.StringIO()
    run = Run(
        tiny(tmp_path, "max_steps=3", "optim.sequences_per_update=8", "devices.drafters=cpu"), environ={}, stream=out
    )
    assert run.accumulate == 2  # 8 sequences / batches of 4
    assert run.train() == 0
    assert run.pipeline is not None and run.pipeline.step == 3
    assert len(run.drafters[0].trained) == 6, "3 updates x 2 batches"
    assert [ln.split(" |")[0] for ln in out.getvalue().splitlines()] == ["step 1", "step 2", "step 3"]


def test_epochs_derive_max_steps_and_warmup_printed_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = tiny_config(tmp_path, "epochs=2", "optim.sequences_per_update=8", "devices.drafters=cpu,cpu")
    cfg = dataclasses.replace(cfg, max_steps=None)  # the tiny config sets max_steps; without it epochs count
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        run = Run(cfg, environ={})
    batches = len(run.plan.epoch(0))
    assert run.accumulate == 2
    assert run.cfg.max_steps == math.ceil(2 * batches / 2)
    assert run.schedule.warmup == math.ceil(0.04 * run.cfg.max_steps)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("updates:"))
    assert (
        f"8 sequences per update per drafter (2 batch(es) of <= 4), 2 drafter(s): ~16 sequences per round; "
        f"{len(run.dataset.lengths)} samples; max_steps {run.cfg.max_steps} (2 epoch(s) x {batches} batches / 2 "
        f"per update); warmup {run.schedule.warmup} steps"
    ) in line


def test_default_sequences_per_update_is_32_over_the_drafters(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "max_steps=1", "devices.drafters=cpu,cpu,cpu")
    raw = cfg.optim
    assert raw.sequences_per_update == 4  # the tiny config pins it ...
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(raw, sequences_per_update=None))
    run = Run(cfg, environ={})
    assert run.cfg.optim.sequences_per_update == 11 and run.accumulate == 3  # ceil(32/3) per drafter, batches of 4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.sequences_per_update=0", "optim.sequences_per_update: must be > 0, got 0"),
        ("epochs=0", "epochs: must be > 0, got 0"),
    ],
)
def test_bad_recipe_values_are_one_line(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}$"):
        load_config(TINY, [override])


# ---- the pipeline hands k queue items to one step -------------------------------------------


class Accumulating:
    """A drafter that records the payloads each step got (a list when the pipeline accumulates)."""

    device = "cpu"

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def step(self, payload: t.Any, *, step: int, micro_batches: int = 1) -> t.Any:
        from dflash.train.pipeline import StepStats

        items = payload if isinstance(payload, list) else [payload]
        self.steps.append([int(p) for p in items])
        return StepStats(loss=1.0, acc=0.5, tau_tf=2.0, blocks=1, lr=0.1, acc_per_slot=())

    def recover(self) -> None:
        pass


class Ints:
    def __init__(self, start: int, stride: int, limit: int) -> None:
        self.next, self.stride, self.limit = start, stride, limit

    def __next__(self) -> t.Any:
        if self.next >= self.limit:
            raise StopIteration
        g, self.next = self.next, self.next + self.stride

        class B:
            index, n_tokens = g, 10

        return B()


class Echo:
    device = "cpu"

    def produce(self, batch: t.Any) -> int:
        return int(batch.index)


def test_the_pipeline_gives_each_step_k_items_and_a_dry_source_ends_with_a_short_update() -> None:
    from dflash.train.pipeline import Pipeline, PipelineError, PipelineOptions

    tokens: list[int] = []
    d = Accumulating()
    pipe = Pipeline(
        targets=[Echo(), Echo()],
        sources=[Ints(0, 2, 10), Ints(1, 2, 10)],
        drafters=[d],
        options=PipelineOptions(max_steps=100, capacity=4, poll=0.02, accumulate=3),
        on_step=lambda n, s, tk: tokens.append(tk),
    )
    with pytest.raises(PipelineError, match="the drafters stopped at step 4 of 100"):
        pipe.run()
    assert [len(s) for s in d.steps] == [3, 3, 3, 1]
    assert sorted(i for s in d.steps for i in s) == list(range(10)), "every batch once"
    assert tokens == [30, 30, 30, 10]
