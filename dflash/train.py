"""Building and running one training run from a ``RunConfig``: the thing ``dflash train`` does.

    python -m dflash train --config configs/tiny-cpu.toml --set max_steps=200

What it builds: one frozen target replica per target device (``devices.targets``; a repeated "cpu" gets
its own replica, since a target's feature hooks belong to one thread), one drafter replica per drafter
device with its own AdamW over fp32 master weights (the model itself in ``drafter.dtype``; in fp32 the
masters are the parameters), the target's frozen embedding + lm_head on every drafter device, the data
shards, and the pipeline (``dflash.pipeline``) that runs them.

Updates: one global step is one optimizer update of one drafter replica over ``optim.sequences_per_update``
sequences (gradient accumulation over ``ceil(sequences_per_update / data.batch_size)`` queue items, the
weighted loss normalised by ONE weight sum over all of them; default ``ceil(32 / drafters)``, the published
Qwen3-8B recipe's 32 sequences per update). ``max_steps`` unset: ``epochs`` x batches per epoch / batches
per update. Both are printed at start.

Learning rate: linear warmup over ``optim.warmup_ratio * max_steps`` global steps, then cosine (or
linear) decay to ``min_lr_ratio * lr`` at ``max_steps``; every drafter reads it at the global step it
trains. Gradients are clipped to ``optim.grad_clip`` (global norm, per replica, on the fp32 masters).

OOM retry: a drafter step that runs out of memory is retried once "with the batch halved": a batch of
several sequences is split into two micro-batches whose gradients add up; a single sequence is retried
with half the anchors.

Checkpoints (``dflash.checkpoint``): every ``checkpoint.interval`` global steps at the drafters' barrier,
at the end, and on SIGTERM/SIGINT. The replicas are averaged first, so one drafter is saved; the trainer
state holds the run id, the global step, the data position, the RNG states and (``checkpoint.optimizer``)
one replica's AdamW state plus the fp32 masters. The barrier waits only for a CPU snapshot; a background
thread writes it (one write at a time; the run waits for the last one before it exits, and a failed
write fails the run). ``checkpoint.resume = "auto"`` continues the newest run from its latest intact
checkpoint (a corrupted one is skipped with a warning): same step count, same next batch of every shard.
``"never"`` moves the checkpoints already there into ``old-<run id>-<time>/`` and starts a new run.

Signals: the first SIGTERM (or SIGINT) lets the steps in flight finish, writes a checkpoint and exits
143 (130 for SIGINT); a second one exits at once.

Several nodes (``torchrun --nnodes N --nproc-per-node 1 ... -m dflash train``; ``dflash.distributed``): every
node runs this same run with its own targets -> queue -> drafters. Steps stay GLOBAL: each local update
counts N steps (``PipelineOptions.step_stride``), so every node claims the same step numbers (the lr
schedule reads them), meets the same barriers, and stops at ``max_steps`` after ``max_steps / N`` updates;
``average_every`` and ``checkpoint.interval`` must be at least nodes x drafters per node.
``sequences_per_update`` is per update, and its default divides 32 sequences over the drafters of every
node. Batch g belongs to shard g mod (targets of every node): shard = (node rank, local target). Every
barrier exchanges a small header (the nodes must be at the same barrier), averages every live replica of
every node (also before a checkpoint), and checkpoints: rank 0 writes, with every node's data position and
anchor generators; at resume every node looks in its own checkpoint dir and the node with the newest
checkpoint sends it to the others (torchrun may give rank 0 to another box after a restart). A SIGTERM on any node stops every node at the
next barrier (with a checkpoint). A dead or hung node: the next collective fails within
``[distributed] timeout`` and the others exit with ``PeerLost``.

Fault injection (``DFLASH_FAULT``, for the supervisor's tests; see ``dflash.faults.faults_from_env``):
``raise-at-step:N``, ``oom-at-step:N``, ``drafter-oom-at-step:N:I``, ``hang-at-step:N``, and
``kill-in-checkpoint:N`` (SIGKILL in the middle of writing the first checkpoint at step >= N). Each fires
once per checkpoint dir (a marker file there), so the resumed run goes on.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import math
import os
import signal
import sys
import threading
import time
import typing as t
from pathlib import Path

import torch

from dflash import checkpoint as ckpt
from dflash.averaging import Averager
from dflash.batching import BatchPlan
from dflash.chat import load_tokenizer
from dflash.config import ConfigError, RunConfig, check_devices, to_dict
from dflash.data import DataPosition, JsonlDataset, Shard, shard_starts
from dflash.distributed import Header, NodeGroup
from dflash.drafter import DFlashDraftModel, draft_config_for, published_mask_token_id
from dflash.errors import DataError
from dflash.faults import FAULT_ENV, FaultInjector, SigkillWhenPickled, faults_from_env
from dflash.loss import drafter_loss
from dflash.metrics import TENSORBOARD_HINT, Metrics, tensorboard_available
from dflash.pipeline import Pipeline, PipelineOptions, StepStats, SyncEvent
from dflash.target import TargetHead, TargetModel, default_mask_token_id, tiny_target_config_of

logger = logging.getLogger(__name__)

EXIT_OK = 0

# Sequences per update summed over the drafters when optim.sequences_per_update is not set: the published
# Qwen3-8B DFlash recipe (4 sequences per GPU x 8 GPUs).
UPDATE_SEQUENCES = 32

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


# --------------------------------------------------------------------------------------------
# Learning rate


class LRSchedule:
    """lr at a (1-based) global step: linear warmup, then cosine/linear decay to min_lr_ratio * lr."""

    def __init__(self, *, lr: float, total_steps: int, warmup_ratio: float, schedule: str, min_lr_ratio: float) -> None:
        self.lr = lr
        self.total = max(1, total_steps)
        self.warmup = math.ceil(warmup_ratio * self.total)
        self.schedule = schedule
        self.min_ratio = min_lr_ratio

    def __call__(self, step: int) -> float:
        if self.warmup and step <= self.warmup:
            return self.lr * step / self.warmup
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        if self.schedule == "linear":
            scale = 1.0 - progress
        else:
            scale = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * scale)


# --------------------------------------------------------------------------------------------
# Workers


@dataclasses.dataclass(slots=True)
class FeatureBatch:
    """A queue item's payload: target features and the tokens they belong to."""

    input_ids: torch.Tensor  # [B, S] (CPU)
    loss_mask: torch.Tensor  # [B, S] (CPU)
    features: torch.Tensor  # [B, S, n*H] on the consumer's device, or (pinned) CPU
    index: int  # global batch index
    ready: t.Any = None  # a CUDA event after the copy into the consumer's GPU (made on the target's own stream)

    @property
    def nbytes(self) -> int:
        """What the item holds in memory (the queue's byte bound counts it)."""
        return int(self.features.nbytes + self.input_ids.nbytes + self.loss_mask.nbytes)

    def take(self, device: torch.device) -> torch.Tensor:
        """The features on ``device``, usable by the calling thread's current stream (no host sync)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.ready is not None and self.features.device == device:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.ready)
            self.features.record_stream(stream)  # allocated on the target's stream: no early reuse
            return self.features
        return self.features.to(device, non_blocking=True)


# devices with a fused AdamW kernel (torch >= 2.4 has CPU and CUDA ones)
_FUSED_ADAMW = ("cuda", "cpu")


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class TargetReplica:
    """One target thread's frozen model: batch -> FeatureBatch on ``dest``.

    A copy to another GPU runs against a stream of this replica's own on that GPU: a copy between the
    CURRENT streams would wait for the drafter's queued work there (and make it wait for this
    forward), i.e. targets and drafters in lock-step. The host waits for its own forward and copy only.
    """

    def __init__(self, model: TargetModel, device: str, dest: str) -> None:
        self.model = model
        self.device = device
        self.dest = dest  # a device string; "cpu" from a GPU means pinned host memory
        self._dest_stream: t.Any = None  # created lazily, on the target's thread

    def produce(self, batch: t.Any) -> FeatureBatch:
        dev = torch.device(self.device)
        ready = None
        with torch.cuda.device(dev) if dev.type == "cuda" else _nullcontext():
            ids = batch.input_ids.to(dev, non_blocking=True)
            att = batch.attention_mask.to(dev, non_blocking=True)
            feats = t.cast(torch.Tensor, self.model.features(ids, att))
            dest = torch.device(self.dest)
            if dest != dev:
                if dest.type == "cpu":
                    out = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
                    out.copy_(feats, non_blocking=True)
                    _sync_device(dev)  # the consumer must not read before the copy lands
                else:
                    out, ready = self._to_gpu(feats, dest)
                feats = out
        return FeatureBatch(batch.input_ids, batch.loss_mask, feats, int(batch.index), ready)

    def _to_gpu(self, feats: torch.Tensor, dest: torch.device) -> tuple[torch.Tensor, t.Any]:
        if self._dest_stream is None:
            self._dest_stream = torch.cuda.Stream(dest)
        with torch.cuda.stream(self._dest_stream):  # dest's current stream for this thread only
            out = torch.empty(feats.shape, dtype=feats.dtype, device=dest)
            out.copy_(feats, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._dest_stream)
        ready.synchronize()  # the host waits for this forward and copy, never for the drafter
        return out, ready


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class DrafterReplica:
    """One drafter thread's replica: its model, fp32 masters, AdamW, anchor generator and frozen head."""

    def __init__(
        self,
        model: DFlashDraftModel,
        head: TargetHead,
        *,
        device: str,
        cfg: RunConfig,
        schedule: LRSchedule,
        seed: int,
        index: int,
    ) -> None:
        self.model = model
        self.head = head
        self.device = device
        self.cfg = cfg
        self.schedule = schedule
        self.index = index
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.separate_masters = any(p.dtype != torch.float32 for p in self.params)
        if self.separate_masters:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        else:
            self.masters = self.params
        o = cfg.optim
        # fused: one kernel for all tensors, and the step counters stay on the device (the default
        # for-each/single-tensor paths read them on the host per parameter)
        fused = torch.device(device).type in _FUSED_ADAMW
        self.optimizer = torch.optim.AdamW(
            self.masters,
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.trained: list[int] = []  # global batch indices this replica trained (tests, debugging)

    def trainable(self) -> list[torch.Tensor]:
        """What averaging averages: the fp32 masters (the parameters themselves in fp32)."""
        return list(self.masters)

    @torch.no_grad()
    def sync_from_masters(self) -> None:
        if self.separate_masters:
            torch._foreach_copy_(self.params, self.masters)  # type: ignore[arg-type]  # Parameters are Tensors; the stub's list is invariant

    def _grads_to_masters(self) -> None:
        """fp32 copies of the model's gradients as the masters' grads: one buffer, one for-each copy."""
        pairs = [(m, p.grad) for m, p in zip(self.masters, self.params) if p.grad is not None]
        for m in self.masters:
            m.grad = None
        if not pairs:
            return
        flat = torch.empty(sum(g.numel() for _, g in pairs), dtype=torch.float32, device=pairs[0][1].device)
        views = [v.view_as(g) for v, (_, g) in zip(flat.split([g.numel() for _, g in pairs]), pairs)]
        torch._foreach_copy_(views, [g.detach() for _, g in pairs])
        for (m, _), v in zip(pairs, views):
            m.grad = v

    def recover(self) -> None:
        """After an OOM, outside the ``except`` (the failed attempt's frames are gone): drop the grads.

        No ``torch.cuda.empty_cache()``: it empties the cache of EVERY GPU (stalling the other threads),
        and the caching allocator already frees this device's cached blocks and retries before it
        raises an out-of-memory error.
        """
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, payload: FeatureBatch | t.Sequence[FeatureBatch], *, step: int, micro_batches: int = 1) -> StepStats:
        """One optimizer update on one batch, or on several (gradient accumulation: the pipeline hands
        ``optim.sequences_per_update`` sequences' worth of batches at once)."""
        dev = torch.device(self.device)
        with torch.cuda.device(dev) if dev.type == "cuda" else _nullcontext():
            return self._step(payload, step=step, micro_batches=micro_batches)

    def accumulate(self, payloads: t.Sequence[FeatureBatch], *, micro_batches: int = 1) -> dict[str, t.Any]:
        """Backward over every batch, then the masters' grads divided by ONE weight sum over all of them.

        Each micro-batch backpropagates its weighted CE SUM; the sum of the weight sums divides the
        gradients once at the end (a device tensor: no host sync), so k accumulated batches give the
        gradient of the concatenated batch's loss, not a mean of per-batch means. The sums go backward
        divided by the FIRST micro-batch's weight sum (its own loss for the first: one batch is exactly the
        plain mean loss), which keeps fp16/bf16 grads at the size of a mean loss's.
        Returns the step's figures (device tensors).
        """
        d = self.cfg.drafter
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        rows_total = sum(p.input_ids.shape[0] for p in payloads)
        loss_sum: torch.Tensor | None = None
        weight_sum: torch.Tensor | None = None
        acc_sum: torch.Tensor | None = None
        tau_sum: torch.Tensor | None = None
        slots: torch.Tensor | None = None
        blocks = 0
        scale: torch.Tensor | None = None
        for payload in payloads:
            feats = payload.take(torch.device(self.device))
            rows = payload.input_ids.shape[0]
            anchors = d.num_anchors
            if micro_batches > 1 and rows >= 2:
                cuts = [(a * rows // micro_batches, (a + 1) * rows // micro_batches) for a in range(micro_batches)]
            else:
                cuts = [(0, rows)]
                if micro_batches > 1:  # one sequence: halve the anchors instead
                    anchors = max(1, anchors // micro_batches)
            # The step's figures stay on the device (float64): no host sync here; the metrics read them.
            for a, b in cuts:
                out = drafter_loss(
                    self.model,
                    self.head,
                    payload.input_ids[a:b],
                    payload.loss_mask[a:b],
                    feats[a:b],
                    num_anchors=anchors,
                    gamma=d.loss_gamma,
                    generator=self.generator,
                    chunk_size=d.loss_chunk,
                )
                if scale is None:
                    scale = out.weight_sum.detach()
                    out.loss.backward()
                else:
                    (out.loss_sum / scale).backward()
                share = (b - a) / rows_total
                loss_sum = _add(loss_sum, out.loss_sum.detach().double())
                weight_sum = _add(weight_sum, out.weight_sum.double())
                acc_sum = _add(acc_sum, out.acc * share)
                if out.n_blocks:  # tau_tf is NaN only without blocks
                    tau_sum = _add(tau_sum, out.tau_tf * out.n_blocks)
                    blocks += out.n_blocks
                slots = _add(slots, out.acc_per_slot * share)
        assert loss_sum is not None and weight_sum is not None and acc_sum is not None and scale is not None
        if self.separate_masters:
            self._grads_to_masters()
        grads = [m.grad for m in self.masters if m.grad is not None]
        if grads:  # in fp32 on the masters: the one normalisation
            torch._foreach_mul_(grads, (scale.double() / weight_sum).to(grads[0].dtype))
        return {"loss": loss_sum / weight_sum, "acc": acc_sum, "tau_sum": tau_sum, "blocks": blocks, "slots": slots}

    def _step(self, payload: FeatureBatch | t.Sequence[FeatureBatch], *, step: int, micro_batches: int) -> StepStats:
        payloads = [payload] if isinstance(payload, FeatureBatch) else list(payload)
        lr = self.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        fig = self.accumulate(payloads, micro_batches=micro_batches)
        if self.cfg.optim.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.optim.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self.sync_from_masters()
        self.trained.extend(p.index for p in payloads)
        tau_sum, blocks, slots = fig["tau_sum"], fig["blocks"], fig["slots"]
        return StepStats(
            loss=fig["loss"],
            acc=fig["acc"],
            tau_tf=tau_sum / blocks if tau_sum is not None else float("nan"),
            blocks=blocks,
            lr=lr,
            acc_per_slot=slots if slots is not None else (),
        )


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


# --------------------------------------------------------------------------------------------
# torch.compile and activation checkpointing


def prepare_drafter(
    model: DFlashDraftModel,
    *,
    activation_checkpointing: bool,
    compile: bool,
    backend: str | t.Callable[..., t.Any] = "inductor",
    dynamic: bool | None = True,
) -> None:
    """Activation checkpointing inside each layer, then compile per layer (the order that works).

    The layer checkpoints its own forward (``Qwen3DFlashDecoderLayer``, non-reentrant), and
    ``Module.compile`` compiles that forward, so each compiled region contains its checkpoint whatever
    the transformers version. ``fullgraph``: a graph break would leave flex attention outside the
    graph. Compilation happens at the first call: ``warm_up`` makes it, serially, before any thread.
    """
    model.set_activation_checkpointing(activation_checkpointing)
    if compile:
        for layer in model.layers:
            layer.compile(backend=backend, dynamic=dynamic, fullgraph=True)


def warm_up(
    replica: DrafterReplica, *, feature_size: int, vocab_size: int, mask_token_id: int, attention: str = "auto"
) -> list[tuple[int, int, int]]:
    """Compile forward and backward for every shape a run can meet, serially, before threads exist.

    Returns the ``(rows, seq, blocks)`` it ran (``warm_up_shapes``). Throwaway data; the replica's
    weights and optimizer are untouched (gradients are dropped). A drafter whose parameters need no
    gradient (tests) runs forward only.
    """
    import torch._dynamo.config as dynamo_config

    d = replica.cfg.drafter
    flex = attention == "flex" or (attention == "auto" and torch.device(replica.device).type == "cuda")
    shapes = warm_up_shapes(
        rows=replica.cfg.data.batch_size,
        max_length=replica.cfg.data.max_length,
        num_anchors=d.num_anchors,
        block_size=d.block_size,
        flex=flex,
        taken=_model_sizes(replica.model),
    )
    gen = torch.Generator().manual_seed(0)
    # Each shape is a cache entry per layer input kind (the first layer's input needs no grad, the
    # others' do); past the limit dynamo would run the layer eager. Hitting it anyway is an error.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * len(shapes))
    # No duck sizing: a warm-up size equal to a model size (hidden 64 = 8 blocks x 8) would be tied to
    # it and specialised, and real batches would miss the cache.
    with (
        torch.fx.experimental._config.patch(use_duck_shape=False),  # type: ignore[attr-defined]  # set up by install_config_module
        dynamo_config.patch(fail_on_recompile_limit_hit=True),
    ):
        for rows, seq, blocks in shapes:
            ids = torch.randint(0, vocab_size, (rows, seq), generator=gen)
            ids[ids == mask_token_id] = 0
            mask = torch.zeros(rows, seq, dtype=torch.long)
            mask[:, seq - blocks - 1 :] = 1  # exactly `blocks` anchor candidates per row
            feats = torch.randn(rows, seq, feature_size, generator=gen).to(replica.device, replica.model.dtype)
            out = drafter_loss(
                replica.model,
                replica.head,
                ids,
                mask,
                feats,
                num_anchors=blocks,
                gamma=d.loss_gamma,
                generator=torch.Generator(device=replica.device).manual_seed(0),
                chunk_size=d.loss_chunk,
                attention=attention,
            )
            if out.loss.requires_grad:
                out.loss.backward()
    replica.model.zero_grad(set_to_none=True)
    return shapes


# flex_attention's tile: the BlockMask has ceil(Q/128) query and ceil(K/128) key tiles.
_TILE = 128


def warm_up_shapes(
    *, rows: int, max_length: int, num_anchors: int, block_size: int, flex: bool, taken: t.Collection[int] = ()
) -> list[tuple[int, int, int]]:
    """``(rows, seq, blocks)`` batches that compile every graph a run can need.

    dynamo compiles a size of 0 or 1 as a constant (a graph of its own) and any other size as a
    symbol, so each size that can be 1 in a real batch is warmed up at 1 and at >= 2, in every
    combination that can occur: rows (a batch of one sequence), and with flex attention the blocks (a
    short sequence has one anchor), the query tiles and the key tiles (one tile up to 128 tokens).
    Sizes >= 2 are kept apart from each other and from the model's sizes (``taken``) where possible.
    """
    avoid = set(taken) | {0, 1, block_size, _TILE}
    many_rows = next(r for r in range(2, 1 << 20) if r not in avoid)
    max_blocks = max(1, min(num_anchors, max_length - 1))

    def pick(blocks: int, hi: int) -> tuple[int, int] | None:
        # the longest seq <= hi whose sizes >= 2 collide with nothing, else the longest seq <= hi
        seqs = range(min(hi, max_length), blocks, -1)
        for seq in seqs:
            sizes = [seq, blocks * block_size, seq + blocks * block_size] + ([blocks] if blocks > 1 else [])
            if len(set(sizes)) == len(sizes) and not set(sizes) & (avoid | {many_rows}):
                return seq, blocks
        return (seqs[0], blocks) if seqs else None

    def kind(seq: int, blocks: int) -> tuple[bool, ...]:
        if not flex:  # dense attention: blocks only change the (symbolic) query length
            return ()
        q, kv = blocks * block_size, seq + blocks * block_size
        return blocks == 1, q <= _TILE, kv <= _TILE

    one_tile = max(1, _TILE // block_size)  # most blocks whose queries fit one tile
    cases: dict[tuple[bool, ...], tuple[int, int]] = {}
    for blocks in sorted(
        {max_blocks, min(max_blocks, one_tile), min(max_blocks, 3), min(max_blocks, 2), 1}, reverse=True
    ):
        for hi in (max_length, _TILE - blocks * block_size):  # several key tiles, then one
            found = pick(blocks, hi)
            if found is not None:
                cases.setdefault(kind(*found), found)
    row_cases = [1, many_rows] if rows >= 2 else [1]
    return [(r, seq, blocks) for r in row_cases for seq, blocks in cases.values()]


def _model_sizes(model: torch.nn.Module) -> set[int]:
    """Every size of every parameter and buffer: warm-up sizes avoid them (see ``warm_up``)."""
    return {int(n) for p in (*model.parameters(), *model.buffers()) for n in p.shape}


# --------------------------------------------------------------------------------------------
# Signals


class _Signals:
    """First SIGTERM/SIGINT: graceful stop (the pipeline checkpoints); second: exit at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.pipeline: Pipeline | None = None
        self.defer = False  # a node of a group: the stop waits for the next barrier (every node stops there)
        self._old: dict[int, t.Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals only reach the main thread (tests may run us elsewhere)
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _handle(self, signum: int, _frame: t.Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            os.write(2, f"dflash: second {name}: exiting now, without a checkpoint\n".encode())
            os._exit(128 + signum)
        self.received = signum
        if self.defer:
            os.write(
                2,
                f"dflash: {name}: every node stops at the next averaging barrier, then a checkpoint and exit\n".encode(),
            )
            return
        os.write(2, f"dflash: {name}: finishing the steps in flight, then a checkpoint and exit\n".encode())
        if self.pipeline is not None:
            self.pipeline.request_stop()  # sets a flag only: safe inside a handler


# --------------------------------------------------------------------------------------------
# The run


class Run:
    """Everything one training run needs, built from a config (``build``), then ``train()``."""

    def __init__(
        self, cfg: RunConfig, *, environ: t.Mapping[str, str] | None = None, stream: t.TextIO | None = None
    ) -> None:
        self.cfg = cfg
        self.env = dict(os.environ if environ is None else environ)
        self.stream = stream if stream is not None else sys.stdout
        self.run_dir = cfg.run_dir(self.env)
        self.ckpt_dir = cfg.checkpoint_dir(self.env)
        self.start_step = 0
        self.position: DataPosition | None = None
        self.last_saved: int | None = None
        self.run_id: str | None = None  # chosen by _find_resume: kept across resumes, new for a fresh start
        self.writer = ckpt.CheckpointWriter(self.ckpt_dir, keep=cfg.checkpoint.keep)
        self.pipeline: Pipeline | None = None
        self.metrics: Metrics | None = None
        self.signals: _Signals | None = None
        # A node of a torchrun group (None: a plain run). Every node runs this same code; the collectives
        # happen at the same points on each (start-up, and every barrier: see on_sync).
        try:
            self.group = NodeGroup.from_env(self.env, timeout=cfg.distributed.timeout)
        except ValueError as e:
            raise ConfigError("distributed", str(e)) from None
        self._tokens = 0  # target tokens trained since the last barrier (the group's per-node split)
        self._tokens_lock = threading.Lock()
        self._last_sync = time.monotonic()
        self._syncs = 0  # barriers so far: every node must be at the same one
        self.group_stop = 0  # the signal another node of the group received (we stopped with it)
        spec = self.env.get(FAULT_ENV, "").strip()
        try:
            self.injector = faults_from_env(spec, self.ckpt_dir) if spec else FaultInjector()
        except ValueError as e:
            raise ConfigError(f"${FAULT_ENV}", str(e).removeprefix(f"{FAULT_ENV}: ")) from None
        if cfg.metrics.tensorboard and not tensorboard_available():  # before the models load, not mid-run
            raise ConfigError("metrics.tensorboard", TENSORBOARD_HINT)
        self._build()

    # building ---------------------------------------------------------------------------

    def _build(self) -> None:
        cfg = self.cfg
        check_devices(cfg)
        torch.manual_seed(cfg.seed)
        # Every node's (targets, drafters): shard numbers and drafter seeds continue across nodes in rank order.
        here = (len(cfg.devices.targets), len(cfg.devices.drafters))
        self.nodes: list[tuple[int, int]] = self.group.all_gather(here) if self.group is not None else [here]
        rank = self.group.rank if self.group is not None else 0
        self.target_offset = sum(n[0] for n in self.nodes[:rank])
        self.drafter_offset = sum(n[1] for n in self.nodes[:rank])
        resume: ckpt.Checkpoint | None = None
        if self.group is not None:
            # A barrier's steps in flight must not reach the next interval's multiple on one node and not on
            # another: an interval of at least (nodes x drafters per node) steps keeps the barriers in step.
            need = len(self.nodes) * max(n[1] for n in self.nodes)
            for key, every in (("average_every", cfg.average_every), ("checkpoint.interval", cfg.checkpoint.interval)):
                if every and every < need:
                    raise ConfigError(
                        key,
                        f"{every} is less than nodes x drafters per node ({need}); "
                        f"a run over {len(self.nodes)} nodes needs at least {need}",
                    )
        if self.group is None:
            resume = self._find_resume()
        else:
            resume = self._group_resume()
        self.targets = self._build_targets()
        t0 = self.targets[0].model
        self.vocab_size = t0.vocab_size
        tokenizer = self._tokenizer()
        self.init_drafter = self._init_drafter(t0) if cfg.drafter.init_from else None
        mask_id = cfg.drafter.mask_token_id
        if self.init_drafter is not None:
            init_mask = self.init_drafter.mask_token_id
            if mask_id is not None and mask_id != init_mask:
                raise ConfigError(
                    "drafter.mask_token_id",
                    f"{mask_id} differs from {init_mask}, the id the drafter in "
                    f"drafter.init_from was trained with; leave it out",
                )
            mask_id = init_mask
        elif mask_id is None:
            published = published_mask_token_id(t0.model.config)
            if published is not None and (tokenizer is None or len(tokenizer) <= published):
                mask_id = published  # what published drafters of this family use: warm starts and comparisons agree
            else:
                mask_id = default_mask_token_id(t0.vocab_size, len(tokenizer) if tokenizer is not None else None)
        elif mask_id >= t0.vocab_size:
            raise ConfigError("drafter.mask_token_id", f"{mask_id} is outside the target vocabulary ({t0.vocab_size})")
        self.mask_token_id = mask_id
        if self.init_drafter is not None:
            self.draft_config = self.init_drafter.config
        else:
            self.draft_config = draft_config_for(
                t0.model.config,
                num_layers=cfg.drafter.layers,
                block_size=cfg.drafter.block_size,
                mask_token_id=mask_id,
                target_layer_ids=t0.layer_ids,
            )
        self.dataset = JsonlDataset(
            cfg.data.path,
            format=cfg.data.format,
            tokenizer=tokenizer,
            max_length=cfg.data.max_length,
            vocab_size=t0.vocab_size,
            mask_token_id=mask_id,
            chat_template_kwargs=cfg.data.chat_template_kwargs,
        )
        self.plan = BatchPlan(
            self.dataset.lengths,
            batch_size=cfg.data.batch_size,
            max_batch_tokens=cfg.data.max_batch_tokens,
            bucket_window=cfg.data.bucket_window,
            shuffle=cfg.data.shuffle,
            seed=cfg.seed,
        )
        cfg = self._derive_steps(cfg)
        assert cfg.max_steps is not None  # _derive_steps sets it
        self.schedule = LRSchedule(
            lr=cfg.optim.lr,
            total_steps=cfg.max_steps,
            warmup_ratio=cfg.optim.warmup_ratio,
            schedule=cfg.optim.schedule,
            min_lr_ratio=cfg.optim.min_lr_ratio,
        )
        self.drafters = self._build_drafters()
        if resume is not None:
            self._restore(resume)
        self.averager = Averager.for_replicas(
            [r.trainable() for r in self.drafters],
            cross_reduce=self.group.cross_reduce if self.group is not None else None,
        )
        # Shard = (node, local target): this node's slice of the shards of every node, batch g in shard g mod all.
        self.all_shards = sum(n[0] for n in self.nodes)
        starts = shard_starts(self.all_shards, self.position)[
            self.target_offset : self.target_offset + len(self.targets)
        ]
        self.shard_starts = starts
        self.sources = [Shard(self.dataset, self.plan, start=s, stride=self.all_shards) for s in starts]

    def _init_drafter(self, t0: TargetModel) -> DFlashDraftModel:
        """The drafter of ``drafter.init_from`` (ours or a published z-lab folder), checked against this run."""
        d = self.cfg.drafter
        key = "drafter.init_from"
        try:
            model = ckpt.load_drafter(Path(t.cast(str, d.init_from)).expanduser())
        except ckpt.CheckpointError as e:
            raise ConfigError(key, str(e)) from None
        c = model.config
        text = t0.model.config.get_text_config() if hasattr(t0.model.config, "get_text_config") else t0.model.config
        checks = [
            ("vocab_size", c.vocab_size, t0.vocab_size, "the target's vocabulary"),
            ("hidden_size", c.hidden_size, int(text.hidden_size), "the target's hidden size"),
            ("num_target_layers", c.num_target_layers, int(text.num_hidden_layers), "the target's layers"),
            ("target_layer_ids", list(model.target_layer_ids), list(t0.layer_ids), "the target layers this run reads"),
            ("num_hidden_layers", c.num_hidden_layers, d.layers, "drafter.layers"),
            ("block_size", model.block_size, d.block_size, "drafter.block_size"),
        ]
        for name, theirs, ours, what in checks:
            if theirs != ours:
                raise ConfigError(key, f"{d.init_from}: {name} is {theirs}, but {what} is {ours}")
        logger.info("drafter: warm start from %s (MASK id %d)", d.init_from, model.mask_token_id)
        return model

    def _derive_steps(self, cfg: RunConfig) -> RunConfig:
        """Sequences per update -> batches per update; ``epochs`` -> max_steps. Printed; the config keeps them."""
        drafters = sum(n[1] for n in self.nodes)  # every node's: sequences_per_update's default is global
        spu = cfg.optim.sequences_per_update or math.ceil(UPDATE_SEQUENCES / drafters)
        self.accumulate = math.ceil(spu / cfg.data.batch_size)
        per_update = self.accumulate * cfg.data.batch_size
        batches, exact = self.plan.batches_per_epoch()  # a big token store's: estimated (counting is O(corpus))
        if cfg.max_steps is None:
            max_steps = max(1, math.ceil(cfg.epochs * batches / self.accumulate))
            how = f"{cfg.epochs:g} epoch(s) x {'' if exact else '~'}{batches} batches / {self.accumulate} per update"
        else:
            max_steps = cfg.max_steps
            how = f"max_steps set ({max_steps * self.accumulate / batches:.2f} epochs)"
        warmup = math.ceil(cfg.optim.warmup_ratio * max_steps)
        logger.info(
            "updates: %d sequences per update per drafter (%d batch(es) of <= %d), %d drafter(s): ~%d sequences per "
            "round; %d samples; max_steps %d (%s); warmup %d steps",
            per_update,
            self.accumulate,
            cfg.data.batch_size,
            drafters,
            per_update * drafters,
            len(self.dataset.lengths),
            max_steps,
            how,
            warmup,
        )
        cfg = dataclasses.replace(
            cfg, max_steps=max_steps, optim=dataclasses.replace(cfg.optim, sequences_per_update=spu)
        )
        self.cfg = cfg
        return cfg

    def _group_resume(self) -> ckpt.Checkpoint | None:
        """Every node looks in its own checkpoint dir; the newest checkpoint of any node (newest run, then
        step) is sent to all. torchrun's c10d rendezvous may hand rank 0 to another box after a restart, and
        with no shared filesystem the checkpoints are on whichever box was rank 0 when they were written."""
        assert self.group is not None
        group = self.group
        group.doing = "resume"
        mine: ckpt.Checkpoint | None = None
        problem: str | None = None
        try:
            mine = self._find_resume()
        except ConfigError as e:  # said to every node below, so none waits for a collective that never comes
            problem = str(e)
        key = (self.run_id or "", mine.step) if mine is not None else None
        found = group.all_gather((key, problem))
        have = [(k, rank) for rank, (k, _) in enumerate(found) if k is not None]
        if not have:
            problems = [p for _, p in found if p]
            if problems:
                raise ConfigError("checkpoint.resume", f"on every node: {problems[0]}")
            self.run_id = group.broadcast(self.run_id)  # a fresh start: rank 0's run id for all
            return None
        src = max(have)[1]
        if src != group.rank:
            logger.info(
                "resume: node %d holds the newest checkpoint (step %d); it is sent to this node", src, max(have)[0][1]
            )
        self.run_id, resume = group.broadcast((self.run_id, mine) if group.rank == src else None, src=src)
        return t.cast("ckpt.Checkpoint | None", resume)

    def _find_resume(self) -> ckpt.Checkpoint | None:
        """The checkpoint to continue (loaded and verified), and this run's id (``self.run_id``)."""
        mode = self.cfg.checkpoint.resume
        if mode == "never":
            moved = ckpt.move_aside(self.ckpt_dir)
            if moved:
                logger.warning(
                    'checkpoint.resume = "never": the checkpoints already in %s were moved aside to %s '
                    "(nothing deleted); starting from step 0",
                    self.ckpt_dir,
                    ", ".join(p.name for p in moved),
                )
            self.run_id = ckpt.new_run_id()
            return None
        if mode == "auto":
            tried = []
            for path in ckpt.resume_order(self.ckpt_dir):
                try:
                    c = ckpt.load_checkpoint(path, map_location="cpu")
                except ckpt.CheckpointError as e:
                    logger.warning(
                        "resume: skipping %s: %s; trying the previous complete checkpoint",
                        path,
                        str(e).removeprefix(f"{path}: "),
                    )
                    tried.append(path.name)
                    continue
                self.run_id = self._lineage(c)
                return c
            if tried:  # fail closed: never quietly start over on top of a run whose checkpoints all went bad
                raise ConfigError(
                    "checkpoint.resume",
                    f"no checkpoint in {self.ckpt_dir} is intact ({', '.join(tried)}); "
                    'move them away, or set checkpoint.resume = "never" to start over',
                )
            self.run_id = ckpt.new_run_id()
            return None
        path = Path(mode).expanduser()
        if not path.is_dir():
            raise ConfigError(
                "checkpoint.resume", f'expected "auto", "never" or a checkpoint directory; {path} does not exist'
            )
        try:
            c = ckpt.load_checkpoint(path, map_location="cpu")
        except ckpt.CheckpointError as e:
            raise ConfigError("checkpoint.resume", str(e)) from e
        self.run_id = self._lineage(c)
        return c

    def _lineage(self, c: ckpt.Checkpoint) -> str:
        """Continue the checkpoint's run, unless that run already went further (a fork: continuing it
        under the same id would prune or overwrite its later checkpoints) or has no id (written before ids)."""
        if c.run_id is None:
            run_id = ckpt.new_run_id()
            logger.info("resume: %s has no run id (an older checkpoint); this run is %s", c.path, run_id)
            return run_id
        later = [
            p.name for p in ckpt.list_complete(self.ckpt_dir) if ckpt.run_of(p) == c.run_id and _step_number(p) > c.step
        ]
        if later:
            run_id = ckpt.new_run_id()
            logger.warning(
                "resume: run %s already has later checkpoints (%s) than %s; continuing as run %s, "
                "which leaves them alone",
                c.run_id,
                ", ".join(later),
                c.path,
                run_id,
            )
            return run_id
        return c.run_id

    def _build_targets(self) -> list[TargetReplica]:
        cfg = self.cfg
        dtype = torch_dtype(cfg.target.dtype)
        devices = list(cfg.devices.targets)
        drafter_devices = list(cfg.devices.drafters)
        out = []
        for i, dev in enumerate(devices):
            if cfg.target.tiny is not None:
                tiny = cfg.target.tiny
                tc = tiny_target_config_of(tiny)
                model = TargetModel.from_config(
                    tc,
                    dtype=dtype,
                    device=dev,
                    seed=tiny.seed,
                    layer_ids=cfg.drafter.target_layer_ids,
                    num_draft_layers=cfg.drafter.layers,
                )
            else:
                assert cfg.target.path is not None
                try:
                    model = TargetModel.from_pretrained(
                        cfg.target.path,
                        dtype=dtype,
                        device=dev,
                        layer_ids=cfg.drafter.target_layer_ids,
                        num_draft_layers=cfg.drafter.layers,
                    )
                except OSError as e:
                    raise ConfigError("target.path", f"cannot load a model from {cfg.target.path}: {e}") from e
            if cfg.queue.mode == "per-drafter":
                dest = drafter_devices[i % len(drafter_devices)]
            elif len(set(drafter_devices)) == 1:
                dest = drafter_devices[0]
            else:
                dest = "cpu"  # any drafter may take it: pinned host memory, each drafter copies it over
            out.append(TargetReplica(model, dev, dest))
        return out

    def _tokenizer(self) -> t.Any:
        d = self.cfg.data
        path = d.tokenizer or (self.cfg.target.path if d.format != "tokens" else None)
        if path is None:
            return None
        try:
            return load_tokenizer(path)
        except DataError:
            if d.tokenizer is not None or d.format == "chat":
                raise
            return None  # the target folder has no tokenizer; pre-tokenized data needs none

    def _build_drafters(self) -> list[DrafterReplica]:
        cfg = self.cfg
        dtype = torch_dtype(cfg.drafter.dtype)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            base = DFlashDraftModel(self.draft_config)
        if self.init_drafter is not None:
            base.load_state_dict(self.init_drafter.state_dict(), strict=True)
        heads: dict[str, TargetHead] = {}
        out = []
        for j, dev in enumerate(cfg.devices.drafters):
            model = copy.deepcopy(base).to(device=dev, dtype=dtype)  # type: ignore[call-arg]  # @wraps(Module.to) hides self
            if dev not in heads:
                heads[dev] = self.targets[0].model.head().to(dev)
            prepare_drafter(
                model,
                activation_checkpointing=cfg.activation_checkpointing,
                compile=cfg.compile,
                backend=cfg.compile_backend,
            )
            out.append(
                DrafterReplica(
                    model,
                    heads[dev],
                    device=dev,
                    cfg=cfg,
                    schedule=self.schedule,
                    seed=cfg.seed * 1000 + self.drafter_offset + j,
                    index=j,
                )
            )
        return out

    def _restore(self, c: ckpt.Checkpoint) -> None:
        path = c.path
        mine, theirs = self.draft_config, c.config
        for key, name in (
            ("num_hidden_layers", "drafter.layers"),
            ("block_size", "drafter.block_size"),
            ("hidden_size", "target"),
            ("vocab_size", "target"),
        ):
            if getattr(mine, key) != getattr(theirs, key):
                raise ConfigError(
                    name,
                    f"the checkpoint {path} has {key}={getattr(theirs, key)}, this run {getattr(mine, key)}; "
                    'resume it with the same model, or set checkpoint.resume = "never"',
                )
        if mine.target_layer_ids != theirs.target_layer_ids or mine.mask_token_id != theirs.mask_token_id:
            raise ConfigError("drafter", f"the checkpoint {path} was trained on other target layers or another MASK id")
        for r in self.drafters:
            r.model.load_state_dict(c.state_dict, strict=True)
        state = c.trainer_state or {}
        opt = c.optimizer_state or {}
        masters = opt.get("masters")
        for j, r in enumerate(self.drafters):
            if r.separate_masters:
                with torch.no_grad():
                    if masters is not None:
                        for m, saved in zip(r.masters, masters):
                            m.copy_(saved)
                    else:
                        for m, p in zip(r.masters, r.params):
                            m.copy_(p)
            saved_opts = opt.get("replicas") or []
            if saved_opts:
                r.optimizer.load_state_dict(saved_opts[j % len(saved_opts)])
            gens = state.get("generators") or []
            if self.drafter_offset + j < len(gens):  # every node's, in rank order (a group's checkpoint)
                r.generator.set_state(gens[self.drafter_offset + j])
        if "rng" in state:
            ckpt.restore_rng_state(state["rng"])
        self.start_step = c.step
        self.last_saved = c.step
        if "data" in state:
            pos = DataPosition.from_dict(state["data"])
            expect = f"{self.dataset.fingerprint()}:{self.plan.fingerprint()}"
            if pos.fingerprint and pos.fingerprint != expect:
                logger.warning(
                    "resume: the data or its batching changed since %s; continuing at the saved batch indices", path
                )
            self.position = pos
        logger.info("resuming from %s at step %d (run %s)", path, c.step, self.run_id)

    # running ----------------------------------------------------------------------------

    def save(self, step: int, position: t.Sequence[int], replicas: t.Sequence[int]) -> Path | None:
        """Snapshot one replica to CPU (the drafters wait only for this) and hand it to the background writer.

        After averaging every replica holds the same weights, so one is saved; so are ONE replica's AdamW
        moments (the first at the barrier): the others' differ only by the batches they saw, and saving
        them all multiplied the barrier's copies and the bytes on disk by the number of drafters.
        ``_restore`` gives each replica its own moments when a checkpoint has several (older ones do).
        """
        if step == self.last_saved:
            return None
        generators = [r.generator.get_state() for r in self.drafters]
        if self.group is not None:  # every node's shards and anchor generators, in rank order; rank 0 writes
            self.group.doing = "checkpoint"
            parts = self.group.all_gather((list(position), generators))
            position = [g for pos, _ in parts for g in pos]
            generators = [g for _, gens in parts for g in gens]
            if not self.group.is_main:
                self.last_saved = step
                return None
        self.writer.wait()  # one write at a time, and at most one snapshot in memory
        reps = [self.drafters[j] for j in replicas]
        first = reps[0]
        trainer_state: dict[str, t.Any] = {
            "step": step,
            "run_id": self.run_id,
            "data": DataPosition(tuple(position), f"{self.dataset.fingerprint()}:{self.plan.fingerprint()}").to_dict(),
            "targets": self.all_shards,
            "drafters": sum(n[1] for n in self.nodes),
            "nodes": len(self.nodes),
            "config": to_dict(self.cfg),
            "rng": ckpt.rng_state(),
            "generators": generators,
        }
        optimizer_state = None
        if self.cfg.checkpoint.optimizer:
            optimizer_state = {  # a replica at the barrier: a straggler may be mid-step
                "replicas": [first.optimizer.state_dict()],
                "masters": list(first.masters) if first.separate_masters else None,
            }
        if self.injector.check("checkpoint", 0, step) is not None:
            trainer_state["fault"] = SigkillWhenPickled()
        snap = ckpt.snapshot(
            first.model,
            step=step,
            run_id=self.run_id,
            trainer_state=trainer_state,
            optimizer_state=optimizer_state,
            reuse=self.writer.spare(),
        )
        self.writer.submit(snap)
        self.last_saved = step
        return self.ckpt_dir / f"step-{step}"

    def on_sync(self, ev: SyncEvent) -> None:
        if self.group is not None:
            self._group_sync(ev, self.group)
            return
        if ev.average and len(ev.replicas) > 1:
            reps = [self.drafters[j] for j in ev.replicas]
            self.averager.average([r.trainable() for r in reps])
            for r in reps:
                r.sync_from_masters()
            rnd = self.averager.last_round
            logger.debug(
                "step %d: averaged drafters %s in %.3fs (%.1f MB moved)",
                ev.step,
                list(ev.replicas),
                rnd.seconds if rnd else 0.0,
                rnd.bytes_moved / 2**20 if rnd else 0.0,
            )
        if ev.checkpoint:
            self.save(ev.step, ev.position, ev.replicas)
        else:
            self.writer.check()  # a failed background write ends the run at the next barrier

    def _group_sync(self, ev: SyncEvent, group: NodeGroup) -> None:
        """A barrier of a node of a group: the same collectives in the same order on every node.

        Headers first (the nodes must be at the same barrier; per-node throughput; a pending stop), then
        the averaging over every node's replicas (also before a checkpoint: rank 0 saves its replica for
        all), then the checkpoint, then the stop: a SIGTERM on any node stops every node here.
        """
        now = time.monotonic()
        with self._tokens_lock:
            tokens, self._tokens = self._tokens, 0
        seconds, self._last_sync = now - self._last_sync, now
        self._syncs += 1
        stop = self.signals.received if self.signals is not None and self.signals.received is not None else 0
        header = Header(
            index=self._syncs,
            step=ev.step,
            average=ev.average,
            checkpoint=ev.checkpoint,
            final=ev.final,
            replicas=len(ev.replicas),
            tokens=tokens,
            seconds=seconds,
            stop=stop,
        )
        rnd = group.exchange(header, doing="the barrier")
        step = rnd.headers[0].step  # with several drafters per node the steps in flight differ a little: rank 0's
        if group.is_main:
            per = [h.tokens / max(h.seconds, 1e-9) / 1e3 for h in rnd.headers]
            logger.info(
                "nodes | step %d | %.1f Ktok/s | %s",
                step,
                sum(per),
                " | ".join(f"node-{r} {k:.1f}" for r, k in enumerate(per)),
            )
        if ev.average or ev.checkpoint:
            group.doing = "averaging"
            reps = [self.drafters[j] for j in ev.replicas]
            self.averager.average([r.trainable() for r in reps])
            for r in reps:
                r.sync_from_masters()
            avg = self.averager.last_round
            logger.debug(
                "step %d: averaged drafters %s with %d replica(s) on %d node(s) in %.3fs",
                step,
                list(ev.replicas),
                rnd.replicas,
                group.world,
                avg.seconds if avg else 0.0,
            )
        if ev.checkpoint:
            self.save(step, ev.position, ev.replicas)
        else:
            self.writer.check()
        if ev.final:  # the same digest on every node: every replica of the group holds the same bytes
            logger.info(
                "node %d: weights sha256 %s (step %d)",
                group.rank,
                " ".join(weights_digest(self.drafters[j].trainable()) for j in ev.replicas),
                step,
            )
        if rnd.stop and not ev.final and self.pipeline is not None:
            asked = [r for r, h in enumerate(rnd.headers) if h.stop]
            logger.warning(
                "stop requested on node(s) %s: every node stops after the barrier at step %d",
                ", ".join(map(str, asked)),
                step,
            )
            self.group_stop = rnd.stop
            self.pipeline.request_stop()  # from a drafter thread: the drafters leave after this barrier

    def _on_step(self, step: int, stats: StepStats, tokens: int) -> None:
        with self._tokens_lock:
            self._tokens += tokens
        if self.metrics is not None:
            self.metrics.record(step, stats, tokens)

    def _finish_writes(self, *, failing: bool = False) -> None:
        """Wait for the checkpoint in flight. While another error is on its way out, only log the writer's."""
        if self.writer.busy:
            logger.info("waiting for the checkpoint being written")
        try:
            self.writer.wait()
        except ckpt.CheckpointWriteError as e:
            if not failing:
                raise
            logger.error("%s", e)

    def train(self, signals: _Signals | None = None) -> int:
        cfg = self.cfg
        assert cfg.max_steps is not None  # _derive_steps set it in __init__
        if self.start_step >= cfg.max_steps:
            logger.info("already at step %d (max_steps %d): nothing to train", self.start_step, cfg.max_steps)
            return EXIT_OK
        # Compiled code (the layers, or flex attention alone on CUDA) is built here, serially, for every
        # shape a batch can have; torch.compile is not thread-safe, and in a thread it would stall the others.
        compiled = cfg.compile or any(torch.device(r.device).type == "cuda" for r in self.drafters)
        if compiled:
            started = time.monotonic()
            for r in self.drafters:
                shapes = warm_up(
                    r,
                    feature_size=self.targets[0].model.feature_size,
                    vocab_size=self.vocab_size,
                    mask_token_id=self.mask_token_id,
                )
            logger.info(
                "compiled the drafter for %d batch shapes in %.0f s; a recompile from now on is an error",
                len(shapes),
                time.monotonic() - started,
            )
        self.pipeline = Pipeline(
            targets=self.targets,
            sources=self.sources,
            drafters=self.drafters,
            shard_starts=self.shard_starts,
            on_sync=self.on_sync,
            injector=self.injector,
            options=PipelineOptions(
                max_steps=cfg.max_steps,
                start_step=self.start_step,
                capacity=cfg.queue.capacity,
                mode=cfg.queue.mode,
                max_bytes=cfg.queue.max_bytes,
                average_every=cfg.average_every if len(self.drafters) > 1 or self.group is not None else 0,
                checkpoint_every=cfg.checkpoint.interval,
                barrier_timeout=cfg.barrier_timeout,
                oom_retry=cfg.optim.oom_retry,
                accumulate=self.accumulate,
                # a node of a group: each local update is one step of every node (all count the same steps)
                step_stride=len(self.nodes),
                shard_stride=self.all_shards,
            ),
        )
        self.metrics = Metrics(
            log_every=cfg.log_every,
            path=self.run_dir / "metrics.jsonl",
            stream=self.stream,
            snapshot=self.pipeline.snapshot,
            tensorboard_dir=self.run_dir if cfg.metrics.tensorboard else None,
            step_stride=len(self.nodes),
        )
        self.pipeline.on_step = self._on_step if self.group is not None else self.metrics.record
        self.signals = signals
        if signals is not None:
            signals.pipeline = self.pipeline
            signals.defer = self.group is not None  # a group stops together, at the next barrier
            if signals.received is not None and self.group is None:
                logger.warning("stopped before training started")
                return 128 + signals.received
        logger.info(
            "training: %d target(s) %s -> queue %s (capacity %d) -> %d drafter(s) %s; steps %d..%d; checkpoints in %s; metrics in %s",
            len(self.targets),
            list(cfg.devices.targets),
            cfg.queue.mode,
            cfg.queue.capacity,
            len(self.drafters),
            list(cfg.devices.drafters),
            self.start_step,
            cfg.max_steps,
            self.ckpt_dir,
            self.run_dir / "metrics.jsonl",
        )
        self.metrics.start()
        self._last_sync = time.monotonic()
        try:
            if compiled:  # a miss would be unfused attention (out of memory) or a compile in a thread: fail
                torch.compiler.set_stance("fail_on_recompile")
            result = self.pipeline.run()
        except BaseException:
            self._finish_writes(failing=True)
            raise
        finally:
            self.metrics.close()
            if compiled:
                torch.compiler.set_stance("default")
        self._finish_writes()  # the final checkpoint is on disk before we say so or exit
        for f in result.failures:
            logger.warning("during the run: %s", f.summary())
        received = signals.received if signals is not None and signals.received is not None else self.group_stop
        if result.reason == "stopped" and received:
            logger.warning("stopped at step %d after a checkpoint", result.steps)
            return 128 + received
        logger.info("finished at step %d", result.steps)
        return EXIT_OK


def weights_digest(tensors: t.Sequence[torch.Tensor]) -> str:
    """sha256 (16 hex digits) of the tensors' bytes in order: equal digests, bit-identical replicas."""
    h = hashlib.sha256()
    for p in tensors:
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _step_number(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def run_training(cfg: RunConfig, *, environ: t.Mapping[str, str] | None = None, stream: t.TextIO | None = None) -> int:
    """Build the run, train it, return the process exit code (see ``dflash.__main__``)."""
    signals = _Signals()
    signals.install()
    try:
        run = Run(cfg, environ=environ, stream=stream)
        if signals.received is not None and run.group is None:
            return 128 + signals.received
        code = run.train(signals)
        if run.group is not None:  # not after a failure: a lost peer could make the teardown wait
            run.group.close()
        return code
    finally:
        signals.restore()


__all__ = [
    "DrafterReplica",
    "FeatureBatch",
    "LRSchedule",
    "Run",
    "TargetReplica",
    "prepare_drafter",
    "run_training",
    "torch_dtype",
    "warm_up",
    "weights_digest",
]
