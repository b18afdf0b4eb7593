"""Faults the run goes on through, told once per episode: a low disk (no room for the next checkpoint) and
a failing checkpoint sync (``Status.disk``, ``Status.sync``: ops/disk.py). Pure: the loop notifies what
``observe`` returns and keeps ``memory()`` with the policy's, so a restarted supervisor does not tell an
episode again; a probe that sees the disk recovered (the sync succeeding) ends the episode, and one that
sees nothing (an outage, an older agent) leaves it as it was."""

from __future__ import annotations

import dataclasses
import typing as t

from ops.probe import Status, iso

LOW_DISK = "low-disk"
SYNC_FAILED = "sync-failed"


@dataclasses.dataclass(frozen=True)
class Change:
    flag: str  # LOW_DISK or SYNC_FAILED
    began: bool  # True: a new episode (notify); False: it ended
    text: str


def _flags(st: Status) -> dict[str, str | None]:
    """flag -> its phrase while it holds, None when the probe saw it does not; absent: not seen."""
    out: dict[str, str | None] = {}
    if st.disk is not None:
        out[LOW_DISK] = st.disk.phrase()
    if st.sync is not None and st.sync.state != "none":
        out[SYNC_FAILED] = st.sync.phrase()
    return out


class Episodes:
    def __init__(self) -> None:
        self.open: dict[str, str] = {}  # flag -> when its episode began (ISO time)

    def observe(self, st: Status, now: float) -> list[Change]:
        changes = []
        for flag, text in _flags(st).items():
            if text is not None and flag not in self.open:
                self.open[flag] = iso(now) or ""
                changes.append(Change(flag, True, text))
            elif text is None and flag in self.open:
                since = self.open.pop(flag)
                over = "room again for the next checkpoint" if flag == LOW_DISK else "the sync succeeded again"
                changes.append(Change(flag, False, f"{flag} over (since {since}): {over}"))
        return changes

    def memory(self) -> dict[str, t.Any]:
        return {"episodes": dict(self.open)}

    def load(self, mem: t.Mapping[str, t.Any]) -> None:
        raw = mem.get("episodes")
        if isinstance(raw, dict):
            self.open = {k: v for k, v in raw.items() if k in (LOW_DISK, SYNC_FAILED) and isinstance(v, str)}
