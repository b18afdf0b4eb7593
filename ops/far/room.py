"""What the agent reads of a run's checkpoints for `dflashctl status`: the sizes in each ``step-<n>/
checkpoint.json`` manifest, the ``best`` link, free space where they go, and the trainer's own
``<attempt dir>/checkpointing.json`` (its checkpoint dir, ``keep``, low-disk threshold, the last skipped
checkpoint and the last sync: ``dflash.checkpoint.checkpoints.write_facts``). Stdlib only, Python 3.8 syntax.

Never raises: a folder that cannot be read is an ``error`` in the facts, not a failed probe."""

from __future__ import annotations

import os
import typing as t

from ops.far import records
from ops.far.checkpoints import BEST, MANIFEST, STEP_DIR  # the layout pull reads: named once
from ops.far.runner import disk_free

FACTS_FILE = "checkpointing.json"  # dflash.checkpoint.checkpoints.FACTS_FILE
MAX_LISTED = 10000  # entries of the checkpoints folder looked at
MAX_CHECKPOINTS = 200  # the newest steps reported
MANIFEST_LIMIT = 64 << 10


def _int(value: t.Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def manifest_size(folder: str) -> tuple[int | None, str | None]:
    """(bytes of a complete checkpoint: its files and manifest, its run id) from its manifest; (None, None)
    when it has none yet (half-written) or one that does not say."""
    path = os.path.join(folder, MANIFEST)
    rec, _ = records.read_json(path, MANIFEST_LIMIT)
    files = rec.get("files") if rec is not None else None
    if not isinstance(files, dict):
        return None, None
    sizes = [_int(v) for v in files.values()]
    if not sizes or any(s is None for s in sizes):
        return None, None
    try:
        own = os.stat(path).st_size
    except OSError:
        return None, None
    run_id = rec.get("run_id") if rec is not None else None
    return sum(t.cast("list[int]", sizes)) + own, run_id if isinstance(run_id, str) else None


def checkpoint_facts(attempt_dir: str | None, default_dir: str) -> dict[str, t.Any]:
    """The checkpoints' facts (``ops.far.protocol.CheckpointFacts``). ``default_dir``: where dflash puts
    them without ``checkpoint.dir`` (next to the attempts) when the trainer wrote no facts file."""
    facts: dict[str, t.Any] = {
        "dir": default_dir,
        "record": None,
        "free": None,
        "checkpoints": [],
        "truncated": False,
        "best_step": None,
        "error": None,
    }
    if attempt_dir is not None:
        rec, problem = records.read_json(os.path.join(attempt_dir, FACTS_FILE))
        if problem is not None:
            facts["error"] = problem
        elif rec is not None:
            facts["record"] = rec
            if isinstance(rec.get("dir"), str) and os.path.isabs(rec["dir"]):
                facts["dir"] = rec["dir"]
    root = facts["dir"]
    probe_at = root
    while not os.path.isdir(probe_at) and os.path.dirname(probe_at) != probe_at:
        probe_at = os.path.dirname(probe_at)
    facts["free"] = disk_free(probe_at)
    try:
        with os.scandir(root) as it:
            names = []
            for n, entry in enumerate(it):
                if n >= MAX_LISTED:
                    facts["truncated"] = True
                    break
                m = STEP_DIR.fullmatch(entry.name)
                if m and entry.is_dir(follow_symlinks=False):
                    names.append((int(m.group(1)), entry.name))
    except FileNotFoundError:
        return facts
    except OSError as e:
        facts["error"] = f"{root}: {e.strerror or e}"
        return facts
    names.sort()
    if len(names) > MAX_CHECKPOINTS:
        names, facts["truncated"] = names[-MAX_CHECKPOINTS:], True
    found = []
    for step, name in names:
        size, run_id = manifest_size(os.path.join(root, name))
        if size is not None:
            found.append({"step": step, "bytes": size, "run_id": run_id})
    facts["checkpoints"] = found
    try:
        target = os.readlink(os.path.join(root, BEST))
        m = STEP_DIR.fullmatch(target)
        facts["best_step"] = int(m.group(1)) if m else None
    except OSError:
        pass
    return facts
