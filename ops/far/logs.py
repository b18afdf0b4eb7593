"""A run's log and metrics.jsonl, read from their end: O(1) in the file's size. stdlib only."""

from __future__ import annotations

import os
import typing as t

from ops.far import records, tmux
from ops.far.protocol import LogFacts, MetricsFacts

EVENT_LINES = 200  # metrics.jsonl lines read for the trainer's loss-spike records (one per step at most)
MAX_EVENTS = 8
TAIL_WINDOW = 1 << 20  # `tail` and `status` read at most this many bytes from the log's end


def tail_bytes(path: str, max_lines: int, window: int = TAIL_WINDOW) -> tuple[bytes, int, float]:
    """The last ``max_lines`` lines of a file, its size and mtime, reading at most ``window`` bytes
    from its end in ONE read: O(1) in the log's size, whatever it holds (66 MB of tqdm ``\\r`` rows
    with no newline cost the same as 66 bytes)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        pos = max(0, size - window)
        f.seek(pos)
        data = f.read(size - pos)
    if pos > 0:
        # the window starts inside a row: drop up to its first break. A `\r` counts: what follows it
        # in the same row are later progress segments, and a row shows its last one.
        breaks = [i for i in (data.find(b"\n"), data.find(b"\r")) if i >= 0]
        if breaks:
            data = data[min(breaks) + 1 :]
    lines = data.split(b"\n")
    trailing = lines[-1] == b""
    if trailing:
        lines.pop()
    lines = lines[-max_lines:] if max_lines > 0 else []
    out = b"\n".join(lines) + (b"\n" if trailing and lines else b"")
    return out, size, st.st_mtime


def log_facts(path: str, lines: int) -> LogFacts | None:
    try:
        data, size, mtime = tail_bytes(path, lines)
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"path": path, "error": str(e)}
    return {"path": path, "size": size, "mtime": mtime, "tail": tmux.decode_lines(data)}


def metrics_facts(path: str) -> MetricsFacts | None:
    """The last complete step record of metrics.jsonl (event records skipped), the loss-spike records of
    its last ``EVENT_LINES`` lines (the trainer's own, for the supervisor's warnings) and the file's mtime."""
    try:
        data, size, mtime = tail_bytes(path, EVENT_LINES)  # event records may come after the last step record
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"path": path, "error": str(e)}
    last = None
    events: list[dict[str, t.Any]] = []
    for line in reversed(data.decode("utf-8", "replace").splitlines()):
        try:
            rec = records.parse_line(line)
        except ValueError:
            continue  # a line being written right now (or one no record of ours is: skipped)
        if isinstance(rec, dict) and rec.get("event") == "loss-spike" and len(events) < MAX_EVENTS:
            events.insert(0, rec)
        if (
            last is None and isinstance(rec, dict) and "event" not in rec
        ):  # an event (a loss spike, a skipped checkpoint, a sync): no step's figures
            last = rec
    return {"path": path, "size": size, "mtime": mtime, "last": last, "events": events}
