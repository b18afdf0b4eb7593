"""`dflashctl plot`: the run's dashboard, from the metrics.jsonl of every attempt of a session.

Fetching is incremental: ONE agent call (``read``, ops/far/agent.py) per round brings each attempt's
records (run.json, exit.json, stop.json), its metrics.jsonl from the offset this machine already has
(complete lines, at most ``ops.far.agent.READ_CAP`` bytes per call: rounds go on while an attempt has
more), the log tail of an attempt that crashed (its cause, by ``ops.diagnosis.diagnose``, once) and the
checkpoints. What came is kept under the state dir (the one restart-on-crash uses)::

    <state>/plot-cache/<host>/<session>/meta.json              offsets, run keys, records, causes
    <state>/plot-cache/<host>/<session>/attempt-<n>/metrics.jsonl
    <state>/plot-cache/<host>/<session>/attempt-<n>/table/     the same, parsed (``Table``)

An attempt whose file shrank, or whose attempt dir another run made (another run key), is fetched again.
Parsing is incremental too (ops/metrics_table.py): the table holds what the dashboard reads of every
record as flat arrays of numbers and the byte offset of metrics.jsonl parsed so far; a plot parses only
the lines after it. Every field is read through one typed reader: a line with a field of the wrong type
is skipped and counted, and the count is said once (a warning). Before points are made, each line of the
figure is decimated to ``BUCKETS`` x buckets (first, lowest, highest and last point of each: spikes
survive; a figure never needs more points than pixels).

Drawing needs matplotlib (the ``[plot]`` extra; Agg backend, no display). ``--csv`` writes exactly
the points drawn: attempt, step, time (seconds since the epoch, ``record_times``), series, value.
Every output (``--out``, ``--csv``, the state dir) is checked writable before anything is fetched.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import io
import json
import logging
import math
import os
import tempfile
import typing as t
from html import escape
from pathlib import Path

import numpy as np
import numpy.typing as npt

from ops import errors, read_answer, wire
from ops import session as run
from ops.diagnosis import diagnose
from ops.metrics_table import F64, I64, Columns, Table
from ops.session import session_name

if t.TYPE_CHECKING:
    from ops.remote import Remote

logger = logging.getLogger(__name__)

FORMATS = (".png", ".svg", ".html")
MAX_ROUNDS = 10_000  # read calls per plot: 40 GB of metrics at 4 MiB a call
# x buckets of the figure: a panel is about 480 px wide (14 in at 80 dpi, two columns), so with the
# first, lowest, highest and last point of each bucket the line looks as if every point were drawn
BUCKETS = 1000
Idx = npt.NDArray[np.intp]


class PlotError(errors.OpsError):
    """Drawing cannot happen (matplotlib missing, an output format we do not write, an output we cannot write)."""


class CacheError(PlotError):
    """The state dir cannot hold what was fetched (not a folder, read-only, full)."""

    def __init__(self, state_dir: Path, e: OSError) -> None:
        where = f" ({e.filename})" if e.filename else ""
        super().__init__(f"cannot keep fetched metrics under {state_dir} (--state-dir): {e.strerror or e}{where}")


def require_matplotlib() -> t.Any:
    """``matplotlib.pyplot`` on the Agg backend, or one line naming the extra (dflash.eval.plot's check:
    stdlib-only, no torch on the operator side)."""
    from dflash.eval import plot as eval_plot

    try:
        return eval_plot.require_matplotlib()
    except eval_plot.PlotError as e:
        raise PlotError(str(e)) from None


def check_writable(path: str, what: str) -> None:
    """One line, before any work, when the file ``path`` cannot be written: a folder there, no folder
    above it, a read-only file or file system, a folder we may not make files in. The folder is tried for
    real (a file made and removed: the kernel's verdict, root or not, whatever the reason); an existing
    file by access(2) (opening a FIFO or a terminal to try would block or print)."""
    p = Path(path)
    if p.is_dir():
        raise PlotError(f"{what} {path}: is a folder")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise PlotError(f"{what} {path}: cannot write it: read-only")
        return
    parent = p.parent
    if not parent.is_dir():
        why = "is not a folder" if parent.exists() else "does not exist"
        raise PlotError(f"{what} {path}: cannot write it: {parent} {why}")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".dflashctl-plot-")
    except OSError as e:
        raise PlotError(f"{what} {path}: cannot write in {parent}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def _suffix(out: str) -> str:
    suffix = os.path.splitext(out)[1].lower()
    if suffix not in FORMATS:
        raise PlotError(f"--out {out}: expected a file ending in {', '.join(FORMATS)}")
    return suffix


def check_out(out: str) -> str:
    """--out: a format we write, in a place we can write (said before anything connects)."""
    suffix = _suffix(out)
    check_writable(out, "--out")
    return suffix


# --------------------------------------------------------------------------------------------
# The local cache and the incremental fetch


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "_"


class Cache:
    """What was fetched of one host+session: one metrics.jsonl (and its table) per attempt and meta.json."""

    def __init__(self, state_dir: Path, host: str, session: str) -> None:
        self.state_dir = Path(state_dir)
        self.dir = self.state_dir / "plot-cache" / _slug(host) / _slug(session)
        self.meta_path = self.dir / "meta.json"

    def check(self) -> None:
        """The state dir takes files (said in one line before anything is fetched)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.dir, prefix=".check-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise CacheError(self.state_dir, e) from None

    def load(self) -> dict[str, t.Any]:
        try:
            meta = json.loads(self.meta_path.read_text())
        except (OSError, ValueError, RecursionError):
            return {"attempts": {}, "checkpoints": []}
        if not isinstance(meta, dict) or not isinstance(meta.get("attempts"), dict):
            return {"attempts": {}, "checkpoints": []}
        return meta

    def save(self, meta: dict[str, t.Any]) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.meta_path.with_name(f".meta.{os.getpid()}")
            tmp.write_text(json.dumps(meta))
            os.replace(tmp, self.meta_path)
        except OSError as e:
            raise CacheError(self.state_dir, e) from None

    def metrics(self, attempt: str) -> Path:
        return self.dir / f"attempt-{attempt}" / "metrics.jsonl"

    def table(self, attempt: str) -> Table:
        return Table(self.dir / f"attempt-{attempt}")

    def write(self, attempt: str, offset: int, data: bytes) -> None:
        """The bytes at ``offset`` of the attempt's file; anything after them goes (a refetch from 0 truncates).
        A table that parsed past ``offset`` goes first (it would describe bytes no longer there)."""
        path = self.metrics(attempt)
        try:
            table = self.table(attempt)
            if offset < table.offset():
                table.drop()
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "r+b" if path.exists() else "w+b") as f:
                f.seek(offset)
                f.write(data)
                f.truncate()
        except OSError as e:
            raise CacheError(self.state_dir, e) from None

    def drop(self, attempt: str) -> None:
        self.table(attempt).drop()
        path = self.metrics(attempt)
        if path.exists():
            path.unlink()

    def columns(self, attempt: str) -> Columns:
        """The attempt's table, brought up to its metrics.jsonl (only the new lines are parsed)."""
        table = self.table(attempt)
        try:
            table.update(self.metrics(attempt))
            cols = table.load()
            if cols is None:  # a file of it lost or cut (by hand, a full disk): parsed again
                table.drop()
                table.update(self.metrics(attempt))
                cols = table.load()
        except OSError as e:
            raise CacheError(self.state_dir, e) from None
        if cols is None:
            raise PlotError(f"the parsed table of attempt {attempt} under {table.dir} cannot be read back")
        return cols


@dataclasses.dataclass
class Fetched:
    new_bytes: int
    calls: int
    meta: dict[str, t.Any]


def end_of(m: t.Mapping[str, t.Any], tail: t.Sequence[str] | None) -> str | None:
    """How an attempt ended, as its mark says it: succeeded, stopped, crashed: <cause>; None: no exit record."""
    problems: list[str] = []  # the cache's records were checked when they came
    exit_rec, stop = wire.parse_exit(m.get("exit"), problems), wire.parse_stop(m.get("stop"), problems)
    run = wire.parse_run(m.get("run"), problems)
    if not exit_rec:
        return None
    if stop:
        return "stopped"
    if exit_rec.exit_code == 0:
        return "succeeded"
    d = diagnose(
        list(tail or []),
        exit_code=exit_rec.exit_code,
        signal=exit_rec.signal,
        oom_before=run.oom_kill if run else None,
        oom_after=exit_rec.oom_kill,
        disk_free=exit_rec.disk_free if exit_rec.disk_full else None,
    )
    if d.cause == "signal" and d.signal:
        return f"crashed: signal {d.signal}"
    return f"crashed: {d.cause}"


def fetch(remote: Remote, session: str | None, cache: Cache, *, cap: int | None = None) -> Fetched:
    """Bring the cache up to date with the host: only bytes not fetched yet."""
    meta = cache.load()
    have: dict[str, dict[str, t.Any]] = meta["attempts"]
    new = calls = 0
    for _ in range(MAX_ROUNDS):
        ask = {
            n: {"offset": m.get("offset", 0), "run": m.get("run_key"), "tail": "crashed" if "end" not in m else False}
            for n, m in have.items()
        }
        answer = read_answer.parse_read(run.read(remote, session, ask, cap=cap))
        calls += 1
        more = False
        seen = set()
        for rec in answer.attempts:
            n = str(rec.attempt)
            seen.add(n)
            m = have.setdefault(n, {"offset": 0})
            if rec.reset or rec.data or rec.offset != m.get("offset", 0):
                cache.write(n, rec.offset, rec.data)
            new += len(rec.data)
            m.update(offset=rec.next, run_key=rec.run_key, run=rec.run, exit=rec.exit, stop=rec.stop, size=rec.size)
            if rec.reset:
                m.pop("end", None)
            if rec.exit and "end" not in m and (rec.log_tail is not None or rec.exit.get("exit_code") == 0 or rec.stop):
                m["end"] = end_of(m, rec.log_tail)
            more = more or rec.more
        for n in [n for n in have if n not in seen]:  # removed on the host: so here
            cache.drop(n)
            del have[n]
        meta["checkpoints"] = answer.checkpoints
        meta["current"] = answer.current
        meta["session_dir"] = answer.session_dir
        cache.save(meta)
        if not more:
            break
    return Fetched(new, calls, meta)


# --------------------------------------------------------------------------------------------
# The series: what is drawn, and what --csv writes


class Records(t.Sequence[dict[str, t.Any]]):
    """An attempt's records as the dashboard read them (``step``, ``time`` and each series' value), made
    from its table on access: ``dflashctl plot`` names the first and last step of each attempt."""

    def __init__(self, cols: Columns) -> None:
        self.cols = cols

    def __len__(self) -> int:
        return len(self.cols.step)

    @t.overload
    def __getitem__(self, i: int) -> dict[str, t.Any]: ...

    @t.overload
    def __getitem__(self, i: slice) -> list[dict[str, t.Any]]: ...

    def __getitem__(self, i: int | slice) -> dict[str, t.Any] | list[dict[str, t.Any]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        at = float(self.cols.time[i])
        rec: dict[str, t.Any] = {"step": int(self.cols.step[i]), "time": None if math.isnan(at) else at}
        for name, (rows, vals) in self.cols.series.items():
            k = int(np.searchsorted(rows, i))
            if k < len(rows) and rows[k] == i:
                rec[name] = float(vals[k])
        return rec


@dataclasses.dataclass
class Attempt:
    number: int
    columns: Columns
    end: str | None
    started: float | None
    ended: float | None

    @property
    def records(self) -> Records:
        return Records(self.columns)


def load_attempts(cache: Cache, meta: t.Mapping[str, t.Any]) -> list[Attempt]:
    out = []
    for n, m in sorted(meta["attempts"].items(), key=lambda kv: int(kv[0])):
        problems: list[str] = []  # the cache's records were checked when they came
        run, exit_rec = wire.parse_run(m.get("run"), problems), wire.parse_exit(m.get("exit"), problems)
        end = m.get("end")
        if end is None and not exit_rec and int(n) != meta.get("current"):
            end = "lost"  # an earlier attempt with no exit record: it did not end by itself
        started, ended = run.started_ts if run else None, exit_rec.ended_ts if exit_rec else None
        out.append(Attempt(int(n), cache.columns(n), end, started, ended))
    return out


@dataclasses.dataclass(frozen=True)
class Line:
    """One series of one attempt as drawn: every point, or per x bucket its first, lowest, highest, last
    (and first NaN: a gap stays a gap)."""

    attempt: int
    series: str
    steps: list[int]
    times: list[float | None]  # seconds since the epoch (record_times), rounded to ms
    values: list[float]


def decimate(x: F64, y: F64, lo: float, width: float, buckets: int = BUCKETS) -> Idx:
    """The indices to draw of one line: all of them when it has no more points than ``buckets``; else, in
    each of ``buckets`` equal slices of x from ``lo``, the first, lowest, highest and last point and the
    first NaN (a gap stays a gap). What the line looks like at that width, spikes and dips included."""
    n = len(x)
    if n <= buckets:
        return np.arange(n)
    if width > 0:
        b = np.clip(((x - lo) * (buckets / width)).astype(np.int64), 0, buckets - 1)
    else:
        b = np.zeros(n, np.int64)
    by_bucket = np.argsort(b, kind="stable")  # each bucket's points in their order
    sb = b[by_bucket]
    starts = np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])
    ends = np.r_[starts[1:], n] - 1
    nan = np.isnan(y)
    lowest = np.lexsort((np.where(nan, np.inf, y), b))[starts]  # sorted by bucket, then value
    highest = np.lexsort((-np.where(nan, -np.inf, y), b))[starts]
    nans = np.flatnonzero(nan)
    first_nan = nans[np.unique(b[nans], return_index=True)[1]] if len(nans) else nans
    return np.unique(np.concatenate([by_bucket[starts], by_bucket[ends], lowest, highest, first_nan]))


def origin(attempts: t.Sequence[Attempt], since: int | None = None) -> float:
    """Time 0 of ``--time``: when the first attempt started (or its first record, if earlier)."""
    starts = [float(a.started) for a in attempts if isinstance(a.started, (int, float)) and a.started]
    for a in attempts:
        times = a.columns.time[a.columns.step >= since] if since is not None else a.columns.time
        if len(times) and not np.isnan(times).all():
            starts.append(float(np.nanmin(times)))
    return min(starts) if starts else 0.0


def lines(
    attempts: t.Sequence[Attempt], since: int | None = None, *, use_time: bool = False, buckets: int = BUCKETS
) -> list[Line]:
    """Every line drawn, decimated on the figure's x (steps, or times with ``use_time``): by attempt, then
    series in the order records hold them (scalars, ``acc_slot_<k>``, ``busy:<worker>``, ``wait:<worker>``)."""
    t0 = origin(attempts, since)
    parts: list[tuple[int, str, I64, F64, F64, F64]] = []
    for a in attempts:
        cols = a.columns
        times = cols.time
        for name, (rows, vals) in cols.series.items():
            if since is not None:
                keep = cols.step[rows] >= since
                rows, vals = rows[keep], vals[keep]
            if not len(rows):
                continue
            steps, ts = cols.step[rows], times[rows]
            x = np.where(np.isnan(ts), t0, ts) if use_time else steps.astype(np.float64)
            parts.append((a.number, name, steps, ts, x, vals))
    if not parts:
        return []
    lo = min(float(p[4].min()) for p in parts)
    hi = max(float(p[4].max()) for p in parts)
    out = []
    for number, name, steps, ts, x, vals in parts:
        kept = decimate(x, vals, lo, hi - lo, buckets)
        out.append(
            Line(
                number,
                name,
                steps[kept].tolist(),
                [None if math.isnan(v) else round(v, 3) for v in ts[kept].tolist()],
                vals[kept].tolist(),
            )
        )
    return out


def write_csv(path: str, drawn: t.Sequence[Line]) -> None:
    """Every point drawn, record by record (attempt, step), in the series' order within a record."""
    rows = [
        (ln.attempt, step, order, time, ln.series, value)
        for order, ln in enumerate(drawn)
        for step, time, value in zip(ln.steps, ln.times, ln.values)
    ]
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    try:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["attempt", "step", "time", "series", "value"])
            for attempt, step, _, time, series, value in rows:
                w.writerow([attempt, step, "" if time is None else f"{time:.3f}", series, repr(value)])
    except OSError as e:
        raise PlotError(f"--csv {path}: cannot write it: {e.strerror or e}") from None


# --------------------------------------------------------------------------------------------
# Drawing


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    wanted: t.Callable[[str], bool]
    # the y axis: "count" starts at 0, "fraction" spans 0..1, None: matplotlib's autoscale. A flat series
    # on an autoscaled axis fills the panel with its own noise (live workers 1.90..2.10 for a constant 2)
    scale: str | None = None


PANELS: tuple[Panel, ...] = (
    Panel("loss", lambda s: s == "loss"),
    # DFlash2 runs add the selector's accuracy and the label-in-top-k rate (sel_acc, top_k_rate) here
    Panel(
        "accuracy (mean, per slot)",
        lambda s: s in ("acc", "sel_acc", "top_k_rate") or s.startswith("acc_slot_"),
        "fraction",
    ),
    # the held-out tau of [eval] every beside the teacher-forced one: the same unit, the gap is the news
    Panel("tau: teacher-forced, held-out eval", lambda s: s in ("tau_tf", "eval_tau", "eval_best_tau")),
    Panel("Ktok/s", lambda s: s == "ktok_s", "count"),
    Panel("queue depth / capacity", lambda s: s in ("queue_depth", "queue_capacity"), "count"),
    Panel("live workers", lambda s: s in ("drafters_live", "drafters_total", "targets_live"), "count"),
    Panel("workers: busy (solid), waiting (dashed)", lambda s: s.startswith(("busy:", "wait:")), "fraction"),
    Panel("learning rate", lambda s: s == "lr"),
)


def _y_limits(ax: t.Any, scale: str | None, values: t.Sequence[float]) -> None:
    finite = [v for v in values if math.isfinite(v)]
    if scale is None or not finite:
        return
    low, high = min(finite), max(finite)
    if scale == "fraction":
        ax.set_ylim(min(0.0, low), max(1.0, high))
    else:  # a count: from 0, with matplotlib's 5 % margin above; never less than 1 (a constant 0)
        bottom = min(0.0, low)
        ax.set_ylim(bottom, max(1.0, high + 0.05 * (high - bottom)))


def figure(
    attempts: t.Sequence[Attempt],
    drawn: t.Sequence[Line],
    checkpoints: t.Sequence[t.Mapping[str, t.Any]],
    *,
    title: str,
    use_time: bool = False,
    since: int | None = None,
) -> t.Any:
    """The dashboard as a matplotlib Figure (4x2 panels) with restarts and checkpoints marked."""
    plt = require_matplotlib()
    t0 = origin(attempts, since)
    span = max((tm - t0 for ln in drawn for tm in ln.times if tm is not None), default=0.0)
    unit, unit_name = (3600.0, "hours") if span > 3 * 3600 else (60.0, "minutes")  # a long run in hours

    def xs(ln: Line) -> list[float]:
        if not use_time:
            return [float(s) for s in ln.steps]
        return [((tm if tm is not None else t0) - t0) / unit for tm in ln.times]

    fig, axes = plt.subplots(4, 2, figsize=(14, 12), sharex=True)
    flat = list(axes.flat)
    by_series: dict[str, list[Line]] = {}
    for ln in drawn:
        by_series.setdefault(ln.series, []).append(ln)
    colors: dict[str, t.Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(flat, PANELS):
        name = panel.title
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        shown: list[float] = []
        for series in sorted(s for s in by_series if panel.wanted(s)):
            key = series.split(":", 1)[-1]
            color = colors.setdefault(
                f"{name}|{key}", cycle[len([c for c in colors if c.startswith(name + "|")]) % len(cycle)]
            )
            style = "--" if series.startswith("wait:") or series in ("queue_capacity", "drafters_total") else "-"
            if series.startswith("eval_"):  # one point per eval: markers, the best so far dashed
                style = "o--" if series == "eval_best_tau" else "o-"
            for i, ln in enumerate(sorted(by_series[series], key=lambda ln: ln.attempt)):
                ax.plot(xs(ln), ln.values, style, color=color, linewidth=1.2, label=series if i == 0 else None)
                shown += ln.values
        if shown:
            ax.legend(fontsize=7, loc="best", ncol=2)
            _y_limits(ax, panel.scale, shown)
        else:
            ax.text(0.5, 0.5, "not in metrics.jsonl", ha="center", va="center", transform=ax.transAxes, color="gray")
    # checkpoints: dotted gray; attempt ends that were not a success: red, labelled with the cause
    for c in checkpoints:
        step = c.get("step")
        if since is not None and isinstance(step, int) and step < since:
            continue
        x = ((c.get("time") or t0) - t0) / unit if use_time else step
        for ax in flat:
            ax.axvline(x, color="gray", linestyle=":", linewidth=1)
        flat[0].annotate(
            f"ckpt {step}",
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            color="gray",
            rotation=90,
            va="top",
            ha="right",
        )
    for a in attempts:
        if a.end in (None, "succeeded") or not len(a.columns.step):
            continue
        if use_time:
            last_at = float(a.columns.at[-1])
            x = ((a.ended or (None if math.isnan(last_at) else last_at) or t0) - t0) / unit
        else:
            x = int(a.columns.step[-1])
            if since is not None and x < since:
                continue
        for ax in flat:
            ax.axvline(x, color="tab:red", linestyle="--", linewidth=1.2)
        for ax in flat[:2]:
            ax.annotate(
                f"attempt {a.number} {a.end}",
                (x, 0.02),
                xycoords=("data", "axes fraction"),
                fontsize=7,
                color="tab:red",
                rotation=90,
                va="bottom",
                ha="right",
            )
    for ax in flat[-2:]:
        ax.set_xlabel(f"{unit_name} since the first attempt started" if use_time else "step")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


def draw(
    out: str,
    attempts: t.Sequence[Attempt],
    drawn: t.Sequence[Line],
    checkpoints: t.Sequence[t.Mapping[str, t.Any]],
    *,
    title: str,
    use_time: bool = False,
    since: int | None = None,
) -> None:
    """One dashboard (``figure``) written to ``out``: ``.png``, ``.svg`` or ``.html``."""
    suffix = _suffix(out)
    plt = require_matplotlib()
    fig = figure(attempts, drawn, checkpoints, title=title, use_time=use_time, since=since)
    try:
        if suffix == ".html":
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=80)
            png = base64.b64encode(buf.getvalue()).decode("ascii")
            page = (
                f'<!doctype html>\n<html><head><meta charset="utf-8"><title>{escape(title)}</title></head>\n'
                f'<body><img alt="{escape(title)}" src="data:image/png;base64,{png}"></body></html>\n'
            )
            Path(out).write_text(page)
        else:
            fig.savefig(out, dpi=80)
    except OSError as e:
        raise PlotError(f"--out {out}: cannot write it: {e.strerror or e}") from None
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------
# The command


@dataclasses.dataclass
class Result:
    out: str
    fetched: Fetched
    attempts: list[Attempt]
    points: int
    steps: tuple[int, int] | None
    skipped: int = 0  # metrics lines with a field of the wrong type (said once, as a warning)


def skipped_note(label: str, attempts: t.Sequence[Attempt]) -> str | None:
    """The one line that says which metrics lines were left out, or None."""
    skipped = sum(a.columns.skipped for a in attempts)
    if not skipped:
        return None
    a = next(a for a in attempts if a.columns.skipped)
    return (
        f"{label}: skipped {skipped} line(s) of metrics.jsonl with a field of the wrong type "
        f"(the first: attempt {a.number} {a.columns.first_skip}); the rest is drawn"
    )


def plot(
    remote: Remote,
    session: str | None,
    *,
    out: str,
    state_dir: Path,
    since: int | None = None,
    use_time: bool = False,
    csv_path: str | None = None,
) -> Result:
    check_out(out)
    if csv_path:
        check_writable(csv_path, "--csv")
    require_matplotlib()  # before any fetch: a missing extra is said at once
    host = remote.host
    name = session_name(host, session)
    cache = Cache(state_dir, host.name, name)
    cache.check()  # every output can be written before anything is fetched
    fetched = fetch(remote, name, cache)
    attempts = load_attempts(cache, fetched.meta)
    if not attempts:
        raise errors.OpsError(
            f"{host.label}: nothing to plot: session '{name}' has no attempt under "
            f"{fetched.meta.get('session_dir') or host.run_dir}"
        )
    if note := skipped_note(host.label, attempts):
        logger.warning("%s", note)
    drawn = lines(attempts, since, use_time=use_time)
    firsts = [min(ln.steps) for ln in drawn if ln.steps]
    lasts = [max(ln.steps) for ln in drawn if ln.steps]
    steps = (min(firsts), max(lasts)) if firsts else None
    crashes = sum(1 for a in attempts if a.end not in (None, "succeeded"))
    title = (
        f"{host.name} / {name}: {len(attempts)} attempt(s), {crashes} ended early, steps {steps[0]}..{steps[1]}"
        if steps
        else f"{host.name} / {name}: no metrics yet"
    )
    if csv_path:
        write_csv(csv_path, drawn)
    draw(out, attempts, drawn, fetched.meta.get("checkpoints") or [], title=title, use_time=use_time, since=since)
    skipped = sum(a.columns.skipped for a in attempts)
    return Result(out, fetched, attempts, sum(len(ln.values) for ln in drawn), steps, skipped)
