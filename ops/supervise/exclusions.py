"""The GPUs a session's run leaves out (``restart-on-crash --on-gpu-fault exclude``): a GPU that failed in
hardware, and any other the gpu-health check failed, by PCI bus id. The supervisor starts each attempt with
``DFLASH_EXCLUDED_GPUS=<the set>`` (dflash/train/devices.py drops those devices); ``dflashctl gpus --include
BUS`` puts one back after a reset.

The set is a file beside the supervisor's memory (``<state>/supervise/<host>.<session>.gpus.json``, 0600):
it outlives the supervisor, and ``dflashctl gpus`` edits it while a supervisor runs (an flock on
``.gpus.lock`` around each read-modify-write; the supervisor reads it afresh at each probe).
Stdlib only: the supervisor on the Proxmox host loads it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import typing as t
from pathlib import Path

from ops.diagnosis import bus_id
from ops.far.atomic import write_json_atomic
from ops.state_dir import private_dir

EXCLUDED_ENV = "DFLASH_EXCLUDED_GPUS"  # what dflash train reads (dflash/train/devices.py)
MAX_EXCLUDED = 64  # more bus ids than any box has GPUs: a file with more is not ours
FILE_MAX = 1 << 20


def matches(given: str, stored: str) -> bool:
    """``b3:00`` (no domain) names ``0000:b3:00.0`` as the trainer reads it: bus and device decide, the domain
    only when given."""
    mine, full = bus_id(given), bus_id(stored)
    if mine is None or full is None:
        return False
    if given.strip().count(":") == 2:  # the domain given
        return mine == full
    return mine.split(":", 1)[1] == full.split(":", 1)[1]


@dataclasses.dataclass(frozen=True)
class Excluded:
    """One GPU left out: its bus id, the Xid that put it there (None: the health check's verdict), the
    attempt whose crash did, why in words, and when."""

    bus_id: str
    why: str
    xid: int | None = None
    attempt: int | None = None
    at: str | None = None

    def phrase(self) -> str:
        """``GPU 0000:b3:00.0 (Xid 79)``"""
        return f"GPU {self.bus_id} ({f'Xid {self.xid}' if self.xid is not None else self.why})"

    def to_json(self) -> dict[str, t.Any]:
        return dataclasses.asdict(self)


def _item(value: t.Any) -> Excluded | None:
    if not isinstance(value, dict):
        return None
    bus = bus_id(value.get("bus_id")) if isinstance(value.get("bus_id"), str) else None
    why = value.get("why")
    if bus is None or not isinstance(why, str):
        return None
    xid, attempt, at = value.get("xid"), value.get("attempt"), value.get("at")
    return Excluded(
        bus,
        why[:300],
        xid if isinstance(xid, int) and not isinstance(xid, bool) else None,
        attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else None,
        at if isinstance(at, str) else None,
    )


def env_value(items: t.Iterable[Excluded]) -> str:
    """``DFLASH_EXCLUDED_GPUS``'s value: the bus ids, comma-separated."""
    return ",".join(e.bus_id for e in items)


class Exclusions:
    """The session's excluded set, on disk. ``load`` never raises (a damaged file is said in ``problem``
    and read as empty); ``add``/``include`` rewrite it under the lock."""

    def __init__(self, base: Path, host: str, session: str) -> None:
        # base: the supervisor's own files' stem (<state>/supervise/<host>.<session>: ops/supervise/loop.py)
        self.path = Path(f"{base}.gpus.json")
        self.lock_path = Path(f"{base}.gpus.lock")
        self.host, self.session = host, session
        self.problem: str | None = None

    def load(self) -> tuple[Excluded, ...]:
        self.problem = None
        try:
            with open(self.path, "rb") as f:
                raw = f.read(FILE_MAX + 1)
        except FileNotFoundError:
            return ()
        except OSError as e:
            self.problem = f"cannot read {self.path}: {e.strerror or e}"
            return ()
        try:
            doc = json.loads(raw) if len(raw) <= FILE_MAX else None
        except (ValueError, RecursionError):
            doc = None
        listed = doc.get("excluded") if isinstance(doc, dict) else None
        if not isinstance(listed, list) or len(listed) > MAX_EXCLUDED:
            self.problem = f"{self.path}: not an excluded-GPU record (read as none excluded)"
            return ()
        out: dict[str, Excluded] = {}
        for value in listed:
            item = _item(value)
            if item is not None:
                out.setdefault(item.bus_id, item)
        return tuple(out.values())

    def _save(self, items: t.Sequence[Excluded], now: str | None) -> None:
        doc = {"host": self.host, "session": self.session, "updated_at": now, "excluded": [e.to_json() for e in items]}
        write_json_atomic(self.path, doc, mode=0o600)

    def _locked(self) -> t.Any:
        private_dir(self.path.parent)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def add(self, new: t.Iterable[Excluded], now: str | None = None) -> tuple[Excluded, ...]:
        """Those of ``new`` not excluded yet, now excluded (the first exclusion of a bus id is kept)."""
        fd = self._locked()
        try:
            have = list(self.load())
            added = []
            for e in new:
                if all(x.bus_id != e.bus_id for x in have):
                    have.append(e)
                    added.append(e)
            if added:
                self._save(have, now)
            return tuple(added)
        finally:
            os.close(fd)

    def include(self, given: str, now: str | None = None) -> tuple[Excluded, ...]:
        """Put the GPUs ``given`` names back (a short id may name one of several domains): those removed."""
        if not self.path.exists():
            return ()  # nothing excluded: nothing written, no folder made
        fd = self._locked()
        try:
            have = self.load()
            gone = tuple(e for e in have if matches(given, e.bus_id))
            if gone:
                self._save([e for e in have if e not in gone], now)
            return gone
        finally:
            os.close(fd)


def answer(store: Exclusions, include: t.Sequence[str], now: str | None) -> dict[str, t.Any]:
    """``dflashctl gpus`` and the installed supervisor's ``gpus`` verb: put back each GPU ``include`` names
    (a bus id that is not one: ValueError), then the set as it is: {excluded, included, not_excluded, path,
    problem}."""
    for given in include:
        if bus_id(given) is None:
            raise ValueError(f"{given!r} is not a PCI bus id (expected e.g. 0000:b3:00.0 or b3:00)")
    back: list[dict[str, t.Any]] = []
    unknown: list[str] = []
    for given in include:
        gone = store.include(given, now)
        back += [e.to_json() for e in gone]
        unknown += [] if gone else [given]
    left = store.load()
    return {
        "excluded": [e.to_json() for e in left],
        "included": back,
        "not_excluded": unknown,
        "path": str(store.path),
        "problem": store.problem,
    }


def answer_lines(name: str, doc: t.Mapping[str, t.Any]) -> list[str]:
    """What ``dflashctl gpus`` prints of ``answer``'s dict."""
    out = [f"GPU {e.get('bus_id')} put back (it was excluded: {e.get('why')})" for e in doc.get("included") or ()]
    out += [f"GPU {x} was not excluded: nothing to put back" for x in doc.get("not_excluded") or ()]
    left = [x for x in (_item(e) for e in doc.get("excluded") or ()) if x is not None]
    if not left:
        out.append(f"{name}: no GPU excluded; the next attempt the supervisor starts runs on every GPU of its config")
    else:
        out.append(f"{name}: the next attempt the supervisor starts runs without {len(left)} GPU(s) ({EXCLUDED_ENV}):")
        for e in left:
            after = f", after attempt {e.attempt}" if e.attempt is not None else ""
            out.append(f"  {e.bus_id}  {e.why}{after}" + (f" ({e.at})" if e.at else ""))
        out.append("after a reset, `dflashctl gpus --include BUS` puts one back")
    if doc.get("problem"):
        out.append(f"warning: {doc['problem']}")
    return out


__all__ = ["answer", "answer_lines", "EXCLUDED_ENV", "Excluded", "Exclusions", "bus_id", "env_value", "matches"]
