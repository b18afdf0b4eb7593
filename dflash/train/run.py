"""Building and running one training run from a ``RunConfig``: the thing ``dflash train`` does.

    python -m dflash train --config configs/tiny-cpu.toml --set max_steps=200

What it builds: one frozen target replica per target device (``devices.targets``; a repeated "cpu" gets
its own replica, since a target's feature hooks belong to one thread), one drafter replica per drafter
device with its own optimizer over fp32 master weights (the model itself in ``drafter.dtype``; in fp32 the
masters are the parameters), the target's frozen embedding + lm_head on every drafter device, the data
shards, and the pipeline (``dflash.train.pipeline``) that runs them. The parts live by role: the target, MASK id
and drafter config in ``dflash.models`` (eval builds step 0 with them too), the replicas and the lr schedule
in ``dflash.train.replicas``, the compile warm-up in ``dflash.train.compile``, the resume policy in ``dflash.train.resume``,
the node group and its barrier in ``dflash.train.distributed``; this module holds ``Run`` and ``run_training``.

Updates: one global step is one optimizer update of one drafter replica over ``optim.sequences_per_update``
sequences (gradient accumulation over ``ceil(sequences_per_update / data.batch_size)`` queue items, the
weighted loss normalised by ONE weight sum over all of them; default ``ceil(32 / drafters)``, the published
Qwen3-8B recipe's 32 sequences per update; a resumed run keeps its checkpoint's, so a run that lost a drafter
(``DFLASH_EXCLUDED_GPUS``: ``dflash.train.devices``) keeps its updates, lr schedule and data position). ``max_steps`` unset: ``epochs`` x batches per epoch / batches
per update. Both are printed at start.

Learning rate: linear warmup over ``optim.warmup_ratio * max_steps`` global steps, then cosine (or
linear) decay to ``min_lr_ratio * lr`` at ``max_steps``; every drafter reads it at the global step it
trains. Gradients are clipped to ``optim.grad_clip`` (global norm, per replica, on the fp32 masters).

OOM retry: a drafter step that runs out of memory is retried once "with the batch halved": a batch of
several sequences is split into two micro-batches whose gradients add up; a single sequence is retried
with half the anchors.

Checkpoints (``dflash.checkpoint.checkpoints``): every ``checkpoint.interval`` global steps at the drafters' barrier,
at the end, and on SIGTERM/SIGINT. The replicas are averaged first, so one drafter is saved; the trainer
state holds the run id, the global step, the data position, the RNG states and (``checkpoint.optimizer``)
one replica's optimizer state plus the fp32 masters. The barrier waits only for a CPU snapshot; a background
thread writes it (one write at a time; the run waits for the last one before it exits, and a failed
write fails the run). ``checkpoint.resume = "auto"`` continues the newest run from its latest intact
checkpoint (a corrupted one is skipped with a warning): same step count, same next batch of every shard.
``"never"`` moves the checkpoints already there into ``old-<run id>-<time>/`` and starts a new run.

Divergence (``dflash.train.divergence``, ``[train]``): every update's loss and gradient norm are checked on its
device; a non-finite update is skipped there (``dflash.train.optimizer``) and read with the step line's
figures, or at the next checkpoint barrier if that comes first: ``on_nonfinite = "stop"`` ends the run with
one line (the step, the figure, the last finite checkpoint) and exit 3, writing no checkpoint; ``"skip"``
goes on and stops after ``nonfinite_limit`` in a row. Averaged weights and a checkpoint's weights are
checked too (a barrier's one read per device). A loss spike is a warning and a ``loss-spike`` record.

Signals: the first SIGTERM (or SIGINT) lets the steps in flight finish, writes a checkpoint and exits
143 (130 for SIGINT); a second one exits at once.

Several nodes (``torchrun --nnodes N --nproc-per-node 1 ... -m dflash train``; ``dflash.train.distributed``): every
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

Fault injection (``DFLASH_FAULT``, for the supervisor's tests; see ``dflash.train.faults.faults_from_env``):
``raise-at-step:N``, ``oom-at-step:N``, ``drafter-oom-at-step:N:I``, ``hang-at-step:N``, and
``kill-in-checkpoint:N`` (SIGKILL in the middle of writing the first checkpoint at step >= N), ``nan-at-step:N``
(that update's loss and gradients NaN: see Divergence). Each fires
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

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint import room
from dflash.checkpoint.sync import LOG_FILE as SYNC_LOG
from dflash.checkpoint.sync import CheckpointSync, SyncResult
from dflash.config import ConfigError, RunConfig, check_devices, parse_template, to_dict
from dflash.data.batching import BatchPlan
from dflash.data.samples import DataPosition, JsonlDataset, Shard, shard_starts
from dflash.dtypes import torch_dtype
from dflash.errors import EXIT_OK
from dflash.model import draft_vocab
from dflash.model.kernels import missing_kernels_warning
from dflash.model.target import TargetHead
from dflash.models import DrafterSpec, drafter_spec, initial_drafter, load_target
from dflash.train.averaging import Averager
from dflash.train.compile import WarmUp, prepare_drafter, shapes_for, warm_up_replicas
from dflash.train.devices import exclude
from dflash.train.distributed import GroupBarrier, NodeGroup
from dflash.train.divergence import AVERAGED, FIGURES, WEIGHTS, Diverged, LossSpike, NonfiniteGuard, all_finite
from dflash.train.faults import FAULT_ENV, FaultInjector, SigkillWhenPickled, faults_from_env
from dflash.train.feature_queue import MIN_DEFAULT_BYTES, default_max_bytes, format_bytes, short_bound_warning
from dflash.train.metrics import (
    TENSORBOARD_HINT,
    WANDB_HINT,
    Metrics,
    WandbRun,
    tensorboard_available,
    utc_now,
    wandb_available,
)
from dflash.train.pipeline import Pipeline, PipelineOptions, RunResult, StepStats, SyncEvent
from dflash.train.plan import UPDATE_SEQUENCES
from dflash.train.replicas import DrafterReplica, LRSchedule, ReplicaConfig, TargetReplica
from dflash.train.resume import find_resume, group_resume, restore, saved_sequences_per_update
from dflash.train.validation import EvalResult, Validator

logger = logging.getLogger("dflash.train")  # the name train.log has always shown

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
        # the last checkpoint on disk or being written (a skipped one hands back the one before it): the
        # diverged line's "last finite checkpoint"
        self.last_kept: int | None = None
        self._kept_before: int | None = None
        self.run_id: str | None = None  # chosen by dflash.train.resume: kept across resumes, new for a fresh start
        # pruning leaves the steps an eval still measures (checkpoints/best may become one of them)
        self.writer = ckpt.CheckpointWriter(
            self.ckpt_dir,
            keep=cfg.checkpoint.keep,
            protect=self._evaluating,
            room_for=lambda snap: room.make_room(
                self.ckpt_dir, snap, keep=cfg.checkpoint.keep, protect=self._evaluating
            ),
            on_skip=self._skipped,
            on_written=self._written,
            room_after=lambda snap, error: room.after_failure(self.ckpt_dir, snap, error),
        )
        self._skip: dict[str, t.Any] | None = None  # the last checkpoint skipped for want of room (DiskFull's words)
        # [checkpoint] sync: a copy off the box after each checkpoint and each switch of best (dflash.checkpoint.sync)
        self.sync = (
            CheckpointSync(
                parse_template(cfg.checkpoint.sync),
                self.ckpt_dir,
                timeout=cfg.checkpoint.sync_timeout,
                log_path=self.run_dir / SYNC_LOG,
                on_end=self._synced,
            )
            if cfg.checkpoint.sync is not None
            else None
        )
        # <run dir>/checkpointing.json: what dflashctl status reads of the checkpoints (room.write_facts)
        self._facts_lock = threading.Lock()
        warn = cfg.checkpoint.disk_warn_gb
        self._facts: dict[str, t.Any] = {
            "dir": str(self.ckpt_dir),
            "run_id": None,  # set at start (dflash.train.resume chooses it)
            "keep": cfg.checkpoint.keep,
            "disk_warn_bytes": None if warn is None else int(warn * 1e9),
            "skipped": None,
            "sync": None if self.sync is None else {"command": self.sync.name, "last": None, "failures": 0},
        }
        self.validator: Validator | None = None  # [eval] every: held-out tau at the barrier (dflash.train.validation)
        self.pipeline: Pipeline | None = None
        self.metrics: Metrics | None = None
        self.signals: _Signals | None = None
        # the (rows, seq, blocks) batches train() warms up; None: every class a batch of this config can fall in
        self.warm_up_shapes: list[tuple[int, int, int]] | None = None
        self.warmed: WarmUp | None = None  # what train()'s warm-up compiled
        # A node of a torchrun group (None: a plain run). Every node runs this same code; the collectives
        # happen at the same points on each (start-up, and every barrier: see on_sync).
        try:
            self.group = NodeGroup.from_env(self.env, timeout=cfg.distributed.timeout)
        except ValueError as e:
            raise ConfigError("distributed", str(e)) from None
        self.barrier = GroupBarrier(self.group) if self.group is not None else None
        spec = self.env.get(FAULT_ENV, "").strip()
        try:
            self.injector = faults_from_env(spec, self.ckpt_dir) if spec else FaultInjector()
        except ValueError as e:
            raise ConfigError(f"${FAULT_ENV}", str(e).removeprefix(f"{FAULT_ENV}: ")) from None
        if cfg.metrics.tensorboard and not tensorboard_available():  # before the models load, not mid-run
            raise ConfigError("metrics.tensorboard", TENSORBOARD_HINT)
        if cfg.metrics.wandb is not None and not wandb_available():
            raise ConfigError("metrics.wandb", WANDB_HINT)
        self._build()

    # building ---------------------------------------------------------------------------

    def _build(self) -> None:
        cfg = self.cfg = exclude(self.cfg, self.env)  # DFLASH_EXCLUDED_GPUS: before anything loads
        check_devices(cfg)
        torch.manual_seed(cfg.seed)
        resume = self._meet_nodes()
        self.targets = self._build_targets()
        spec = self._build_data()
        cfg = self._derive_steps(self.cfg)
        assert cfg.max_steps is not None  # _derive_steps sets it
        self.queue_bytes = self._queue_bytes(cfg)
        for replica in self.targets:
            # unused cached pinned blocks past what the queue may hold go (the in-use ones never count)
            replica.pinned_limit = self.queue_bytes
        self.schedule = LRSchedule(
            lr=cfg.optim.lr,
            total_steps=cfg.max_steps,
            warmup_ratio=cfg.optim.warmup_ratio,
            schedule=cfg.optim.schedule,
            min_lr_ratio=cfg.optim.min_lr_ratio,
        )
        self.drafters = self._build_drafters()
        if cfg.eval.every and (self.group is None or self.group.is_main):  # rank 0 writes the checkpoints
            # built before training: a bad eval.* value (prompts, device) stops the run now, not at step N
            self.validator = Validator(
                cfg,
                draft_config=self.draft_config,
                tokenizer=spec.tokenizer,
                ckpt_dir=self.ckpt_dir,
                run_id=self.run_id,
                written=self.writer.ended,
                on_result=self._on_eval,
                target_bytes=max((r.model.nbytes() for r in self.targets), default=0),
            )
        if resume is not None:
            self.position = restore(
                resume,
                self.drafters,
                self.draft_config,
                drafter_offset=self.drafter_offset,
                data_fingerprint=self._data_fingerprint(),
                run_id=self.run_id,
            )
            self.start_step = self.last_saved = self.last_kept = resume.step
        self.averager = Averager.for_replicas(
            [r.trainable() for r in self.drafters],
            cross_reduce=self.group.cross_reduce if self.group is not None else None,
        )
        self._build_sources(cfg)

    def _meet_nodes(self) -> ckpt.Checkpoint | None:
        """Every node's (targets, drafters), the intervals a group needs, and the checkpoint to resume from."""
        cfg = self.cfg
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
            resume, self.run_id = find_resume(cfg.checkpoint.resume, self.ckpt_dir)
        else:
            resume, self.run_id = group_resume(self.group, cfg.checkpoint.resume, self.ckpt_dir)
        self.saved_spu = saved_sequences_per_update(resume) if resume is not None else None  # an update keeps its size
        return resume

    def _build_data(self) -> DrafterSpec:
        """The MASK id and drafter config (as eval builds them), the dataset and its batch plan."""
        cfg = self.cfg
        t0 = self.targets[0].model
        slow = missing_kernels_warning(t0.model.config)  # a hybrid target without its kernels: say so at start
        if slow is not None:
            logger.warning("%s", slow)
        self.vocab_size = t0.vocab_size
        spec = drafter_spec(cfg, t0)  # the MASK id and drafter config: dflash.models, as eval builds them
        self.init_drafter = spec.init
        self.mask_token_id = mask_id = spec.mask_token_id
        self.draft_config = spec.config
        self.dataset = JsonlDataset(
            cfg.data.path,
            format=cfg.data.format,
            tokenizer=spec.tokenizer,
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
        return spec

    def _build_sources(self, cfg: RunConfig) -> None:
        """Shard = (node, local target): this node's slice of the shards of every node, batch g in shard g mod all."""
        self.all_shards = sum(n[0] for n in self.nodes)
        starts = shard_starts(self.all_shards, self.position)[
            self.target_offset : self.target_offset + len(self.targets)
        ]
        self.shard_starts = starts
        # pinned batches where a GPU copies them (asynchronous copies: no hidden stream sync)
        pin = torch.cuda.is_available() and any(
            torch.device(d).type == "cuda" for d in (*cfg.devices.targets, *cfg.devices.drafters)
        )
        self.sources = [Shard(self.dataset, self.plan, start=s, stride=self.all_shards, pin=pin) for s in starts]

    def _derive_steps(self, cfg: RunConfig) -> RunConfig:
        """Sequences per update -> batches per update; ``epochs`` -> max_steps. Printed; the config keeps them."""
        drafters = sum(n[1] for n in self.nodes)  # every node's: sequences_per_update's default is global
        spu = cfg.optim.sequences_per_update or self.saved_spu or math.ceil(UPDATE_SEQUENCES / drafters)
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

    def _queue_bytes(self, cfg: RunConfig) -> int:
        """``queue.max_bytes``, derived from this node's workers and the largest batch when unset (said at
        start); a set bound below what the drafters accumulate is a warning."""
        tokens = cfg.data.max_batch_tokens or cfg.data.batch_size * cfg.data.max_length
        item = max(r.item_bytes(tokens) for r in self.targets)
        drafters, targets = len(cfg.devices.drafters), len(self.targets)
        if cfg.queue.max_bytes is not None:
            warning = short_bound_warning(
                cfg.queue.max_bytes, drafters=drafters, accumulate=self.accumulate, item_bytes=item
            )
            if warning is not None:
                logger.warning("%s", warning)
            return cfg.queue.max_bytes
        n = default_max_bytes(drafters=drafters, targets=targets, accumulate=self.accumulate, item_bytes=item)
        logger.info(
            "queue.max_bytes: %s (derived: (%d drafters x (%d + 1) + %d targets) x %s per batch of %d tokens, "
            "at least %s)",
            format_bytes(n),
            drafters,
            self.accumulate,
            targets,
            format_bytes(item),
            tokens,
            format_bytes(MIN_DEFAULT_BYTES),
        )
        return n

    def _build_targets(self) -> list[TargetReplica]:
        cfg = self.cfg
        devices = list(cfg.devices.targets)
        drafter_devices = list(cfg.devices.drafters)
        out = []
        for i, dev in enumerate(devices):
            try:
                model = load_target(cfg, dev)
            except OSError as e:  # target.path (a tiny target is built, not read)
                raise ConfigError("target.path", f"cannot load a model from {cfg.target.path}: {e}") from e
            if cfg.queue.mode == "per-drafter":
                dest = drafter_devices[i % len(drafter_devices)]
            elif len(set(drafter_devices)) == 1:
                dest = drafter_devices[0]
            else:
                dest = "cpu"  # any drafter may take it: pinned host memory, each drafter copies it over
            out.append(TargetReplica(model, dev, dest))
        return out

    def _build_drafters(self) -> list[DrafterReplica]:
        cfg = self.cfg
        dtype = torch_dtype(cfg.drafter.dtype)
        base = initial_drafter(self.draft_config, seed=cfg.seed, init=self.init_drafter)
        if self.init_drafter is None:  # an own draft vocabulary: counted over the data (a warm start brings its own)
            draft_vocab.fill(base, self.dataset, self.targets[0].model.lm_head.weight)
        ckpt.check_servable(base, self.draft_config, vocab_size=self.vocab_size)
        replica_cfg = ReplicaConfig.of(cfg)
        heads: dict[str, TargetHead] = {}
        out = []
        for j, dev in enumerate(cfg.devices.drafters):
            model = copy.deepcopy(base).to(device=dev, dtype=dtype)
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
                    cfg=replica_cfg,
                    schedule=self.schedule,
                    seed=cfg.seed * 1000 + self.drafter_offset + j,
                    index=j,
                )
            )
        for r in out:  # DFLASH_FAULT nan-at-step: the replica's own update turns NaN, on the real path
            r.poison = lambda step, j=r.index: self.injector.check("update", j, step) is not None
        return out

    def _last_finite(self) -> str:
        """The last checkpoint written (or being written: a stop waits for it) from finite weights, for the
        diverged line: no checkpoint is ever written from a non-finite update, so it is the latest."""
        if self.last_kept is None:
            return "none"
        return f"{self.ckpt_dir / f'step-{self.last_kept}'} (step {self.last_kept})"

    def _check_finite(self, step: int, tensors: t.Iterable[torch.Tensor], figure: str) -> None:
        """Averaged or checkpointed weights with a NaN/inf end the run (at a barrier: one read per device)."""
        if not all_finite(tensors):
            raise Diverged(step, figure, self._last_finite())

    def _check_pending(self, step: int) -> None:
        """Before a checkpoint: with on_nonfinite "stop", an update not yet read by the step line that was not
        finite ends the run now, before anything is written (the step line would have stopped it later)."""
        if self.metrics is None or self.cfg.train.on_nonfinite != "stop":
            return
        bad = self.metrics.nonfinite_pending()
        if bad is not None:
            raise Diverged(bad[0], FIGURES.get(int(bad[1]), "loss"), self._last_finite())

    def _data_fingerprint(self) -> str:
        """The data and its batching: a resumed run whose data changed is told so."""
        return f"{self.dataset.fingerprint()}:{self.plan.fingerprint()}"

    # running ----------------------------------------------------------------------------

    def save(self, step: int, position: t.Sequence[int], replicas: t.Sequence[int]) -> Path | None:
        """Snapshot one replica to CPU (the drafters wait only for this) and hand it to the background writer.

        After averaging every replica holds the same weights, so one is saved; so is ONE replica's optimizer
        state (the first at the barrier): the others' differ only by the batches they saw, and saving
        them all multiplied the barrier's copies and the bytes on disk by the number of drafters.
        ``resume.restore`` gives each replica its own moments when a checkpoint has several (older ones do).
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
        if self.validator is not None:
            self.validator.released()  # the eval in flight has copied the last snapshot: it may be reused
        reps = [self.drafters[j] for j in replicas]
        first = reps[0]
        trainer_state: dict[str, t.Any] = {
            "step": step,
            "run_id": self.run_id,
            "data": DataPosition(tuple(position), self._data_fingerprint()).to_dict(),
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
        self._check_pending(step)
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
        if ckpt.nonfinite_weights(snap.weights) is not None:  # never a checkpoint (nor a best) from them
            raise Diverged(step, WEIGHTS, self._last_finite())
        self._kept_before, self.last_kept = self.last_kept, step  # before the writer's thread may skip it
        self.writer.submit(snap)
        self.last_saved = step
        self._last_snapshot: ckpt.Snapshot | None = snap
        return self.ckpt_dir / f"step-{step}"

    def _evaluate(self, ev: SyncEvent, step: int) -> None:
        """Hand the checkpoint just snapshotted to the eval (it runs in the background: the barrier ends now)."""
        snap = getattr(self, "_last_snapshot", None)
        if self.validator is None or not ev.evaluate or snap is None or snap.step != step:
            return
        if step == getattr(self, "_evaluated", None):  # the final sync at the step an eval barrier just took
            return
        self._evaluated = step
        self.validator.submit(step, snap.weights)

    def _evaluating(self) -> t.Collection[int]:
        return self.validator.pending() if self.validator is not None else ()

    def _on_eval(self, result: EvalResult) -> None:
        """From the eval's thread: the tau into metrics.jsonl, the log and the trackers."""
        if self.metrics is not None:  # evals start in the pipeline, after the metrics are made
            self.metrics.record_eval(result.record())
        if result.is_best and self.sync is not None:
            self.sync.request(result.step, "best")

    # ---- the checkpoints' facts for dflashctl: a skipped checkpoint, the sync -------------------

    def _event(self, rec: dict[str, t.Any]) -> None:
        if self.metrics is not None:
            self.metrics.record_event(rec)

    def _write_facts(self, **changes: t.Any) -> None:
        if self.group is not None and not self.group.is_main:
            return  # rank 0 writes the checkpoints: its run dir says how they go
        with self._facts_lock:
            self._facts.update(changes)
            room.write_facts(self.run_dir, self._facts)

    def _skipped(self, step: int, found: room.Room) -> None:
        """From the writer's thread: a checkpoint skipped for want of disk space (``CheckpointWriter._skip``)."""
        if self.last_kept == step:  # the diverged line names the one before it
            self.last_kept = self._kept_before
        rec = {
            "event": "checkpoint-skipped",
            "step": step,
            "need_bytes": found.need,
            "free_bytes": found.free,
            "pruned": [p.name for p in found.pruned],
            "dir": str(self.ckpt_dir),
        }
        self._skip = {**rec, "failed": found.failed}
        self._event(rec)
        self._write_facts(skipped={k: v for k, v in rec.items() if k != "event"} | {"at": utc_now()})

    def _written(self, path: Path) -> None:
        if self.sync is not None:
            self.sync.request(int(path.name.removeprefix("step-")), "checkpoint")

    def _synced(self, result: SyncResult) -> None:
        """From the sync's thread: its end in the log, metrics.jsonl and checkpointing.json."""
        if result.ok:
            logger.info("sync of step %d (%s) done in %.1f s", result.step, result.why, result.seconds)
        else:
            logger.warning(
                "sync of step %d (%s) failed: %s; the next checkpoint syncs again (output in %s)",
                result.step,
                result.why,
                result.error,
                self.run_dir / SYNC_LOG,
            )
        self._event(result.record())
        with self._facts_lock:
            before = dict(self._facts["sync"] or {})
        failures = 0 if result.ok else int(before.get("failures") or 0) + 1
        last = {k: v for k, v in result.record().items() if k != "event"} | {"ok": result.ok, "at": utc_now()}
        self._write_facts(sync={**before, "last": last, "failures": failures})

    def _end_sync(self, *, failing: bool = False) -> None:
        """Wait for the sync in flight (the final checkpoint's), bounded by ``sync_timeout`` (60 s at most
        while an error is on its way out); what still runs then is killed."""
        if self.sync is None:
            return
        wait = self.cfg.checkpoint.sync_timeout if not failing else min(60.0, self.cfg.checkpoint.sync_timeout)
        if self.sync.busy:
            logger.info("waiting for the checkpoint sync (%s, %.0f s at most)", self.sync.name, wait)
        self.sync.close(wait)

    def on_sync(self, ev: SyncEvent) -> None:
        if self.group is not None:
            self._group_sync(ev, self.group)
            return
        if ev.average and len(ev.replicas) > 1:
            reps = [self.drafters[j] for j in ev.replicas]
            self.averager.average([r.trainable() for r in reps])
            self._check_finite(ev.step, reps[0].trainable(), AVERAGED)
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
            self._evaluate(ev, ev.step)
        else:
            self.writer.check()  # a failed background write ends the run at the next barrier

    def _group_sync(self, ev: SyncEvent, group: NodeGroup) -> None:
        """A barrier of a node of a group (``distributed.GroupBarrier``): the headers, the averaging over every
        node's replicas (also before a checkpoint: rank 0 saves its replica for all), the checkpoint, the stop."""
        assert self.barrier is not None
        stop = self.signals.received if self.signals is not None and self.signals.received is not None else 0
        rnd = self.barrier.meet(ev, stop=stop)
        step = rnd.headers[0].step  # with several drafters per node the steps in flight differ a little: rank 0's
        if ev.average or ev.checkpoint:
            group.doing = "averaging"
            reps = [self.drafters[j] for j in ev.replicas]
            self.averager.average([r.trainable() for r in reps])
            self._check_finite(step, reps[0].trainable(), AVERAGED)
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
            self._evaluate(ev, step)
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
            self.barrier.stopping(rnd, step)
            self.pipeline.request_stop()  # from a drafter thread: the drafters leave after this barrier

    def _on_step(self, step: int, stats: StepStats, tokens: int) -> None:
        if self.barrier is not None:
            self.barrier.count(tokens)
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
        compiled = self._warm_up()
        self.pipeline = self._make_pipeline(cfg)
        self.metrics = self._make_metrics(cfg, self.pipeline)
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
        self._write_facts(run_id=self.run_id)
        if self.barrier is not None:
            self.barrier.restart()
        result = self._run_pipeline(self.pipeline, self.metrics, compiled=compiled)
        return self._finish(result, signals)

    def _warm_up(self) -> bool:
        """Compiled code (the layers, or flex attention alone on CUDA) is built here, serially, for every
        shape a batch can have; torch.compile is not thread-safe, and in a thread it would stall the others.
        True: the drafters run compiled code (a recompile from then on is an error)."""
        compiled = self.cfg.compile or any(torch.device(r.device).type == "cuda" for r in self.drafters)
        if not compiled:
            return False
        started = time.monotonic()
        shapes = self.warm_up_shapes if self.warm_up_shapes is not None else shapes_for(self.drafters[0])
        devices = len({r.device for r in self.drafters})
        logger.info(
            "compiling the drafter before step 1: %d batch shapes x %d drafter device(s), forward and "
            "backward, one after the other (on GPUs expect minutes: 10-15 cold for 36 on a 5 + 3 box, about "
            "half with a warm inductor cache)",
            len(shapes),
            devices,
        )
        # one recompile limit for every replica, from their distinct devices, set before the first warm-up
        self.warmed = warm_up_replicas(
            self.drafters,
            feature_size=self.targets[0].model.feature_size,
            vocab_size=self.vocab_size,
            mask_token_id=self.mask_token_id,
            shapes=shapes,
        )
        logger.info(
            "compiled the drafter for %d batch shapes in %.0f s (%s; recompile limit %d); a recompile from "
            "now on is an error",
            len(self.warmed.shapes),
            time.monotonic() - started,
            ", ".join(f"{k}: {n} cache entries" for k, n in self.warmed.entries.items()) or "no cache entries",
            self.warmed.limit,
        )
        return True

    def _make_pipeline(self, cfg: RunConfig) -> Pipeline:
        assert cfg.max_steps is not None
        return Pipeline(
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
                max_bytes=self.queue_bytes,
                average_every=cfg.average_every if len(self.drafters) > 1 or self.group is not None else 0,
                checkpoint_every=cfg.checkpoint.interval,
                evaluate_every=cfg.eval.every,
                barrier_timeout=cfg.barrier_timeout,
                oom_retry=cfg.optim.oom_retry,
                accumulate=self.accumulate,
                # a node of a group: each local update is one step of every node (all count the same steps)
                step_stride=len(self.nodes),
                shard_stride=self.all_shards,
            ),
        )

    def _make_metrics(self, cfg: RunConfig, pipeline: Pipeline) -> Metrics:
        wb = cfg.metrics.wandb
        main = self.group is None or self.group.is_main  # one W&B run per attempt, not one per node
        return Metrics(
            wandb=WandbRun(
                project=wb.project,
                mode=wb.mode,
                entity=wb.entity,
                run_dir=self.run_dir,
                group=self.run_id,  # the attempts of one training run, together
                name=f"{self.run_id}/{self.run_dir.name}",
                config=to_dict(cfg),
            )
            if wb is not None and main
            else None,
            log_every=cfg.log_every,
            path=self.run_dir / "metrics.jsonl",
            stream=self.stream,
            snapshot=pipeline.snapshot,
            tensorboard_dir=self.run_dir if cfg.metrics.tensorboard else None,
            step_stride=len(self.nodes),
            guard=NonfiniteGuard(cfg.train.on_nonfinite, cfg.train.nonfinite_limit, self._last_finite),
            spike=LossSpike(factor=cfg.train.spike_factor, steps=cfg.train.spike_steps, window=cfg.train.spike_window)
            if cfg.train.spike_factor
            else None,
        )

    def _run_pipeline(self, pipeline: Pipeline, metrics: Metrics, *, compiled: bool) -> RunResult:
        """The pipeline's run; then the last eval, and on a failure the writes and the sync wound up."""
        try:
            if compiled:  # a miss would be unfused attention (out of memory) or a compile in a thread: fail
                torch.compiler.set_stance("fail_on_recompile")
            result = pipeline.run()
        except BaseException:
            if self.validator is not None:
                self.validator.close(wait=False)
            self._finish_writes(failing=True)
            self._end_sync(failing=True)
            raise
        else:
            if self.validator is not None:  # the last checkpoint's eval ends in metrics.jsonl (not after a stop)
                self._finish_writes()
                self.validator.close(wait=result.reason != "stopped")
                if self.cfg.checkpoint.keep:  # what pruning left for an eval in flight goes now
                    ckpt.prune(self.ckpt_dir, self.run_id, keep=self.cfg.checkpoint.keep, protect=self._evaluating)
        finally:
            metrics.close()
            if compiled:
                torch.compiler.set_stance("default")
        return result

    def _check_final_written(self) -> None:
        """The run's last checkpoint skipped for want of room is a failure, never a success: DiskFull (exit 4)."""
        skip = self._skip
        if self.last_saved is None or self.writer.skipped != self.last_saved or skip is None:
            return
        why = "No space left on device" + (f"; the write stopped: {skip['failed']}" if skip["failed"] else "")
        kept = f"step-{self.last_kept}" if self.last_kept is not None else "none"
        raise room.DiskFull(
            f"disk full: the run's last checkpoint (step {self.last_saved}) was not written: it needs "
            f"{skip['need_bytes'] / 2**20:.1f} MiB and {self.ckpt_dir} has {skip['free_bytes'] / 2**20:.1f} MiB free "
            f"({why}); the last checkpoint on disk is {kept}"
        )

    def _finish(self, result: RunResult, signals: _Signals | None) -> int:
        """The final checkpoint on disk and synced, then the exit code: 0, or 128 + the signal that stopped us."""
        self._finish_writes()  # the final checkpoint is on disk before we say so or exit
        self._end_sync()
        self._check_final_written()
        for f in result.failures:
            logger.warning("during the run: %s", f.summary())
        group_stop = self.barrier.stop if self.barrier is not None else 0  # another node's signal: we stopped with it
        received = signals.received if signals is not None and signals.received is not None else group_stop
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


__all__ = ["Run", "run_training", "weights_digest"]
