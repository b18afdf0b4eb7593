"""Room for the next checkpoint, and the checkpoints' copy off the box: `dflashctl status`'s `low disk`
and `sync failed` flags (docs/design.md section 6), from the agent's checkpoint facts
(``ops/far/room.py``). Pure: no I/O.

The rule, the trainer's own (``dflash.checkpoint.room.make_room``): before a checkpoint is written, the run's
checkpoints that ``keep`` lets go after it may be pruned first (all of the run's but its ``keep - 1``
newest, never ``best``). So the next checkpoint needs ``next_needs_bytes`` = its size (the run's last
checkpoint's) less what that pruning frees, and the disk is low when fewer bytes than that are free, or
fewer than ``warn_bytes`` (``[checkpoint] disk_warn_gb``; by default one checkpoint's size: the next
checkpoint fits only by pruning early).
"""

from __future__ import annotations

import dataclasses
import typing as t


@dataclasses.dataclass(slots=True)
class DiskView:
    """Status JSON key ``disk``."""

    path: str | None  # the checkpoints folder
    free_bytes: int | None  # free on its filesystem (the run_dir's, by default)
    checkpoint_bytes: int | None  # the run's last checkpoint's size (None: none yet)
    next_needs_bytes: int | None  # what must be free for the next one, after the pruning it may do first
    warn_bytes: int | None  # the threshold: checkpoint.disk_warn_gb, else checkpoint_bytes
    keep: int | None  # checkpoint.keep (None: the run did not say: an older trainer)
    low: bool
    skipped_step: int | None = None  # the last checkpoint the trainer skipped for want of room

    def phrase(self) -> str | None:
        """``low disk: 0.9 GiB free at /x/checkpoints, the next checkpoint needs 1.1 GiB`` (None: not low)."""
        if not self.low:
            return None
        text = f"low disk: {size(self.free_bytes)} free at {self.path}"
        if (
            self.next_needs_bytes is not None
            and self.free_bytes is not None
            and self.free_bytes < self.next_needs_bytes
        ):
            text += f", the next checkpoint needs {size(self.next_needs_bytes)}"
        elif self.warn_bytes is not None:
            text += f", under the {size(self.warn_bytes)} of checkpoint.disk_warn_gb (default: one checkpoint)"
        if self.skipped_step is not None:
            text += f"; checkpoint step {self.skipped_step} was skipped"
        return text


@dataclasses.dataclass(slots=True)
class SyncView:
    """Status JSON key ``sync``: the last run of ``[checkpoint] sync`` (None in Status: no sync configured)."""

    command: str | None  # its program's name (never its arguments)
    state: str  # "none" (none ended yet), "ok", "failed"
    step: int | None = None  # the checkpoint the last one copied
    at: str | None = None
    error: str | None = None
    failures: int = 0  # failed in a row

    def phrase(self) -> str | None:
        if self.state != "failed":
            return None
        return f"sync failed ({self.failures} in a row, step {self.step}): {self.error}"


def size(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _int(v: t.Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def next_needs(
    checkpoints: t.Sequence[t.Mapping[str, t.Any]], run_id: str | None, keep: int | None, best_step: int | None
) -> tuple[int | None, int | None]:
    """(the run's last checkpoint's bytes, the bytes its next one needs free): see the module text.
    ``checkpoints``: [{step, bytes, run_id}], any order."""
    mine = sorted((c for c in checkpoints if c.get("run_id") == run_id), key=lambda c: c["step"])
    if not mine:
        return None, None
    last = int(mine[-1]["bytes"])
    freed = 0
    if keep:
        freed = sum(int(c["bytes"]) for c in mine[: max(0, len(mine) + 1 - keep)] if c["step"] != best_step)
    return last, max(0, last - freed)


def disk_view(facts: t.Any) -> DiskView | None:
    """The ``disk`` view of the agent's checkpoint facts (None: an agent that sends none)."""
    if not isinstance(facts, dict):
        return None
    raw = facts.get("record")
    rec: dict[str, t.Any] = raw if isinstance(raw, dict) else {}
    found = [
        c
        for c in facts.get("checkpoints") or []
        if isinstance(c, dict) and _int(c.get("step")) is not None and _int(c.get("bytes")) is not None
    ]
    run_id = rec.get("run_id") if isinstance(rec.get("run_id"), str) else None
    if run_id is None and found:  # no record: the newest run's (run ids sort by start time)
        run_id = max((str(c["run_id"]) for c in found if isinstance(c.get("run_id"), str)), default=None)
    keep = _int(rec.get("keep"))
    last, needs = next_needs(found, run_id, keep, _int(facts.get("best_step")))
    warn = _int(rec.get("disk_warn_bytes"))
    if warn is None:
        warn = last
    free = _int(facts.get("free"))
    low = free is not None and ((needs is not None and free < needs) or (warn is not None and free < warn))
    raw_skip = rec.get("skipped")
    skipped: dict[str, t.Any] = raw_skip if isinstance(raw_skip, dict) else {}
    return DiskView(
        path=facts.get("dir") if isinstance(facts.get("dir"), str) else None,
        free_bytes=free,
        checkpoint_bytes=last,
        next_needs_bytes=needs,
        warn_bytes=warn,
        keep=keep,
        low=low,
        skipped_step=_int(skipped.get("step")),
    )


def sync_view(facts: t.Any) -> SyncView | None:
    """The ``sync`` view (None: no sync configured, or no facts)."""
    rec = facts.get("record") if isinstance(facts, dict) else None
    sync = rec.get("sync") if isinstance(rec, dict) else None
    if not isinstance(sync, dict):
        return None
    raw = sync.get("last")
    last: dict[str, t.Any] | None = raw if isinstance(raw, dict) else None
    command = sync.get("command") if isinstance(sync.get("command"), str) else None
    if last is None:
        return SyncView(command, "none")
    ok = last.get("ok") is True
    return SyncView(
        command=command,
        state="ok" if ok else "failed",
        step=_int(last.get("step")),
        at=last.get("at") if isinstance(last.get("at"), str) else None,
        error=None if ok else str(last.get("error"))[:300],
        failures=_int(sync.get("failures")) or (0 if ok else 1),
    )


def checkpoint_context(facts: t.Any) -> tuple[DiskView | None, SyncView | None, list[str]]:
    """Room for the next checkpoint, the last sync, and the evidence lines they call for (an agent older
    than them sends no ``checkpoints``)."""
    disk, sync, said = disk_view(facts), sync_view(facts), []
    if disk is not None and disk.low:
        said.append(f"{disk.phrase()} ({disk.keep} kept by checkpoint.keep, best beyond them)")
    if sync is not None and sync.state == "failed":
        said.append(f"{sync.phrase()} (at {sync.at}): the next checkpoint syncs again")
    if isinstance(facts, dict) and facts.get("error"):
        said.append(f"checkpoints: {facts['error']}")
    return disk, sync, said
