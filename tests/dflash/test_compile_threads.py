"""Compiled drafters in threads (docs/design.md section 16): compiled once, serially, for every shape; never recompiled
in a thread; flex attention never unfused.

Three drafter threads on the CPU with the batch shapes of configs/tiny-cpu.toml (4 rows, up to 96
tokens, 16 anchors of 8) and others (one row, one anchor, short sequences). After ``warm_up`` the
stance is ``fail_on_recompile``, so a miss is an exception in the thread, and dynamo's graph counter
must not move. Dynamo traces, guards and recompiles with ``eager`` and ``aot_eager`` exactly as with
inductor (which needs minutes here); only the code it hands back is not fused. The dense test uses
``aot_eager``, a one-layer drafter and six rounds of batches (48 compiled-layer calls per thread, as
three rounds of a two-layer drafter made): concurrent calls of AOTAutograd-compiled layers made
dynamo's cache lookup miss now and then ("Unexpected recompilation"; timing-dependent: a stress run of
48 steps per thread missed in 2 runs of 2 without ``dflash.model.drafter._compiled_calls``, 0 of 7 with it;
at this test's 48 calls it is caught only sometimes). CPU flex attention has no backward in torch
2.13, so the flex test runs the drafter forward only (frozen parameters), with ``eager``.
"""

from __future__ import annotations

import threading
import traceback
import typing as t
from pathlib import Path

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch._dynamo.utils import counters

from dflash.model.drafter import CompileMissError
from dflash.model.loss import drafter_loss
from dflash.train.compile import shape_class, warm_up, warm_up_shapes
from dflash.train.run import Run
from tests.dflash.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)

# (rows, seq, anchors per row): tiny-cpu's full batches, then shorter and smaller ones
BATCHES = [(4, 96, 16), (4, 71, 16), (3, 88, 12), (1, 30, 5), (2, 12, 1), (1, 3, 1), (4, 96, 2), (2, 50, 16)]


@pytest.fixture
def unfused_flex_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every call of flex_attention that takes the unfused path: torch warns there ("flex_attention
    called without torch.compile()"), once per process; we count each call instead."""
    calls: list[str] = []

    def count(warning_id: str, *args: t.Any, **kwargs: t.Any) -> None:
        if warning_id == "flex_attention_performance":
            calls.append(threading.current_thread().name)

    monkeypatch.setattr(flex_module, "_warn_once", count)
    return calls


def three_drafters(tmp_path: Path, *overrides: str) -> Run:
    cfg = tiny_config(
        tmp_path,
        'devices.drafters=["cpu", "cpu", "cpu"]',
        "data.max_length=96",
        "compile=true",
        "compile_backend=eager",
        "checkpoint.resume=never",
        *overrides,
    )
    return Run(cfg, environ={})


def batch(run: Run, rows: int, seq: int, anchors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq, dtype=torch.long)
    mask[:, seq - anchors - 1 :] = 1  # the widest row has exactly `anchors` anchor candidates
    mask[1:, : seq - anchors // 2 - 1] = 0  # the others fewer
    return ids, mask, t.cast(torch.Tensor, run.targets[0].model.features(ids))


def train_in_threads(run: Run, attention: str, rounds: int = 1) -> list[str]:
    """Every drafter steps through BATCHES ``rounds`` times in its own thread, under fail_on_recompile; the errors."""
    data = {
        (j, k): batch(run, *shape, seed=10 * j + k)
        for j in range(len(run.drafters))
        for k, shape in enumerate(BATCHES * rounds)
    }
    errors: list[str] = []

    def work(j: int) -> None:
        r = run.drafters[j]
        try:
            for k in range(len(BATCHES) * rounds):
                ids, mask, feats = data[j, k]
                out = drafter_loss(
                    r.model,
                    r.head,
                    ids,
                    mask,
                    feats,
                    num_anchors=16,
                    gamma=4.0,
                    chunk_size=64,
                    generator=torch.Generator().manual_seed(k),
                    attention=attention,
                )
                if out.loss.requires_grad:
                    out.loss.backward()
                    r.model.zero_grad(set_to_none=True)
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(f"drafter {j}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    torch.compiler.set_stance("fail_on_recompile")
    try:
        threads = [threading.Thread(target=work, args=(j,), name=f"drafter-{j}") for j in range(len(run.drafters))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        torch.compiler.set_stance("default")
    return errors


@pytest.mark.parametrize(("attention", "backend", "rounds"), [("dense", "aot_eager", 6), ("flex", "eager", 1)])
def test_after_warm_up_three_drafter_threads_never_recompile_nor_run_unfused_flex(
    tmp_path: Path, attention: str, backend: str, rounds: int, unfused_flex_calls: list[str]
) -> None:
    torch._dynamo.reset()
    # dense: one drafter layer, so one layer input kind (two graphs, not four: an AOTAutograd graph is ~5 s
    # of CPU here); the kind whose input needs grad trains in threads in tests/dflash/test_compile.py
    layers = ["drafter.layers=1"] if attention == "dense" else []
    run = three_drafters(tmp_path, "activation_checkpointing=true", f"compile_backend={backend}", *layers)
    if attention == "flex":  # CPU flex attention has no backward: forward only
        for r in run.drafters:
            r.model.requires_grad_(False)
    for r in run.drafters:  # what Run.train() does before the threads start
        shapes = warm_up(
            r,
            feature_size=run.targets[0].model.feature_size,
            vocab_size=run.vocab_size,
            mask_token_id=run.mask_token_id,
            attention=attention,
        )
    assert (1, 96, 1) in shapes or attention == "dense"
    assert counters["stats"]["unique_graphs"] > 0, "warm-up compiled the layers"
    graphs = counters["stats"]["unique_graphs"]

    errors = train_in_threads(run, attention, rounds)

    assert errors == []
    assert counters["stats"]["unique_graphs"] == graphs, "nothing was compiled after warm-up"
    assert unfused_flex_calls == []


def test_a_miss_after_warm_up_is_one_clear_error(tmp_path: Path, unfused_flex_calls: list[str]) -> None:
    torch._dynamo.reset()
    run = three_drafters(tmp_path)
    r = run.drafters[0]
    # Warm up for batches of 3 rows only: a batch of one row is a graph it has not got.
    ids, mask, feats = batch(run, 3, 40, 5, seed=0)
    drafter_loss(
        r.model, r.head, ids, mask, feats, num_anchors=5, generator=torch.Generator().manual_seed(0)
    ).loss.backward()
    ids, mask, feats = batch(run, 1, 40, 5, seed=1)
    torch.compiler.set_stance("fail_on_recompile")
    try:
        with pytest.raises(CompileMissError) as e:
            drafter_loss(r.model, r.head, ids, mask, feats, num_anchors=5, generator=torch.Generator().manual_seed(0))
    finally:
        torch.compiler.set_stance("default")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("drafter layer 0: no compiled code for a batch of shape [1, 40, 64] after warm-up")


def test_warm_up_shapes_cover_every_size_that_can_be_one() -> None:
    # the user's box: 8192 tokens, 512 anchors of 16, flex attention
    shapes = warm_up_shapes(
        rows=4, max_length=8192, num_anchors=512, block_size=16, flex=True, taken={5120, 17408, 128, 1024, 8, 40}
    )
    kinds = set()
    for rows, seq, blocks in shapes:
        assert 1 <= blocks < seq <= 8192 and blocks <= 512
        kinds.add(shape_class(rows, seq, blocks, block_size=16, flex=True))
    # every combination a real batch can have, each once: (rows 1, blocks 1, Q < 128, Q <= 128, K <= 128)
    assert len(kinds) == len(shapes) == 12
    assert {
        (r, b, short, one_q, one_k)
        for r in (True, False)
        for b, short, one_q, one_k in [
            (True, True, True, True),
            (True, True, True, False),
            (False, True, True, True),
            (False, True, True, False),  # 2-7 blocks over many keys: the short-query guard
            (False, False, True, False),  # exactly one query tile (8 blocks)
            (False, False, False, False),
        ]
    } == kinds
    # dense attention: only the rows can be 1
    dense = warm_up_shapes(rows=4, max_length=96, num_anchors=16, block_size=8, flex=False, taken={64, 128})
    assert [rows for rows, _, _ in dense] == [1, 2]
    assert [rows for rows, _, _ in warm_up_shapes(rows=1, max_length=96, num_anchors=16, block_size=8, flex=False)] == [
        1
    ]
    # 65K tokens with one full-length row per batch (max_batch_tokens): the several-row batches are no longer
    # than the batch planner lets them be, and every class is still warmed
    long = warm_up_shapes(rows=4, max_length=65536, num_anchors=2048, block_size=16, flex=True)
    bounded = warm_up_shapes(
        rows=4, max_length=65536, num_anchors=2048, block_size=16, flex=True, max_batch_tokens=65536
    )
    assert max(r * seq for r, seq, _ in long) == 2 * 65536 and max(r * seq for r, seq, _ in bounded) == 65536
    assert {shape_class(r, q, b, block_size=16, flex=True) for r, q, b in bounded} == {
        shape_class(r, q, b, block_size=16, flex=True) for r, q, b in long
    }
