"""metrics.jsonl read by class and kept parsed: the typed reader and the compact table of one attempt.

Every field the dashboard (ops/plot.py) draws is read through ONE typed reader (``typed``, by
``read_record``): a line with a field of the wrong type (its class, never its text: a number where a
list goes, a step no int64 holds, JSON nested too deeply, no JSON at all) raises ``WrongType``, and the
table skips and counts it. ``Table`` keeps what was read as flat arrays of numbers beside the fetched
metrics.jsonl, with the byte offset parsed so far: only later lines are ever parsed again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import json
import math
import os
import shutil
import typing as t
from pathlib import Path

import numpy as np
import numpy.typing as npt

PARSE_CHUNK = 8 << 20  # bytes of metrics.jsonl parsed at a time: memory stays bounded, whatever the file
MAX_STEP = 2**63 - 1  # a step is kept as int64

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U32 = npt.NDArray[np.uint32]


class WrongType(ValueError):
    """A field of a metrics line that is not of its class: the line is skipped (and counted)."""


# --------------------------------------------------------------------------------------------
# One metrics line, read by class


_WANTED = {
    "number": "a number",
    "whole": "a whole number 0..2**63-1",
    "text": "text",
    "list": "a list",
    "object": "an object",
}


def _class(value: t.Any) -> str:
    """The JSON class of a value, as an error names it (never its text: a line can be anything)."""
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, int):
        return f"a whole number of {len(str(abs(value)))} digits" if abs(value) > MAX_STEP else "a whole number"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_EXACT: dict[str, type] = {"number": float, "text": str, "list": list, "object": dict}


def typed(value: t.Any, kind: str, name: str, *, required: bool = False) -> t.Any:
    """THE typed reader: ``value`` as ``kind`` (number -> float, whole -> int in 0..2**63-1, text, list,
    object); None for null or absent unless ``required``; WrongType naming the field otherwise."""
    cls = type(value)
    if cls is _EXACT.get(kind) or (kind == "whole" and cls is int and 0 <= value <= MAX_STEP):
        return value  # the common case, at once: a plot reads millions of fields
    if value is None:
        if required:
            raise WrongType(f"{name} is missing, expected {_WANTED[kind]}")
        return None
    if kind == "number" and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)  # NaN and inf stay (a diverged loss is a fact to draw: a gap)
        except OverflowError:
            pass  # an integer no float holds: the wrong class for a drawn value
    elif kind == "whole" and isinstance(value, int) and not isinstance(value, bool):
        if 0 <= value <= MAX_STEP:
            return int(value)
    elif (
        (kind == "text" and isinstance(value, str))
        or (kind == "list" and isinstance(value, list))
        or (kind == "object" and isinstance(value, dict))
    ):
        return value
    raise WrongType(f"{name} is {_class(value)}, expected {_WANTED[kind]}")


@dataclasses.dataclass(frozen=True)
class Row:
    """What the dashboard reads of one record."""

    step: int
    at: float  # seconds since the epoch of its ``at``; NaN: none
    interval: float  # its ``interval_s``; NaN: none
    values: list[tuple[str, float]]  # (series, value), in the record's order


SCALARS = (
    "loss",
    "acc",
    "tau_tf",
    "ktok_s",
    "queue_depth",
    "queue_capacity",
    "drafters_live",
    "drafters_total",
    "targets_live",
    "lr",
    "sel_acc",  # DFlash2 runs only: the selector's accuracy, and how often the label was in its top-k
    "top_k_rate",
)


def at_seconds(at: t.Any) -> float | None:
    """``at`` (``2026-01-01T00:00:00Z``, UTC) in seconds since the epoch; None: not such a time."""
    text = str(at)
    try:
        if len(text) == 20 and text[4] == "-" and text[10] == "T" and text[19] == "Z":  # the form we write: fast
            return dt.datetime.fromisoformat(text[:19]).replace(tzinfo=dt.UTC).timestamp()
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


def worker_label(name: str | None, role: str | None, index: int | None) -> str:
    if name:
        return name
    return f"{role or 'worker'}-{'?' if index is None else index}"


def wait_fraction(wait: float | None, wait_s: float | None, interval: float | None) -> float | None:
    """Share of the window a worker waited on the queue (drafter: starved, target: queue full)."""
    if wait is not None:
        return wait
    if wait_s is not None and interval:
        return min(1.0, wait_s / interval)
    return None


def read_record(line: bytes) -> Row:
    """One line of metrics.jsonl, every field through ``typed``: a Row, or WrongType saying which field
    (the name of an item of a list is made only when it is wrong: a record has hundreds of them)."""
    try:
        obj = json.loads(line)
    except RecursionError:
        raise WrongType("not JSON: nested too deeply") from None
    except ValueError:  # UnicodeDecodeError included
        raise WrongType("not JSON") from None
    rec = typed(obj, "object", "the line", required=True)
    step = typed(rec.get("step"), "whole", "step", required=True)
    at_text = typed(rec.get("at"), "text", "at")
    at = at_seconds(at_text) if at_text is not None else math.nan
    if at is None:
        raise WrongType("at is text that is not a time like 2026-01-01T00:00:00Z")
    if typed(rec.get("event"), "text", "event") is not None:  # a loss-spike, nonfinite-skip... record: no figures
        return Row(step, at, 0.0, [])
    if typed(rec.get("kind"), "text", "kind") == "eval":  # a held-out eval of [eval] every (dflash/train/validation.py)
        evals = [(f"eval_{k}", v) for k in ("tau", "best_tau") if (v := typed(rec.get(k), "number", k)) is not None]
        # interval 0: it takes no time of the steps around it (record_times sums the intervals after a record)
        return Row(step, at, 0.0, evals)
    if rec.get("event") is not None:  # a skipped checkpoint, a sync's end: no figures, no time of the steps
        return Row(step, at, 0.0, [])
    interval = typed(rec.get("interval_s"), "number", "interval_s")
    values = []
    for key in SCALARS:
        if (v := typed(rec.get(key), "number", key)) is not None:
            values.append((key, v))
    for k, a in enumerate(typed(rec.get("acc_per_slot"), "list", "acc_per_slot") or ()):
        try:
            v = typed(a, "number", "")
        except WrongType as e:
            raise WrongType(f"acc_per_slot[{k}]{e}") from None
        if v is not None:
            values.append((f"acc_slot_{k + 1}", v))
    for i, item in enumerate(typed(rec.get("workers"), "list", "workers") or ()):
        try:
            w = typed(item, "object", "", required=True)
            label = worker_label(
                typed(w.get("name"), "text", ".name"),
                typed(w.get("role"), "text", ".role"),
                typed(w.get("index"), "whole", ".index"),
            )
            busy = typed(w.get("busy"), "number", ".busy")
            wait = wait_fraction(
                typed(w.get("wait"), "number", ".wait"), typed(w.get("wait_s"), "number", ".wait_s"), interval
            )
        except WrongType as e:
            raise WrongType(f"workers[{i}]{e}") from None
        if busy is not None:
            values.append((f"busy:{label}", busy))
        if wait is not None:
            values.append((f"wait:{label}", wait))
    return Row(step, at, math.nan if interval is None else interval, values)


# --------------------------------------------------------------------------------------------
# The parsed table of one attempt


@dataclasses.dataclass
class TableIndex:
    """table/index.json: how far metrics.jsonl was parsed and how much of each file counts."""

    offset: int = 0  # bytes of metrics.jsonl parsed (complete lines)
    lines: int = 0  # lines parsed (a skipped line is named by its number)
    rows: int = 0  # records kept
    skipped: int = 0  # lines with a field of the wrong type
    first_skip: str | None = None  # "line N: <field> is <class>, expected <class>"
    names: list[str] = dataclasses.field(default_factory=list)  # series k = names[k]
    counts: list[int] = dataclasses.field(default_factory=list)  # points of series k

    @classmethod
    def from_json(cls, obj: t.Any) -> TableIndex | None:
        if not isinstance(obj, dict) or obj.get("version") != Table.VERSION:
            return None
        try:
            idx = cls(**{f.name: obj[f.name] for f in dataclasses.fields(cls)})
        except (KeyError, TypeError):
            return None
        whole = (idx.offset, idx.lines, idx.rows, idx.skipped, *idx.counts)
        if (
            not isinstance(idx.names, list)
            or not isinstance(idx.counts, list)
            or len(idx.names) != len(idx.counts)
            or not all(isinstance(n, str) for n in idx.names)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in whole)
            or not (idx.first_skip is None or isinstance(idx.first_skip, str))
        ):
            return None
        return idx


@dataclasses.dataclass
class Columns:
    """A table in memory: one value a record, and each series' (record, value) pairs."""

    step: I64
    at: F64
    interval: F64
    series: dict[str, tuple[U32, F64]]
    skipped: int = 0
    first_skip: str | None = None

    @functools.cached_property
    def time(self) -> F64:
        return record_times(self.at, self.interval)


class Table:
    """The parsed, compact form of one attempt's metrics.jsonl, beside it::

        table/index.json                     ``TableIndex``
        table/step.i8 at.f8 interval.f8      one value a record (NaN: none)
        table/<k>.row.u4 table/<k>.val.f8    series k: the record (its row) and the value of each point

    Only the lines after ``offset`` are ever parsed again. The files are appended before index.json is
    replaced, and read only as far as index.json counts: a parse cut short leaves a whole table."""

    VERSION = 2  # 2: eval records (kind "eval") give the eval_tau and eval_best_tau series
    ROW_FILES = (("step.i8", np.int64), ("at.f8", np.float64), ("interval.f8", np.float64))

    def __init__(self, attempt_dir: Path) -> None:
        self.dir = attempt_dir / "table"
        self.index_path = self.dir / "index.json"

    def index(self) -> TableIndex:
        try:
            obj = json.loads(self.index_path.read_text())
        except (OSError, ValueError, RecursionError):
            return TableIndex()
        return TableIndex.from_json(obj) or TableIndex()

    def offset(self) -> int:
        return self.index().offset

    def drop(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def _files(self, idx: TableIndex) -> list[tuple[Path, npt.DTypeLike, int]]:
        """Every file with its dtype and the items index.json counts in it."""
        out: list[tuple[Path, npt.DTypeLike, int]] = [(self.dir / n, d, idx.rows) for n, d in self.ROW_FILES]
        for k, count in enumerate(idx.counts):
            out += [(self.dir / f"{k}.row.u4", np.uint32, count), (self.dir / f"{k}.val.f8", np.float64, count)]
        return out

    def update(self, raw: Path) -> TableIndex:
        """Parse the complete lines of ``raw`` after the offset parsed; a raw file shorter than that
        (fetched again from 0) is parsed from the start."""
        idx = self.index()
        try:
            size = raw.stat().st_size
        except FileNotFoundError:
            size = 0
        if idx.offset > size:
            self.drop()
            idx = TableIndex()
        if idx.offset == size:
            return idx
        self.dir.mkdir(parents=True, exist_ok=True)
        for path, dtype, count in self._files(idx):  # what a parse cut short appended goes
            if path.exists() and path.stat().st_size != count * np.dtype(dtype).itemsize:
                os.truncate(path, count * np.dtype(dtype).itemsize)
        with raw.open("rb") as f:
            f.seek(idx.offset)
            rest = b""
            while block := f.read(PARSE_CHUNK):
                buf = rest + block
                cut = buf.rfind(b"\n") + 1
                rest = buf[cut:]
                if cut:
                    self._append(idx, buf[:cut])
                    idx.offset += cut
        tmp = self.index_path.with_name(f".index.{os.getpid()}")
        tmp.write_text(json.dumps({"version": self.VERSION, **dataclasses.asdict(idx)}))
        os.replace(tmp, self.index_path)
        return idx

    def _append(self, idx: TableIndex, chunk: bytes) -> None:
        """Parse complete lines and append them to the files (``idx`` counts them)."""
        steps: list[int] = []
        ats: list[float] = []
        intervals: list[float] = []
        cols: dict[str, tuple[list[int], list[float]]] = {}
        for line in chunk.split(b"\n")[:-1]:
            idx.lines += 1
            if not line.strip():
                continue
            try:
                row = read_record(line)
            except WrongType as e:
                idx.skipped += 1
                if idx.first_skip is None:
                    idx.first_skip = f"line {idx.lines}: {e}"
                continue
            r = idx.rows + len(steps)
            steps.append(row.step)
            ats.append(row.at)
            intervals.append(row.interval)
            for name, value in row.values:
                pair = cols.get(name)
                if pair is None:
                    pair = cols[name] = ([], [])
                pair[0].append(r)
                pair[1].append(value)

        def put(name: str, data: t.Sequence[float] | t.Sequence[int], dtype: npt.DTypeLike) -> None:
            with open(self.dir / name, "ab") as f:
                np.asarray(data, dtype=dtype).tofile(f)

        put("step.i8", steps, np.int64)
        put("at.f8", ats, np.float64)
        put("interval.f8", intervals, np.float64)
        where = {name: k for k, name in enumerate(idx.names)}
        for name, (rows, vals) in cols.items():
            k = where.get(name)
            if k is None:
                k = where[name] = len(idx.names)
                idx.names.append(name)
                idx.counts.append(0)
            put(f"{k}.row.u4", rows, np.uint32)
            put(f"{k}.val.f8", vals, np.float64)
            idx.counts[k] += len(rows)
        idx.rows += len(steps)

    def load(self) -> Columns | None:
        """The table as index.json counts it; None when a file holds less (then it is parsed again)."""
        idx = self.index()
        arrays = []
        for path, dtype, count in self._files(idx):
            try:
                a = np.fromfile(path, dtype=dtype, count=count) if count else np.empty(0, dtype)
            except (OSError, ValueError):
                return None
            if len(a) != count:
                return None
            arrays.append(a)
        step, at, interval, *pairs = arrays
        series = {name: (pairs[2 * k], pairs[2 * k + 1]) for k, name in enumerate(idx.names)}
        return Columns(step, at, interval, series, idx.skipped, idx.first_skip)


def record_times(at: F64, interval: F64) -> F64:
    """When each record was written, finer than its ``at`` (whole seconds: fast runs log several records
    a second): the attempt's last ``at``, minus the ``interval_s`` of the records after it; NaN: unknown."""
    if not len(at) or math.isnan(at[-1]) or np.isnan(interval).any():
        return at
    later = np.concatenate(([0.0], np.cumsum(interval[::-1])[:-1]))[::-1]  # summed from the end, in order
    return t.cast(F64, at[-1] - later)
