"""The best checkpoint (``[eval] every``, ``dflash.train.validation``): ``<root>/best`` is a symlink ``best -> step-<n>``
to the checkpoint with the highest held-out tau, and ``<root>/best.json`` says its step, tau, run id and how
the tau was measured. ``set_best`` writes best.json and then switches the link by renaming a new one over
it, so ``best`` always names a complete checkpoint; pruning (``dflash.checkpoint.checkpoints.prune``,
``dflash.checkpoint.room.make_room``) never removes the checkpoint ``best`` points to, under ``BEST_LOCK``, and
``dflash.checkpoint.checkpoints.move_aside`` takes both along with their run (``move_best``)."""

from __future__ import annotations

import json
import logging
import os
import threading
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.checkpoint.manifest import STEP_DIR, CheckpointError, manifest_problem, step_of
from dflash.outputs import fsync_dir, fsync_file

__all__ = ["BEST_FILE", "BEST_LINK", "BEST_LOCK", "best_of", "move_best", "read_best", "set_best"]

# The run's log lines keep the name they had in checkpoint.py (train.log shows "dflash.checkpoint: ...").
logger = logging.getLogger("dflash.checkpoint")

BEST_LINK = "best"  # <root>/best -> step-<n>: the highest held-out tau (set_best)
BEST_FILE = "best.json"  # its step, tau, run id and eval protocol
# Switching ``best`` and pruning happen in different threads (an eval's, the writer's): never at once, so
# that a prune never removes the checkpoint that best is being switched to.
BEST_LOCK = threading.Lock()


def best_of(root: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint ``<root>/best`` points to (sizes checked, not sums), or None."""
    link = Path(root) / BEST_LINK
    if not link.is_symlink():
        return None
    try:
        name = os.readlink(link)
    except OSError:
        return None
    target = Path(root) / name
    if "/" in name or not STEP_DIR.match(name) or not target.is_dir() or manifest_problem(target) is not None:
        return None
    return target


def read_best(root: str | os.PathLike[str]) -> dict[str, t.Any] | None:
    """best.json when ``best`` points to the checkpoint it names (None: no best, or the two disagree).

    best.json is read bounded and field by field (``inputs.read_record``): a record whose step is no step,
    whose tau is no finite figure (NaN would be a best no eval beats: every comparison with it is false) or
    whose protocol key is no string is no best, with a warning naming the file and the key: the next eval
    sets one."""
    path = Path(root) / BEST_FILE
    target = best_of(root)
    if not path.exists() and not path.is_symlink():
        return None
    try:
        rec = inputs.read_record(path, BEST_FILE)
        step = rec.integer("step", lo=0)
        rec.number("tau", lo=0)
        rec.text("protocol_key", default=None)
        rec.text("run_id", default=None)
    except (inputs.InputFileError, inputs.RecordError) as exc:
        logger.warning("%s; taken as no best (the next eval sets one)", exc)
        return None
    if target is None or step != step_of(target):
        return None
    return dict(rec.data)


def set_best(root: str | os.PathLike[str], record: t.Mapping[str, t.Any]) -> Path:
    """Make ``<root>/best`` point to ``step-<record["step"]>`` and ``best.json`` hold ``record``.

    best.json is written first (temp file, fsync, rename), then a new link is renamed over ``best``: a
    reader sees the old best or the new one, never a missing or half-written one. ``CheckpointError`` when
    the checkpoint is not there (complete)."""
    root = Path(root)
    step = int(record["step"])
    name = f"step-{step}"
    with BEST_LOCK:
        if manifest_problem(root / name) is not None if (root / name).is_dir() else True:
            raise CheckpointError(f"{root / name}: not a complete checkpoint, so it cannot be the best")
        tmp = root / f".{BEST_FILE}.{os.getpid()}"
        tmp.write_text(json.dumps(dict(record), indent=2, sort_keys=True) + "\n")
        fsync_file(tmp)
        os.replace(tmp, root / BEST_FILE)
        link = root / f".{BEST_LINK}.{os.getpid()}"
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(name, link)  # relative: the folder may be moved or copied whole
        os.replace(link, root / BEST_LINK)
        fsync_dir(root)
    return root / BEST_LINK


def move_best(root: Path, aside: Path) -> None:
    for name in (BEST_LINK, BEST_FILE):
        src = root / name
        if src.is_symlink() or src.exists():
            src.rename(aside / name)
