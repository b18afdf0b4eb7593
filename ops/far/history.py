"""What an attempt's log says about where it started: the checkpoint it resumed from. stdlib only.

The training core prints it once, early, when ``checkpoint.resume`` finds a checkpoint
(dflash/train/run.py, ``Run._restore``; the log format of dflash/__main__.py)::

    2026-11-29T21:02:40 INFO dflash.train: resuming from /workspace/runs/dflash/checkpoints/step-1200 at step 1200 (run 20261129-ab12)

torchrun's per-rank prefix (``[default0]:``) may stand before it. Read from the log's first ``HEAD`` bytes
only: O(1) in the log's size, and the line comes before the first step.
"""

from __future__ import annotations

import re
import typing as t

HEAD = 1 << 20
RESUMED = re.compile(
    rb"resuming from (?P<path>\S+) at step (?P<step>\d+)(?: \(run (?P<run>[^)\s]+)\))?",
)


def resumed_from(log_path: str, head: int = HEAD) -> dict[str, t.Any] | None:
    """``{"path", "step", "run"}`` of the checkpoint the attempt resumed from, None when its log says
    it started fresh (or there is no log)."""
    try:
        with open(log_path, "rb") as f:
            data = f.read(head)
    except OSError:
        return None
    m = RESUMED.search(data)
    if m is None:
        return None
    run = m.group("run")
    return {
        "path": m.group("path").decode("utf-8", "replace"),
        "step": int(m.group("step")),
        "run": run.decode("utf-8", "replace") if run else None,
    }
