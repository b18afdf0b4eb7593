"""Room on disk for checkpoints: before a checkpoint is written (``CheckpointWriter``), is there room for it?
When not, and only when pruning what ``keep`` lets go after it would make it fit, that is pruned first (never
the run's newest checkpoint: the one a new checkpoint that is not yet written would replace); otherwise
nothing goes and the writer skips it (one line, a ``checkpoint-skipped`` record) rather than die half-way
through the write. A write that the disk stops half-way (``after_failure``) is skipped the same way. A run
whose LAST checkpoint was skipped ends with ``DiskFull`` (exit 4), never as a success. And the facts
dflashctl reads of the checkpoints (``write_facts``: ``<run dir>/checkpointing.json``)."""

from __future__ import annotations

import dataclasses
import errno
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
from dflash.errors import EXIT_DISK_FULL, DflashError

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
    freeable: int = 0  # what pruning could have freed when it was not enough (nothing was pruned then)
    failed: str | None = None  # a write the disk stopped half-way: the error's last words

    @property
    def fits(self) -> bool:
        return self.free >= self.need and self.failed is None


class DiskFull(DflashError):
    """The run's last checkpoint could not be written for want of disk space: the steps since the one before
    it are lost, so the run failed (exit 4, one line that names the disk and the checkpoint that stays)."""

    exit_code = EXIT_DISK_FULL
    traceback = False


def tree_bytes(path: Path) -> int:
    """The bytes a checkpoint folder takes on disk (its files' allocated blocks): what removing it frees."""
    total = 0
    for f in path.rglob("*"):
        try:
            st = f.lstat()
        except OSError:
            continue
        total += st.st_blocks * 512 if f.is_file() else 0
    return total


def prunable(root: Path, run_id: str | None, *, keep: int | None, protect: t.Collection[int] = ()) -> list[Path]:
    """The run's checkpoints that the prune after its next checkpoint would remove anyway, oldest first:
    all but its ``keep - 1`` newest (the new one makes ``keep``), less ``best`` and the ``protect``ed steps,
    and never the newest (with ``keep = 1``, the only one: it goes after the new one is written, not before).
    None/0 ``keep`` (keep all): none."""
    if not keep:
        return []
    kept = {step_of(b)} if (b := best_of(root)) is not None else set()
    kept |= set(protect)
    mine = [p for p in ckpt.list_complete(root) if ckpt.run_of(p) == run_id]
    return [p for p in mine[: max(0, min(len(mine) - 1, len(mine) + 1 - keep))] if step_of(p) not in kept]


def make_room(
    root: str | os.PathLike[str],
    snap: ckpt.Snapshot,
    *,
    keep: int | None,
    protect: t.Callable[[], t.Collection[int]] | None = None,
) -> Room:
    """Before a checkpoint is written: is there room for it (``shutil.disk_usage``)? When not, and when what
    the run's checkpoints that ``keep`` lets go after this one take would make it fit, they are pruned first,
    oldest first, one by one until it fits (``prunable``: never ``best``, an eval's step, another run's, nor
    the run's newest). When they would not, nothing is pruned. ``Room.fits`` says the result."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    need = snapshot_bytes(snap)
    free = shutil.disk_usage(root).free
    pruned: list[Path] = []
    if free >= need:
        return Room(free, need)
    with BEST_LOCK:
        doomed_paths = prunable(root, snap.run_id, keep=keep, protect=protect() if protect is not None else ())
        freeable = sum(tree_bytes(p) for p in doomed_paths)
        if free + freeable < need:  # pruning would lose them and still not make room: keep them
            return Room(free, need, freeable=freeable)
        for old_path in doomed_paths:
            doomed = root / f".old-step-{step_of(old_path)}-{os.getpid()}"
            old_path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            pruned.append(old_path)
            logger.info("checkpoint %s pruned early: the next one needs its room", old_path)
            free = shutil.disk_usage(root).free
            if free >= need:
                break
    return Room(free, need, tuple(pruned))


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
# what the writers say of a full disk when they do not raise an OSError: safetensors ("os error 28"), torch.save
_NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122", "file write failed")


def after_failure(root: str | os.PathLike[str], snap: ckpt.Snapshot, error: BaseException) -> Room | None:
    """A write of ``snap`` that failed (its temporary folder already removed): a ``Room`` that does not fit
    when the disk was the cause (ENOSPC or a quota, in the error's chain or its words, or less free now than
    the checkpoint needs), so the writer skips it like one with no room; None for any other failure."""
    need = snapshot_bytes(snap)
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    seen: BaseException | None = error
    full = free < need
    while seen is not None and not full:
        full = (isinstance(seen, OSError) and seen.errno in _NO_SPACE) or any(w in str(seen) for w in _NO_SPACE_TEXT)
        seen = seen.__cause__ or seen.__context__
    return (
        Room(free, need, failed=str(error).splitlines()[-1][:200] if str(error) else type(error).__name__)
        if full
        else None
    )


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


__all__ = [
    "FACTS_FILE",
    "DiskFull",
    "Room",
    "after_failure",
    "make_room",
    "prunable",
    "snapshot_bytes",
    "tree_bytes",
    "write_facts",
]
