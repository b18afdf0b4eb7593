"""Room for the next checkpoint, and the checkpoints' copy off the box: `dflashctl status`'s `low disk`
and `sync failed` flags (docs/design.md section 6), from the agent's checkpoint facts
(``ops/far/checkpoints.py``, read by ``ops.wire.parse_checkpoints``). Pure: no I/O.

The rule, the trainer's own (``dflash.checkpoint.room.make_room``): before a checkpoint is written, the run's
checkpoints that ``keep`` lets go after it may be pruned first (all of the run's but its ``keep - 1``
newest, never ``best``, never the newest: it goes once the next one is written), and only when that makes the
next one fit. So the next checkpoint needs ``next_needs_bytes`` = its size (the run's last
checkpoint's) less what that pruning frees, and the disk is low when fewer bytes than that are free, or
fewer than ``warn_bytes`` (``[checkpoint] disk_warn_gb``; by default one checkpoint's size: the next
checkpoint fits only by pruning early).
"""

from __future__ import annotations

import dataclasses
import typing as t

from ops import wire


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


def next_needs(
    checkpoints: t.Sequence[wire.CheckpointEntry], run_id: str | None, keep: int | None, best_step: int | None
) -> tuple[int | None, int | None]:
    """(the run's last checkpoint's bytes, the bytes its next one needs free): see the module text."""
    mine = sorted((c for c in checkpoints if c.run_id == run_id), key=lambda c: c.step)
    if not mine:
        return None, None
    last = mine[-1].bytes
    freed = 0
    if keep:
        # the newest is never pruned for one not yet written (dflash.checkpoint.room): it goes once the next is
        freed = sum(c.bytes for c in mine[: max(0, min(len(mine) - 1, len(mine) + 1 - keep))] if c.step != best_step)
    return last, max(0, last - freed)


def disk_view(facts: wire.CheckpointFacts | None) -> DiskView | None:
    """The ``disk`` view of the agent's checkpoint facts (None: an agent that sends none)."""
    if facts is None:
        return None
    rec = facts.record
    found = facts.checkpoints
    run_id = rec.run_id if rec is not None else None
    if run_id is None and found:  # no record: the newest run's (run ids sort by start time)
        run_id = max((c.run_id for c in found if c.run_id is not None), default=None)
    keep = rec.keep if rec is not None else None
    last, needs = next_needs(found, run_id, keep, facts.best_step)
    warn = rec.disk_warn_bytes if rec is not None else None
    if warn is None:
        warn = last
    free = facts.free
    low = free is not None and ((needs is not None and free < needs) or (warn is not None and free < warn))
    return DiskView(
        path=facts.dir,
        free_bytes=free,
        checkpoint_bytes=last,
        next_needs_bytes=needs,
        warn_bytes=warn,
        keep=keep,
        low=low,
        skipped_step=rec.skipped_step if rec is not None else None,
    )


def sync_view(facts: wire.CheckpointFacts | None) -> SyncView | None:
    """The ``sync`` view (None: no sync configured, or no facts)."""
    sync = facts.record.sync if facts is not None and facts.record is not None else None
    if sync is None:
        return None
    last = sync.last
    if last is None:
        return SyncView(sync.command, "none")
    return SyncView(
        command=sync.command,
        state="ok" if last.ok else "failed",
        step=last.step,
        at=last.at,
        error=None if last.ok else str(last.error)[:300],
        failures=sync.failures or (0 if last.ok else 1),
    )


def checkpoint_context(facts: wire.CheckpointFacts | None) -> tuple[DiskView | None, SyncView | None, list[str]]:
    """Room for the next checkpoint, the last sync, and the evidence lines they call for (an agent older
    than them sends no ``checkpoints``)."""
    disk, sync, said = disk_view(facts), sync_view(facts), []
    if disk is not None and disk.low:
        said.append(f"{disk.phrase()} ({disk.keep} kept by checkpoint.keep, best beyond them)")
    if sync is not None and sync.state == "failed":
        said.append(f"{sync.phrase()} (at {sync.at}): the next checkpoint syncs again")
    if facts is not None and facts.error:
        said.append(f"checkpoints: {facts.error}")
    return disk, sync, said
