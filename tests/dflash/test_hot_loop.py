"""The drafter's hot loop and its memory: the flex BlockMask from the anchors, no host syncs per step,
the OOM retry that frees the failed attempt, and the byte-bounded feature queue.

Host syncs are counted with a ``TorchDispatchMode``: ``aten._local_scalar_dense`` is exactly a read of a
tensor's value on the host (``item()``, ``int()``, ``float()``, ``bool()``), and ``nonzero``-like ops wait
for the device on a GPU to learn their output size. On the CPU both still run through the dispatcher,
so a test here sees every one the GPU would pay for.
"""

from __future__ import annotations

import collections
import gc
import io
import queue
import threading
import types
import typing as t
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.config import RunConfig, load_config
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.loss import (
    Anchors,
    block_targets,
    candidate_counts,
    dflash_loss,
    drafter_loss,
    mask_mod,
    sample_anchors,
    training_block_mask,
    training_mask,
)
from dflash.model.target import TargetModel, tiny_target_config
from dflash.train.faults import cuda_oom
from dflash.train.metrics import Metrics
from dflash.train.pipeline import FeatureQueue, Item, Pipeline, PipelineOptions, StepStats
from dflash.train.replicas import DrafterReplica, FeatureBatch, LRSchedule, TargetReplica

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive", "is_nonzero"}


class Ops(TorchDispatchMode):
    """Counts host-sync ops by name and the bytes of every op's tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: t.Any, types_: t.Any, args: t.Any = (), kwargs: t.Any = None) -> t.Any:
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            self.syncs[name] += 1
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.bytes += o.numel() * o.element_size()
        return out


# ---- the BlockMask ------------------------------------------------------------------------


def reference_block_mask(anchors: Anchors, seq: int, block: int, window: int | None) -> t.Any:
    """What the GPU path built before: ``create_block_mask`` evaluating the rule on every (query, key)."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = anchors.num_blocks
    return create_block_mask(
        mask_mod(anchors, seq_len=seq, block_size=block, sliding_window=window),
        B=anchors.positions.shape[0],
        H=None,
        Q_LEN=n * block,
        KV_LEN=seq + n * block,
        device="cpu",
    )


def effective_mask(bm: t.Any, anchors: Anchors, seq: int, block: int, window: int | None) -> torch.Tensor:
    """What a block-sparse kernel computes: full tiles entirely, partial tiles through mask_mod, others not."""
    q_len, kv_len = bm.seq_lengths
    tile = bm.BLOCK_SIZE[0]

    def tiles(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        dense = torch.zeros(*idx.shape, dtype=torch.bool)
        cols = torch.arange(idx.shape[-1])
        dense.scatter_(-1, idx.long(), cols < num[..., None])
        return dense.repeat_interleave(tile, -2).repeat_interleave(tile, -1)[..., :q_len, :kv_len]

    partial, full = tiles(bm.kv_num_blocks, bm.kv_indices), tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (partial & full).any()
    rule = training_mask(anchors, seq_len=seq, block_size=block, sliding_window=window)
    return full | (partial & rule)


CASES = [  # (rows, seq, block, anchors, window, padded rows)
    (1, 300, 16, 8, None, False),
    (3, 700, 16, 40, None, True),  # several rows, padding blocks, tiles straddling the block keys
    (2, 129, 10, 12, 6, True),  # a block size that does not divide the 128-wide tiles; sliding window
    (2, 5, 16, 4, None, True),  # a sequence shorter than a block
    (1, 256, 128, 2, None, False),  # one block = one tile: full tiles
    (2, 1000, 16, 64, 200, False),
]


@pytest.mark.parametrize(("rows", "seq", "block", "n", "window", "padded"), CASES)
def test_block_mask_from_the_anchors_equals_create_block_mask(
    rows: int, seq: int, block: int, n: int, window: int | None, padded: bool
) -> None:
    g = torch.Generator().manual_seed(seq)
    loss_mask = torch.ones(rows, seq, dtype=torch.long)
    if padded and rows > 1:
        loss_mask[1:, : seq - 3] = 0  # later rows have a single candidate: padding blocks
    anchors = sample_anchors(loss_mask, num_anchors=n, block_size=block, generator=g)
    anchors = Anchors(anchors.positions.clone(), anchors.valid)
    anchors.positions[0, 0] = 0  # an anchor at 0 sees no context at all
    ours = training_block_mask(anchors, seq_len=seq, block_size=block, sliding_window=window)
    ref = reference_block_mask(anchors, seq, block, window)
    for name in (
        "kv_num_blocks",
        "kv_indices",
        "full_kv_num_blocks",
        "full_kv_indices",
        "q_num_blocks",
        "q_indices",
        "full_q_num_blocks",
        "full_q_indices",
    ):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
    dense = training_mask(anchors, seq_len=seq, block_size=block, sliding_window=window)[:, 0]
    assert torch.equal(effective_mask(ours, anchors, seq, block, window)[:, 0], dense)


def test_block_mask_on_random_batches_equals_create_block_mask() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        rows, seq = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(3, 400, (), generator=g))
        block = [4, 10, 16][trial % 3]
        window = [None, 3, 50][trial % 3 - 1 if trial % 2 else 0]
        loss_mask = (torch.rand(rows, seq, generator=g) > 0.3).long()
        loss_mask[0, :2] = 1
        anchors = sample_anchors(
            loss_mask, num_anchors=int(torch.randint(1, 30, (), generator=g)), block_size=block, generator=g
        )
        ours = training_block_mask(anchors, seq_len=seq, block_size=block, sliding_window=window)
        ref = reference_block_mask(anchors, seq, block, window)
        assert torch.equal(ours.to_dense(), ref.to_dense()), trial
        assert torch.equal(ours.full_kv_indices, ref.full_kv_indices) and torch.equal(ours.kv_indices, ref.kv_indices)


def test_block_mask_needs_no_query_by_key_temporaries_nor_syncs() -> None:
    """create_block_mask evaluated the rule on all Q x KV pairs (~0.8 GB of int64 on the real shapes)."""
    seq, block, n = 4096, 16, 64
    anchors = sample_anchors(
        torch.ones(2, seq), num_anchors=n, block_size=block, generator=torch.Generator().manual_seed(0)
    )
    ops = Ops()
    with ops:
        training_block_mask(anchors, seq_len=seq, block_size=block)
    pairs = 2 * (n * block) * (seq + n * block)
    assert ops.bytes < pairs, f"{ops.bytes / 2**20:.1f} MiB of op outputs for {pairs / 2**20:.1f} Mi (query, key) pairs"
    assert not ops.syncs


def test_flex_attention_output_with_the_new_mask_equals_sdpa_with_the_dense_mask() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    seq, block = 150, 16
    loss_mask = torch.ones(2, seq)
    loss_mask[1, :140] = 0
    anchors = sample_anchors(loss_mask, num_anchors=9, block_size=block, generator=torch.Generator().manual_seed(3))
    bm = training_block_mask(anchors, seq_len=seq, block_size=block)
    dense = training_mask(anchors, seq_len=seq, block_size=block)
    q_len = anchors.num_blocks * block
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (q_len, seq + q_len, seq + q_len))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        out = flex_attention(q, k, v, block_mask=bm)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    rows = anchors.valid.repeat_interleave(block, 1)  # padding rows see nothing: their output is undefined
    assert torch.allclose(
        out[rows[:, None].expand_as(out[..., 0])], ref[rows[:, None].expand_as(ref[..., 0])], atol=1e-5
    )


# ---- no host syncs per drafter step --------------------------------------------------------


def tiny_cfg(*overrides: str) -> RunConfig:
    return load_config(REPO / "configs" / "tiny-random.toml", ["max_steps=1000", *overrides])


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.from_config(tiny_target_config(), seed=0, num_draft_layers=2)


def replica(target: TargetModel, dtype: torch.dtype = torch.float32, **kw: t.Any) -> DrafterReplica:
    cfg = tiny_cfg(*(f"{k}={v}" for k, v in kw.items()))
    torch.manual_seed(0)
    model = DFlashDraftModel(
        draft_config_for(
            target.model.config,
            num_layers=2,
            block_size=8,
            mask_token_id=target.vocab_size - 1,
            target_layer_ids=target.layer_ids,
        )
    )
    model.to(dtype)
    schedule = LRSchedule(lr=1e-3, total_steps=1000, warmup_ratio=0.0, schedule="constant", min_lr_ratio=0.0)
    return DrafterReplica(model, target.head(), device="cpu", cfg=cfg, schedule=schedule, seed=0, index=0)


def batch(target: TargetModel, rows: int = 3, seq: int = 40, index: int = 0) -> FeatureBatch:
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, target.vocab_size - 1, (rows, seq), generator=g)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :8] = 0
    loss_mask[-1, :-4] = 0  # a row with fewer anchors than the others: padding blocks
    att = torch.ones_like(ids)
    att[-1, -2:] = 0
    return TargetReplica(target, "cpu", "cpu").produce(
        types.SimpleNamespace(input_ids=ids, attention_mask=att, loss_mask=loss_mask, index=index)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_drafter_step_makes_no_host_sync_and_returns_device_figures(target: TargetModel, dtype: torch.dtype) -> None:
    r = replica(target, dtype)
    payload = batch(target)
    r.step(payload, step=1)  # the optimizer's state is created on the first step
    metrics = Metrics(log_every=1000, stream=io.StringIO())
    ops = Ops()
    with ops:
        for s in (2, 3):
            stats = r.step(payload, step=s)
            metrics.record(s, stats, 100)
    assert not ops.syncs, dict(ops.syncs)
    for value in (stats.loss, stats.acc, stats.tau_tf, stats.acc_per_slot, stats.nonfinite):
        assert isinstance(value, torch.Tensor) and value.device == torch.device("cpu")
    r.poison = lambda step: True  # a NaN update is found and skipped on the device too, with no host read
    with Ops() as bad_ops:
        bad = r.step(payload, step=4)
    assert not bad_ops.syncs, dict(bad_ops.syncs)
    r.poison = None
    assert int(t.cast(torch.Tensor, bad.nonfinite)) == 1
    assert stats.blocks > 0 and stats.acc_per_slot.shape == (7,)
    metrics.record(1000, stats, 100)  # the log interval ends: read once, here
    rec = metrics.records[-1]
    assert rec["steps"] == 3 and 0.0 <= rec["acc"] <= 1.0 and rec["loss"] > 0 and len(rec["acc_per_slot"]) == 7


def test_host_side_shapes_give_the_same_anchors_and_loss_as_reading_the_device(target: TargetModel) -> None:
    payload = batch(target, rows=4)
    ids, loss_mask = payload.input_ids, payload.loss_mask
    counts = candidate_counts(loss_mask).tolist()
    a = sample_anchors(loss_mask, num_anchors=6, block_size=8, generator=torch.Generator().manual_seed(1))
    b = sample_anchors(
        loss_mask, num_anchors=6, block_size=8, generator=torch.Generator().manual_seed(1), counts=counts
    )
    assert torch.equal(a.positions, b.positions) and torch.equal(a.valid, b.valid) and not a.valid.all()
    labels, weights = block_targets(ids, loss_mask, a, block_size=8, gamma=4.0)
    hidden = torch.randn(*labels.shape, 64, generator=torch.Generator().manual_seed(2))
    keep = (weights > 0).any(dim=-1).flatten().nonzero().squeeze(1)
    host_keep = torch.tensor([r * a.num_blocks + j for r, c in enumerate(counts) for j in range(min(c, a.num_blocks))])
    assert torch.equal(keep, host_keep)
    head = target.head().lm_head
    old, new = (
        dflash_loss(hidden, head, labels, weights, chunk_size=3),
        dflash_loss(hidden, head, labels, weights, chunk_size=3, keep=host_keep),
    )
    for x, y in zip(
        (old.loss, old.correct_per_slot, old.accepted_sum, old.blocks),
        (new.loss, new.correct_per_slot, new.accepted_sum, new.blocks),
    ):
        assert torch.equal(x, y)


def test_step_figures_equal_the_host_computed_ones(target: TargetModel) -> None:
    """acc, tau_tf and acc_per_slot as the old code computed them on the host, from the same terms."""
    payload = batch(target, rows=3)
    r = replica(target)
    gen = torch.Generator().manual_seed(5)
    out = drafter_loss(
        r.model,
        r.head,
        payload.input_ids,
        payload.loss_mask,
        payload.features,
        num_anchors=5,
        generator=gen,
        chunk_size=2,
    )
    gen = torch.Generator().manual_seed(5)
    anchors = sample_anchors(payload.loss_mask, num_anchors=5, block_size=8, generator=gen)
    assert torch.equal(anchors.positions, out.anchors.positions)
    assert out.n_blocks == int(anchors.valid.sum()) and out.n_tokens == int(payload.loss_mask.sum())
    slots = out.acc_per_slot.tolist()
    assert len(slots) == 7 and all(0.0 <= s <= 1.0 for s in slots)
    assert 1.0 <= float(out.tau_tf) <= 8.0 and 0.0 <= float(out.acc) <= 1.0


def test_bf16_masters_step_equals_adamw_on_fp32_copies_of_the_grads(target: TargetModel) -> None:
    """The for-each grad copy into one fp32 buffer and fused AdamW do what the per-parameter loop did."""
    r = replica(target, torch.bfloat16, **{"optim.grad_clip": 0})
    assert r.separate_masters
    payload = batch(target)
    masters0 = [m.detach().clone() for m in r.masters]
    # the gradient the step will see: same generator state, same model
    state = r.generator.get_state()
    out = drafter_loss(
        r.model,
        r.head,
        payload.input_ids,
        payload.loss_mask,
        payload.features,
        num_anchors=16,
        gamma=r.cfg.drafter.loss_gamma,
        generator=r.generator,
        chunk_size=r.cfg.drafter.loss_chunk,
    )
    out.loss.backward()
    grads = [None if p.grad is None else p.grad.detach().float().clone() for p in r.params]
    r.model.zero_grad(set_to_none=True)
    r.generator.set_state(state)
    r.step(payload, step=1)
    ref = [m.clone().requires_grad_(True) for m in masters0]
    for m, g in zip(ref, grads):
        m.grad = g
    o = r.cfg.optim
    opt = torch.optim.AdamW(ref, lr=r.schedule(1), betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False)
    opt.step()
    for got, want, p in zip(r.masters, ref, r.params):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)
        assert torch.equal(p, got.to(p.dtype))  # the bf16 parameters follow their masters


# ---- the OOM retry frees the failed attempt -------------------------------------------------


class OomOnce(DrafterReplica):
    """A real replica whose first attempts run the real forward, then run out of memory mid-step."""

    ooms = 1
    alive: list[weakref.ref[torch.Tensor]]
    seen_at_recover: list[bool]

    def _step(self, payload: FeatureBatch, *, step: int, micro_batches: int) -> StepStats:
        if self.ooms:
            self.ooms -= 1
            out = drafter_loss(
                self.model,
                self.head,
                payload.input_ids,
                payload.loss_mask,
                payload.features,
                num_anchors=8,
                generator=self.generator,
            )
            big = torch.empty(4 << 20)  # the activations of the failed attempt, held by this frame
            self.alive.append(weakref.ref(big))
            self.alive.append(weakref.ref(out.loss))
            raise cuda_oom(self.device)
        return super()._step(payload, step=step, micro_batches=micro_batches)

    def recover(self) -> None:
        gc.collect()  # only frames still referenced survive this
        self.seen_at_recover.append(any(w() is not None for w in self.alive))
        super().recover()


class ListSource:
    def __init__(self, items: list[t.Any]) -> None:
        self.items = list(items)

    def __next__(self) -> t.Any:
        if not self.items:
            raise StopIteration
        return self.items.pop(0)


def oom_pipeline(target: TargetModel, r: OomOnce, steps: int) -> Pipeline:
    class Echo:
        device = "cpu"

        def produce(self, b: FeatureBatch) -> FeatureBatch:
            return b

    class Src(ListSource):
        def __next__(self) -> t.Any:
            p = super().__next__()
            return types.SimpleNamespace(payload=p, index=p.index, n_tokens=10)

    class Unwrap(Echo):
        def produce(self, b: t.Any) -> FeatureBatch:
            return b.payload

    return Pipeline(
        targets=[Unwrap()],
        sources=[Src([batch(target, index=i) for i in range(steps)])],
        drafters=[r],
        options=PipelineOptions(max_steps=steps, capacity=2),
    )


def test_oom_retry_recovers_after_the_failed_attempt_is_freed(target: TargetModel) -> None:
    r = replica(target)
    r.__class__ = OomOnce
    r.ooms, r.alive, r.seen_at_recover = 1, [], []
    result = oom_pipeline(target, r, 2).run()
    assert result.steps == 2 and not result.failures
    assert r.seen_at_recover == [False], "recover() ran while the failed attempt's tensors were still alive"


def test_a_dead_drafter_keeps_its_error_text_not_its_tensors(target: TargetModel) -> None:
    r = replica(target)
    r.__class__ = OomOnce
    r.ooms, r.alive, r.seen_at_recover = 2, [], []  # the retry runs out of memory too: the drafter dies
    pipe = oom_pipeline(target, r, 2)
    with pytest.raises(Exception, match="no drafter left"):
        pipe.run()
    (failure,) = pipe.failures
    assert "CUDA out of memory" in failure.error_line and "Traceback" in failure.traceback
    gc.collect()
    assert failure.exc.__traceback__ is None
    assert all(w() is None for w in r.alive), "the stored failure pins the dead drafter's activations"


# ---- the byte-bounded queue --------------------------------------------------------------


def test_queue_holds_at_most_max_bytes_and_producers_block() -> None:
    q = FeatureQueue(maxsize=64, max_bytes=1000)
    item = lambda n: Item(None, 1, 0, 0, 0, nbytes=n)  # noqa: E731
    q.put(item(400), timeout=0.01)
    q.put(item(400), timeout=0.01)
    with pytest.raises(Exception) as full:
        q.put(item(400), timeout=0.05)  # 1200 > 1000: the producer waits
    assert type(full.value).__name__ == "Full" and q.bytes == 800 and q.qsize() == 2
    done = threading.Event()

    def producer() -> None:
        q.put(item(400))
        done.set()

    th = threading.Thread(target=producer)
    th.start()
    assert not done.wait(0.1)  # still blocked
    taken = q.get(timeout=1)
    assert not done.wait(0.1)  # a taken item still holds its bytes (a drafter trains on it)...
    q.release(taken.nbytes)  # ...until the drafter is done with it
    th.join(5)
    assert done.is_set() and q.bytes == 800 and q.peak_bytes == 800
    # one item larger than the bound passes alone, never next to another
    while q.qsize():
        q.release(q.get(timeout=1).nbytes)
    q.put(item(5000), timeout=0.01)
    with pytest.raises(queue.Full):
        q.put(item(1), timeout=0.05)
    assert q.peak_bytes == 5000


def test_pipeline_never_holds_more_feature_bytes_than_max_bytes(target: TargetModel) -> None:
    one = batch(target).nbytes
    seen: list[int] = []

    class Slow:
        device = "cpu"

        def __init__(self, pipe_ref: list[Pipeline]) -> None:
            self.pipe_ref = pipe_ref

        def step(self, payload: FeatureBatch, *, step: int, micro_batches: int = 1) -> StepStats:
            seen.append(self.pipe_ref[0].queues[0].bytes)
            threading.Event().wait(0.02)  # let the targets run ahead and fill the queue
            return StepStats(loss=1.0, acc=0.5, tau_tf=2.0)

        def recover(self) -> None:
            pass

    made = {i: batch(target, index=i) for i in range(24)}  # one target replica serves one thread only

    class Producer:
        device = "cpu"

        def produce(self, b: t.Any) -> FeatureBatch:
            return made[b.index]

    ref: list[Pipeline] = []
    srcs = [ListSource([types.SimpleNamespace(index=i, n_tokens=1) for i in range(s, 24, 2)]) for s in (0, 1)]
    pipe = Pipeline(
        targets=[Producer(), Producer()],
        sources=srcs,
        drafters=[Slow(ref)],
        options=PipelineOptions(max_steps=24, capacity=64, max_bytes=3 * one),
    )
    ref.append(pipe)
    pipe.run()
    q = pipe.queues[0]
    assert q.peak_bytes <= 3 * one and max(seen) <= 3 * one
    assert q.peak_bytes == 3 * one, "the queue filled up to its byte bound (the targets ran ahead)"
