"""The replicas a run trains with: one target per target thread, one drafter per drafter thread.

- ``TargetReplica``: a frozen target on its device, batch -> ``FeatureBatch`` (the features on the
  consumer's device, or pinned host memory);
- ``DrafterReplica``: a drafter with its fp32 master weights, optimizer, anchor generator and the target's
  frozen head; one ``step`` is one optimizer update over one batch or several (gradient accumulation, one
  weight sum), with the OOM retry's halved batch (``micro_batches``);
- ``LRSchedule``: the learning rate at a global step; ``torch_dtype``: a config's dtype name (dflash/dtypes.py).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import typing as t

import torch

from dflash.config import DataConfig, DrafterConfig, LossConfig, OptimConfig, RunConfig
from dflash.model.drafter import DFlashDraftModel
from dflash.model.loss import drafter_loss
from dflash.model.target import TargetHead, TargetModel
from dflash.train.divergence import nonfinite_code
from dflash.train.feature_queue import (
    cached_host_bytes,
    empty_host_cache,
    feature_item_bytes,
    pinned_block,
    pinned_host_bytes,
)
from dflash.train.optimizer import DrafterOptimizer
from dflash.train.pipeline import StepStats


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


def held_bytes(x: torch.Tensor) -> int:
    """Memory a tensor really holds: pinned host blocks come from torch's caching host allocator, which rounds
    every block up to a power of two (and keeps it cached when freed)."""
    n = int(x.nbytes)
    return pinned_block(n) if x.device.type == "cpu" and x.is_pinned() else n


@dataclasses.dataclass(slots=True)
class FeatureBatch:
    """A queue item's payload: target features and the tokens they belong to."""

    input_ids: torch.Tensor  # [B, S] (CPU; pinned when the run uses CUDA)
    loss_mask: torch.Tensor  # [B, S] (CPU; pinned when the run uses CUDA)
    features: torch.Tensor  # [B, S, n*H] on the consumer's device, or (pinned) CPU
    index: int  # global batch index
    ready: t.Any = None  # a CUDA event after the features were made/copied on the target's own stream
    prefetched: torch.Tensor | None = None  # the features' copy on the drafter's GPU (``prefetch``)
    copied: t.Any = None  # a CUDA event after that copy (on the drafter's side stream)

    @property
    def nbytes(self) -> int:
        """What the item holds in memory, as allocated (the queue's byte bound counts it)."""
        return held_bytes(self.features) + held_bytes(self.input_ids) + held_bytes(self.loss_mask)

    def prefetch(self, device: torch.device, stream: t.Any) -> None:
        """Start copying host features to ``device`` on ``stream`` (a side stream of the drafter): the copy of
        the next item runs while the compute stream trains this one; ``take`` then only waits for it."""
        if device.type != "cuda" or self.features.device == device or self.prefetched is not None:
            return
        with torch.cuda.stream(stream):
            self.prefetched = self.features.to(device, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)

    def take(self, device: torch.device) -> torch.Tensor:
        """The features on ``device``, usable by the calling thread's current stream (no host sync)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self.ready is not None and self.features.device == device:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.ready)
            self.features.record_stream(stream)  # allocated on the target's stream: no early reuse
            return self.features
        if self.prefetched is not None and self.prefetched.device == device:
            stream = torch.cuda.current_stream(device)
            stream.wait_event(self.copied)
            self.prefetched.record_stream(stream)  # allocated on the side stream
            feats, self.prefetched = self.prefetched, None  # the item hands it over once
            return feats
        return self.features.to(device, non_blocking=True)


class LaunchFence:
    """At most ``depth`` micro-batches of one drafter queued on its GPU.

    A drafter step makes no host sync, so without a bound its host thread runs ahead until CUDA's launch
    queue is full, and from then on every launch blocks, also those inside the process-wide lock around
    compiled forwards (``dflash.model.drafter._compiled_calls``): the other drafters would wait on a lock whose
    holder waits on its own GPU. Before launching a micro-batch the host waits (a blocking-sync CUDA event:
    the thread sleeps, the GIL is free) for the end of the one ``depth`` back, so the GPU always has work
    queued and the lock is held for CPU work only. ``event``: the event type (None: no fence, the CPU).
    """

    def __init__(self, depth: int = 2, event: t.Callable[[], t.Any] | None = None) -> None:
        self.depth = max(1, depth)
        self.event = event
        self.pending: collections.deque[t.Any] = collections.deque()

    def wait(self) -> None:
        while len(self.pending) >= self.depth:
            self.pending.popleft().synchronize()

    def mark(self) -> None:
        if self.event is not None:
            ev = self.event()
            ev.record()
            self.pending.append(ev)

    def clear(self) -> None:
        self.pending.clear()


def _blocking_event() -> t.Any:
    return torch.cuda.Event(blocking=True)


class TargetReplica:
    """One target thread's frozen model: batch -> FeatureBatch on ``dest``.

    On CUDA the forward runs on a stream of this replica's own: a target sharing a GPU with a drafter (one
    GPU for both) then never puts its kernels inside the drafter's stream, its step events or its waits.
    A copy to another GPU runs against a stream of this replica's own on that GPU: a copy between the
    CURRENT streams would wait for the drafter's queued work there (and make it wait for this
    forward), i.e. targets and drafters in lock-step. The host waits for its own forward and copy only,
    so its busy time is the forward's.
    """

    def __init__(self, model: TargetModel, device: str, dest: str) -> None:
        self.model = model
        self.device = device
        self.dest = dest  # a device string; "cpu" from a GPU means pinned host memory
        self._stream: t.Any = None  # created lazily, on the target's thread
        self._dest_stream: t.Any = None
        self.pinned_limit: int | None = None  # cached (unused) pinned host memory above which the cache is trimmed

    def item_bytes(self, tokens: int) -> int:
        """What an item of ``tokens`` padded tokens holds at most (``payload_bytes`` of such a batch, with
        int64 ids and mask): the largest one sizes the queue's default bound."""
        pinned = torch.device(self.dest).type == "cpu" and torch.device(self.device).type == "cuda"
        return feature_item_bytes(tokens, self.model.feature_size, self.model.dtype.itemsize, pinned=pinned)

    def payload_bytes(self, batch: t.Any) -> int:
        """What ``produce(batch)`` will hold, as allocated, before it runs (the queue reserves it first)."""
        rows, width = batch.input_ids.shape
        feats = int(rows) * int(width) * self.model.feature_size * self.model.dtype.itemsize
        if torch.device(self.dest).type == "cpu" and torch.device(self.device).type == "cuda":
            feats = pinned_block(feats)
        return feats + held_bytes(batch.input_ids) + held_bytes(batch.loss_mask)

    def produce(self, batch: t.Any) -> FeatureBatch:
        dev = torch.device(self.device)
        if dev.type != "cuda":
            feats = t.cast(torch.Tensor, self.model.features(batch.input_ids, batch.attention_mask))
            if torch.device(self.dest) != dev:
                feats = feats.to(self.dest)
            return FeatureBatch(batch.input_ids, batch.loss_mask, feats, int(batch.index))
        ready = None
        with torch.cuda.device(dev):
            if self._stream is None:
                self._stream = torch.cuda.Stream(dev)
                self._stream.wait_stream(torch.cuda.current_stream(dev))  # after the weights' load
            with torch.cuda.stream(self._stream):
                ids = batch.input_ids.to(dev, non_blocking=True)
                att = batch.attention_mask.to(dev, non_blocking=True)
                feats = t.cast(torch.Tensor, self.model.features(ids, att))
                dest = torch.device(self.dest)
                if dest.type == "cpu":
                    self._trim_host_cache()
                    out = torch.empty(feats.shape, dtype=feats.dtype, pin_memory=True)
                    out.copy_(feats, non_blocking=True)
                    self._stream.synchronize()  # the consumer must not read before the copy lands
                    feats = out
                elif dest != dev:
                    feats, ready = self._to_gpu(feats, dest)
                else:  # the drafter on this GPU waits for this event on its own stream (FeatureBatch.take)
                    ready = torch.cuda.Event()
                    ready.record(self._stream)
                    ready.synchronize()
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

    def _trim_host_cache(self) -> None:
        """torch's caching host allocator keeps every freed pinned block for reuse, per power-of-two size:
        batches of other widths leave blocks no later one fits. When the unused ones pass ``pinned_limit``
        they go (blocks in use, such as a checkpoint snapshot's, do not count: freeing the cache spares them)."""
        if self.pinned_limit is not None and cached_host_bytes() > self.pinned_limit:
            empty_host_cache()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaConfig:
    """The sections of a run's config a drafter replica reads: the optimizer and clipping (``optim``), anchors and the
    loss (``drafter``), and the batch shapes its warm-up compiles for (``data``: batch_size, max_length)."""

    optim: OptimConfig
    drafter: DrafterConfig
    data: DataConfig
    loss: LossConfig = LossConfig()  # slot weights and the selector's share

    @classmethod
    def of(cls, cfg: RunConfig) -> ReplicaConfig:
        return cls(cfg.optim, cfg.drafter, cfg.data, cfg.loss)


class DrafterReplica:
    """One drafter thread's replica: its model, fp32 masters, optimizer, anchor generator and frozen head."""

    def __init__(
        self,
        model: DFlashDraftModel,
        head: TargetHead,
        *,
        device: str,
        cfg: ReplicaConfig,
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
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.separate_masters = any(p.dtype != torch.float32 for p in self.params)
        if self.separate_masters:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]
        else:
            self.masters = self.params
        self.optimizer = DrafterOptimizer([n for n, _ in named], self.masters, cfg.optim, device=device)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.trained: list[int] = []  # global batch indices this replica trained (tests, debugging)
        cuda = torch.device(device).type == "cuda"
        # at most 2 micro-batches queued on the GPU (see LaunchFence); the next item's features copy on a side stream
        self.fence = LaunchFence(2, _blocking_event if cuda else None)
        self._copy_stream: t.Any = None
        self.poison: t.Callable[[int], bool] | None = None  # fault injection: True makes that step's update NaN

    def trainable(self) -> list[torch.Tensor]:
        """What averaging averages: the fp32 masters (the parameters themselves in fp32)."""
        return list(self.masters)

    @torch.no_grad()
    def sync_from_masters(self) -> None:
        if self.separate_masters:
            torch._foreach_copy_(self.params, self.masters)  # type: ignore[arg-type]  # Parameters are Tensors; the stub's list is invariant

    def _fold_grads(self, acc: _GradSum | None) -> _GradSum:
        """Add the model's (bf16/fp16) gradients of one micro-batch into the fp32 sum and free them.

        Summing k micro-batches in the low-precision ``.grad`` rounds k times to 8 mantissa bits (bf16);
        here every micro-batch is rounded once (its own backward) and the sum is fp32, as SpecForge's FSDP
        keeps it. One flat fp32 buffer for all masters (allocated at the first micro-batch: the same peak as
        one copy at the end), one for-each add per micro-batch.
        """
        if acc is None:
            acc = _GradSum(self.masters)
        idx = [i for i, p in enumerate(self.params) if p.grad is not None]
        if idx:
            torch._foreach_add_([acc.views[i] for i in idx], [t.cast(torch.Tensor, self.params[i].grad) for i in idx])
            acc.seen.update(idx)
            for i in idx:
                self.params[i].grad = None
        return acc

    def _grads_to_masters(self, acc: _GradSum | None) -> None:
        """The fp32 sum as the masters' grads (a master no micro-batch gave a gradient keeps none)."""
        for i, m in enumerate(self.masters):
            m.grad = acc.views[i] if acc is not None and i in acc.seen else None

    def recover(self) -> None:
        """After an OOM, outside the ``except`` (the failed attempt's frames are gone): drop the grads (and
        the fence's events of the failed attempt).

        No ``torch.cuda.empty_cache()``: it empties the cache of EVERY GPU (stalling the other threads),
        and the caching allocator already frees this device's cached blocks and retries before it
        raises an out-of-memory error.
        """
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad()
        self.fence.clear()

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
        selector: torch.Tensor | None = None  # DFlash2: (selector accuracy, label-in-top-k rate)
        blocks = 0
        scale: torch.Tensor | None = None
        grad_sum: _GradSum | None = None  # separate masters: the fp32 sum of the micro-batches' gradients
        for m in self.masters:
            m.grad = None
        dev = torch.device(self.device)
        self._prefetch(payloads, 0)
        for k, payload in enumerate(payloads):
            self._prefetch(payloads, k + 1)  # its copy overlaps this item's compute
            feats = payload.take(dev)
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
                self.fence.wait()  # the host never runs more than the fence's depth ahead of the GPU
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
                    position_weight=self.cfg.loss.position_weight,
                    dpace_alpha=self.cfg.loss.dpace_alpha,
                    selector_weight=self.cfg.loss.selector_weight,
                )
                if scale is None:
                    scale = out.weight_sum.detach()
                    out.loss.backward()
                else:
                    (out.loss_sum / scale).backward()
                if self.separate_masters:
                    grad_sum = self._fold_grads(grad_sum)
                self.fence.mark()
                share = (b - a) / rows_total
                loss_sum = _add(loss_sum, out.loss_sum.detach().double())
                weight_sum = _add(weight_sum, out.weight_sum.double())
                acc_sum = _add(acc_sum, out.acc * share)
                if out.n_blocks:  # tau_tf is NaN only without blocks
                    tau_sum = _add(tau_sum, out.tau_tf * out.n_blocks)
                    blocks += out.n_blocks
                slots = _add(slots, out.acc_per_slot * share)
                if out.sel_acc is not None and out.top_k_rate is not None:
                    selector = _add(selector, torch.stack([out.sel_acc, out.top_k_rate]) * share)
        assert loss_sum is not None and weight_sum is not None and acc_sum is not None and scale is not None
        if self.separate_masters:
            self._grads_to_masters(grad_sum)
        grads = [m.grad for m in self.masters if m.grad is not None]
        if grads:  # in fp32 on the masters: the one normalisation
            torch._foreach_mul_(grads, (scale.double() / weight_sum).to(grads[0].dtype))
        return {
            "loss": loss_sum / weight_sum,
            "acc": acc_sum,
            "tau_sum": tau_sum,
            "blocks": blocks,
            "slots": slots,
            "selector": selector,
        }

    def _grad_norm(self) -> torch.Tensor | None:
        """The masters' global gradient norm, clipped to ``optim.grad_clip`` when set (a device tensor)."""
        grads = [m for m in self.masters if m.grad is not None]
        if not grads:
            return None
        if self.cfg.optim.grad_clip:
            return torch.nn.utils.clip_grad_norm_(grads, self.cfg.optim.grad_clip)
        return torch.nn.utils.get_total_norm([t.cast(torch.Tensor, m.grad) for m in grads])

    def _prefetch(self, payloads: t.Sequence[FeatureBatch], k: int) -> None:
        dev = torch.device(self.device)
        if k >= len(payloads) or dev.type != "cuda" or not isinstance(payloads[k], FeatureBatch):
            return
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(dev)
        payloads[k].prefetch(dev, self._copy_stream)

    def _step(self, payload: FeatureBatch | t.Sequence[FeatureBatch], *, step: int, micro_batches: int) -> StepStats:
        payloads = [payload] if isinstance(payload, FeatureBatch) else list(payload)
        lr = self.schedule(step)
        self.optimizer.set_lr(lr)
        fig = self.accumulate(payloads, micro_batches=micro_batches)
        if self.poison is not None and self.poison(step):  # DFLASH_FAULT nan-at-step: the loss and grads NaN
            fig["loss"] = fig["loss"] * float("nan")
            grads = [m.grad for m in self.masters if m.grad is not None]
            if grads:
                torch._foreach_mul_(grads, float("nan"))
        grad_norm = self._grad_norm()
        code = nonfinite_code(fig["loss"], grad_norm)
        # A non-finite update never reaches the weights (fused AdamW skips on the device, as under GradScaler;
        # see DrafterOptimizer.step); the code is read with the step's figures.
        self.optimizer.step(code)
        self.optimizer.zero_grad()
        self.model.zero_grad(set_to_none=True)
        self.sync_from_masters()
        self.trained.extend(p.index for p in payloads)
        tau_sum, blocks, slots = fig["tau_sum"], fig["blocks"], fig["slots"]
        ready = None
        if torch.device(self.device).type == "cuda":  # the figures are read after this, never by a device sync
            ready = torch.cuda.Event()
            ready.record()
        return StepStats(
            loss=fig["loss"],
            nonfinite=code,
            acc=fig["acc"],
            tau_tf=tau_sum / blocks if tau_sum is not None else float("nan"),
            blocks=blocks,
            lr=lr,
            acc_per_slot=slots if slots is not None else (),
            selector=fig["selector"] if fig["selector"] is not None else (),
            ready=ready,
        )


class _GradSum:
    """The fp32 gradient sum of one update: one flat buffer, a view per master, which masters got a gradient."""

    def __init__(self, masters: t.Sequence[torch.Tensor]) -> None:
        sizes = [m.numel() for m in masters]
        self.flat = torch.zeros(sum(sizes), dtype=torch.float32, device=masters[0].device)
        self.views = [v.view_as(m) for v, m in zip(self.flat.split(sizes), masters)]
        self.seen: set[int] = set()


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


__all__ = [
    "DrafterReplica",
    "FeatureBatch",
    "LRSchedule",
    "LaunchFence",
    "ReplicaConfig",
    "TargetReplica",
    "empty_host_cache",
    "held_bytes",
    "pinned_block",
    "pinned_host_bytes",
]
