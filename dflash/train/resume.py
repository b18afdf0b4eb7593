"""The resume policy: which checkpoint a run continues, under which run id, and how its state comes back.

``checkpoint.resume``:

- ``"auto"``: the newest run's latest intact checkpoint (``checkpoint.resume_order``); a corrupted one is
  skipped with a warning, and when every one is corrupted the run refuses to start (fail closed: never a
  quiet fresh start on top of a run whose checkpoints all went bad); none: a fresh start;
- ``"never"``: the checkpoints already there are moved into ``old-<run id>-<time>/`` (nothing deleted) and
  a new run starts;
- a checkpoint directory: that checkpoint.

The run id (``lineage``): a resumed run continues the checkpoint's run, unless that run already went further
(a fork: continuing it under the same id would prune or overwrite its later checkpoints) or has no id;
then, as for a fresh start, a new one. A node of a group looks in its own checkpoint dir and the newest
checkpoint of any node is sent to all (``group_resume``). ``restore`` puts a checkpoint into the replicas:
weights, fp32 masters, optimizer state (AdamW's moments, Muon's momentum), anchor generators, RNG states and
the data position.
"""

from __future__ import annotations

import logging
import typing as t
from pathlib import Path

import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.manifest import CheckpointError
from dflash.config import ConfigError
from dflash.data.samples import DataPosition
from dflash.model.drafter import DFLASH2_KEYS, DFlashDraftConfig
from dflash.train.distributed import NodeGroup
from dflash.train.optimizer import kind_of
from dflash.train.replicas import DrafterReplica

# The run's log lines keep the name they had in train.py: README and dflashctl show "dflash.train: resuming from".
logger = logging.getLogger("dflash.train")


def find_resume(mode: str, ckpt_dir: Path) -> tuple[ckpt.Checkpoint | None, str]:
    """The checkpoint to continue (loaded and verified) for ``checkpoint.resume = mode``, and this run's id."""
    if mode == "never":
        moved = ckpt.move_aside(ckpt_dir)
        if moved:
            logger.warning(
                'checkpoint.resume = "never": the checkpoints already in %s were moved aside to %s '
                "(nothing deleted); starting from step 0",
                ckpt_dir,
                ", ".join(p.name for p in moved),
            )
        return None, ckpt.new_run_id()
    if mode == "auto":
        tried = []
        for path in ckpt.resume_order(ckpt_dir):
            try:
                c = ckpt.load_checkpoint(path, map_location="cpu")
            except CheckpointError as e:
                logger.warning(
                    "resume: skipping %s: %s; trying the previous complete checkpoint",
                    path,
                    str(e).removeprefix(f"{path}: "),
                )
                tried.append(path.name)
                continue
            return c, lineage(c, ckpt_dir)
        if tried:  # fail closed: never quietly start over on top of a run whose checkpoints all went bad
            raise ConfigError(
                "checkpoint.resume",
                f"no checkpoint in {ckpt_dir} is intact ({', '.join(tried)}); "
                'move them away, or set checkpoint.resume = "never" to start over',
            )
        return None, ckpt.new_run_id()
    path = Path(mode).expanduser()
    if not path.is_dir():
        raise ConfigError(
            "checkpoint.resume", f'expected "auto", "never" or a checkpoint directory; {path} does not exist'
        )
    try:
        c = ckpt.load_checkpoint(path, map_location="cpu")
    except CheckpointError as e:
        raise ConfigError("checkpoint.resume", str(e)) from e
    return c, lineage(c, ckpt_dir)


def group_resume(group: NodeGroup, mode: str, ckpt_dir: Path) -> tuple[ckpt.Checkpoint | None, str]:
    """Every node looks in its own checkpoint dir; the newest checkpoint of any node (newest run, then
    step) is sent to all. torchrun's c10d rendezvous may hand rank 0 to another box after a restart, and
    with no shared filesystem the checkpoints are on whichever box was rank 0 when they were written."""
    group.doing = "resume"
    mine: ckpt.Checkpoint | None = None
    run_id: str | None = None
    problem: str | None = None
    try:
        mine, run_id = find_resume(mode, ckpt_dir)
    except ConfigError as e:  # said to every node below, so none waits for a collective that never comes
        problem = str(e)
    key = (run_id or "", mine.step) if mine is not None else None
    found = group.all_gather((key, problem))
    have = [(k, rank) for rank, (k, _) in enumerate(found) if k is not None]
    if not have:
        problems = [p for _, p in found if p]
        if problems:
            raise ConfigError("checkpoint.resume", f"on every node: {problems[0]}")
        return None, t.cast(str, group.broadcast(run_id))  # a fresh start: rank 0's run id for all
    src = max(have)[1]
    if src != group.rank:
        logger.info(
            "resume: node %d holds the newest checkpoint (step %d); it is sent to this node", src, max(have)[0][1]
        )
    run_id, resume = group.broadcast((run_id, mine) if group.rank == src else None, src=src)
    return t.cast("ckpt.Checkpoint | None", resume), t.cast(str, run_id)


def lineage(c: ckpt.Checkpoint, ckpt_dir: Path) -> str:
    """Continue the checkpoint's run, unless that run already went further (a fork: continuing it
    under the same id would prune or overwrite its later checkpoints) or has no id (written before ids)."""
    if c.run_id is None:
        run_id = ckpt.new_run_id()
        logger.info("resume: %s has no run id (an older checkpoint); this run is %s", c.path, run_id)
        return run_id
    later = [p.name for p in ckpt.list_complete(ckpt_dir) if ckpt.run_of(p) == c.run_id and _step_number(p) > c.step]
    if later:
        run_id = ckpt.new_run_id()
        logger.warning(
            "resume: run %s already has later checkpoints (%s) than %s; continuing as run %s, which leaves them alone",
            c.run_id,
            ", ".join(later),
            c.path,
            run_id,
        )
        return run_id
    return c.run_id


def _step_number(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def restore(
    c: ckpt.Checkpoint,
    drafters: t.Sequence[DrafterReplica],
    draft_config: DFlashDraftConfig,
    *,
    drafter_offset: int,
    data_fingerprint: str,
    run_id: str | None,
) -> DataPosition | None:
    """Load ``c`` into the replicas (refused when it was trained for another model); the saved data position.

    ``drafter_offset``: this node's first drafter among every node's (a group's checkpoint holds each one's
    anchor generator, in rank order); ``data_fingerprint``: the data and batching of this run (a change is
    warned about, and the saved batch indices are kept)."""
    path = c.path
    mine, theirs = draft_config, c.config
    for key, name in (
        ("num_hidden_layers", "drafter.layers"),
        ("block_size", "drafter.block_size"),
        ("hidden_size", "target"),
        ("vocab_size", "target"),
        ("kind", "drafter.kind"),
        *(((k, f"drafter.{k}") for k in DFLASH2_KEYS) if mine.kind == theirs.kind == "dflash2" else ()),
    ):
        if _value(mine, key) != _value(theirs, key):
            raise ConfigError(
                name,
                f"the checkpoint {path} has {key}={_value(theirs, key)}, this run {_value(mine, key)}; "
                'resume it with the same model, or set checkpoint.resume = "never"',
            )
    if mine.target_layer_ids != theirs.target_layer_ids or mine.mask_token_id != theirs.mask_token_id:
        raise ConfigError("drafter", f"the checkpoint {path} was trained on other target layers or another MASK id")
    for r in drafters:
        r.model.load_state_dict(c.state_dict, strict=True)
    state = c.trainer_state or {}
    opt = c.optimizer_state or {}
    saved_opts = opt.get("replicas") or []
    if saved_opts and drafters and kind_of(saved_opts[0]) != drafters[0].optimizer.name:
        raise ConfigError(
            "optim.name",
            f"the checkpoint {path} was trained with {kind_of(saved_opts[0])}, this run {drafters[0].optimizer.name}; "
            'resume it with the same optimizer, or set checkpoint.resume = "never"',
        )
    masters = opt.get("masters")
    for j, r in enumerate(drafters):
        if r.separate_masters:
            with torch.no_grad():
                if masters is not None:
                    for m, saved in zip(r.masters, masters):
                        m.copy_(saved)
                else:
                    for m, p in zip(r.masters, r.params):
                        m.copy_(p)
        if saved_opts:
            r.optimizer.load_state_dict(saved_opts[j % len(saved_opts)])
        gens = state.get("generators") or []
        if drafter_offset + j < len(gens):  # every node's, in rank order (a group's checkpoint)
            r.generator.set_state(gens[drafter_offset + j])
    if "rng" in state:
        ckpt.restore_rng_state(state["rng"])
    position = None
    if "data" in state:
        position = DataPosition.from_dict(state["data"])
        if position.fingerprint and position.fingerprint != data_fingerprint:
            logger.warning(
                "resume: the data or its batching changed since %s; continuing at the saved batch indices", path
            )
    logger.info("resuming from %s at step %d (run %s)", path, c.step, run_id)
    return position


def saved_sequences_per_update(c: ckpt.Checkpoint) -> int | None:
    """The sequences per update the checkpoint's run trained with (its config holds the resolved figure).

    A run that resumes without ``optim.sequences_per_update`` set keeps it rather than deriving it again from
    its drafters: with fewer drafters (a GPU excluded) the default ``ceil(32 / drafters)`` would grow, and
    ``max_steps`` from ``epochs``, the lr schedule and the batches a global step consumes would move under the
    step count the checkpoint holds. None: an older checkpoint without it."""
    optim = ((c.trainer_state or {}).get("config") or {}).get("optim") or {}
    spu = optim.get("sequences_per_update")
    return spu if isinstance(spu, int) and not isinstance(spu, bool) and spu > 0 else None


def _value(config: DFlashDraftConfig, key: str) -> t.Any:
    return config.dflash2_value(key) if key in DFLASH2_KEYS else getattr(config, key)


__all__ = ["find_resume", "group_resume", "lineage", "restore", "saved_sequences_per_update"]
