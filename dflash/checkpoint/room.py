"""Room on disk for checkpoints: before a checkpoint is written (``CheckpointWriter``), is there room for it?
When not, what ``keep`` lets go after it is pruned first; when still not, the writer skips it (one line, a
``checkpoint-skipped`` record) rather than die half-way through the write. And the facts dflashctl reads
of the checkpoints (``write_facts``: ``<run dir>/checkpointing.json``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import threading
import typing as t
from pathlib import Path

import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.best import BEST_LOCK, best_of
from dflash.checkpoint.manifest import step_of

logger = logging.getLogger("dflash.room")  # the name train.log has always shown

# What a checkpoint writes beside its tensors' bytes: config.json, dflash.py, the manifest, the
# safetensors header and the trainer state's pickle framing (each well under this).
SPACE_SLACK = 1 << 20


def snapshot_bytes(snap: ckpt.Snapshot) -> int:
    """The bytes writing ``snap`` puts on disk, near enough: its tensors' bytes plus ``SPACE_SLACK``."""
    total = 0

    def walk(value: t.Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(snap.weights)
    walk(snap.trainer_state)
    walk(snap.optimizer_state)
    return total + SPACE_SLACK


@dataclasses.dataclass(frozen=True)
class Room:
    """What ``make_room`` found: ``free`` bytes where checkpoints go, ``need`` for the next one, what it pruned."""

    free: int
    need: int
    pruned: tuple[Path, ...] = ()

    @property
    def fits(self) -> bool:
        return self.free >= self.need


def prunable(root: Path, run_id: str | None, *, keep: int | None, protect: t.Collection[int] = ()) -> list[Path]:
    """The run's checkpoints that the prune after its next checkpoint would remove anyway, oldest first:
    all but its ``keep - 1`` newest (the new one makes ``keep``), less ``best`` and the ``protect``ed steps.
    None/0 ``keep`` (keep all): none."""
    if not keep:
        return []
    kept = {step_of(b)} if (b := best_of(root)) is not None else set()
    kept |= set(protect)
    mine = [p for p in ckpt.list_complete(root) if ckpt.run_of(p) == run_id]
    return [p for p in mine[: max(0, len(mine) + 1 - keep)] if step_of(p) not in kept]


def make_room(
    root: str | os.PathLike[str],
    snap: ckpt.Snapshot,
    *,
    keep: int | None,
    protect: t.Callable[[], t.Collection[int]] | None = None,
) -> Room:
    """Before a checkpoint is written: is there room for it (``shutil.disk_usage``)? When not, the run's
    checkpoints that ``keep`` lets go after this one are pruned first, oldest first, one by one until it
    fits (``prunable``: never ``best``, an eval's step, another run's). ``Room.fits`` says the result."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    need = snapshot_bytes(snap)
    free = shutil.disk_usage(root).free
    pruned: list[Path] = []
    if free >= need:
        return Room(free, need)
    with BEST_LOCK:
        for old_path in prunable(root, snap.run_id, keep=keep, protect=protect() if protect is not None else ()):
            doomed = root / f".old-step-{step_of(old_path)}-{os.getpid()}"
            old_path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            pruned.append(old_path)
            logger.info("checkpoint %s pruned early: the next one needs its room", old_path)
            free = shutil.disk_usage(root).free
            if free >= need:
                break
    return Room(free, need, tuple(pruned))


FACTS_FILE = "checkpointing.json"  # in the run dir: what dflashctl's agent reads of this run's checkpoints


def write_facts(run_dir: Path, facts: t.Mapping[str, t.Any]) -> None:
    """``<run dir>/checkpointing.json``: where the run checkpoints, its ``keep``, its low-disk threshold, the
    last skipped checkpoint and the last sync (docs/design.md section 9). Atomic; a failure is a warning."""
    tmp = run_dir / f".{FACTS_FILE}.{os.getpid()}.{threading.get_ident()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(dict(facts), sort_keys=True) + "\n")
        os.replace(tmp, run_dir / FACTS_FILE)
    except OSError as e:  # a full disk: status then reads the older file
        logger.warning("cannot write %s: %s", run_dir / FACTS_FILE, e.strerror)
        tmp.unlink(missing_ok=True)


__all__ = ["FACTS_FILE", "Room", "make_room", "prunable", "snapshot_bytes", "write_facts"]
