"""`dflashctl plot`: the run's dashboard, from the metrics.jsonl of every attempt of a session.

Fetching is incremental: ONE agent call (``read``, ops/far/agent.py) per round brings each attempt's
records (run.json, exit.json, stop.json), its metrics.jsonl from the offset this machine already has
(complete lines, at most ``ops.far.agent.READ_CAP`` bytes per call: rounds go on while an attempt has
more), the log tail of an attempt that crashed (its cause, by ``ops.probe.diagnose``, once) and the
checkpoints. What came is kept under the state dir (the one restart-on-crash uses)::

    <state>/plot-cache/<host>/<session>/meta.json              offsets, run keys, records, causes
    <state>/plot-cache/<host>/<session>/attempt-<n>/metrics.jsonl

An attempt whose file shrank, or whose attempt dir another run made (another run key), is fetched again.

Drawing needs matplotlib (the ``[plot]`` extra; Agg backend, no display). ``--csv`` writes exactly
the points drawn: attempt, step, time (seconds since the epoch, ``record_times``), series, value.
"""

from __future__ import annotations

import base64
import csv
import dataclasses
import datetime as dt
import io
import json
import os
import typing as t
from html import escape
from pathlib import Path

from ops import errors
from ops import session as run
from ops.probe import diagnose
from ops.session import session_name

if t.TYPE_CHECKING:
    from ops.remote import Remote

FORMATS = (".png", ".svg", ".html")
MAX_ROUNDS = 10_000  # read calls per plot: 40 GB of metrics at 4 MiB a call


class PlotError(errors.OpsError):
    """Drawing cannot happen (matplotlib missing, an output format we do not write)."""


def require_matplotlib() -> t.Any:
    """``matplotlib.pyplot`` on the Agg backend, or one line naming the extra (dflash.eval_plot's check:
    stdlib-only, no torch on the operator side)."""
    from dflash import eval_plot

    try:
        return eval_plot.require_matplotlib()
    except eval_plot.PlotError as e:
        raise PlotError(str(e)) from None


def check_out(out: str) -> str:
    suffix = os.path.splitext(out)[1].lower()
    if suffix not in FORMATS:
        raise PlotError(f"--out {out}: expected a file ending in {', '.join(FORMATS)}")
    return suffix


# --------------------------------------------------------------------------------------------
# The local cache and the incremental fetch


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "_"


class Cache:
    """What was fetched of one host+session: one metrics.jsonl per attempt and meta.json."""

    def __init__(self, state_dir: Path, host: str, session: str) -> None:
        self.dir = Path(state_dir) / "plot-cache" / _slug(host) / _slug(session)
        self.meta_path = self.dir / "meta.json"

    def load(self) -> dict[str, t.Any]:
        try:
            meta = json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return {"attempts": {}, "checkpoints": []}
        if not isinstance(meta, dict) or not isinstance(meta.get("attempts"), dict):
            return {"attempts": {}, "checkpoints": []}
        return meta

    def save(self, meta: dict[str, t.Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.meta_path.with_name(f".meta.{os.getpid()}")
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, self.meta_path)

    def metrics(self, attempt: str) -> Path:
        return self.dir / f"attempt-{attempt}" / "metrics.jsonl"

    def write(self, attempt: str, offset: int, data: bytes) -> None:
        """The bytes at ``offset`` of the attempt's file; anything after them goes (a refetch from 0 truncates)."""
        path = self.metrics(attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.exists() else "w+b") as f:
            f.seek(offset)
            f.write(data)
            f.truncate()

    def drop(self, attempt: str) -> None:
        path = self.metrics(attempt)
        if path.exists():
            path.unlink()


@dataclasses.dataclass
class Fetched:
    new_bytes: int
    calls: int
    meta: dict[str, t.Any]


def end_of(m: t.Mapping[str, t.Any], tail: t.Sequence[str] | None) -> str | None:
    """How an attempt ended, as its mark says it: succeeded, stopped, crashed: <cause>; None: no exit record."""
    exit_rec, stop, run = m.get("exit"), m.get("stop"), m.get("run") or {}
    if not exit_rec:
        return None
    if stop:
        return "stopped"
    if exit_rec.get("exit_code") == 0:
        return "succeeded"
    d = diagnose(
        list(tail or []),
        exit_code=exit_rec.get("exit_code"),
        signal=exit_rec.get("signal"),
        oom_before=run.get("oom_kill"),
        oom_after=exit_rec.get("oom_kill"),
        disk_free=exit_rec.get("disk_free") if exit_rec.get("disk_full") else None,
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
        answer = run.read(remote, session, ask, cap=cap)
        calls += 1
        more = False
        seen = set()
        for rec in answer.get("attempts") or []:
            n = str(rec["attempt"])
            seen.add(n)
            m = have.setdefault(n, {"offset": 0})
            data = base64.b64decode(rec.get("data") or "")
            if rec.get("reset") or data or rec.get("offset", 0) != m.get("offset", 0):
                cache.write(n, int(rec.get("offset", 0)), data)
            new += len(data)
            m.update(
                offset=rec.get("next", 0),
                run_key=rec.get("run_key"),
                run=rec.get("run"),
                exit=rec.get("exit"),
                stop=rec.get("stop"),
                size=rec.get("size"),
            )
            if rec.get("reset"):
                m.pop("end", None)
            if (
                m.get("exit")
                and "end" not in m
                and ("log_tail" in rec or m["exit"].get("exit_code") == 0 or m.get("stop"))
            ):
                m["end"] = end_of(m, rec.get("log_tail"))
            more = more or bool(rec.get("more"))
        for n in [n for n in have if n not in seen]:  # removed on the host: so here
            cache.drop(n)
            del have[n]
        meta["checkpoints"] = answer.get("checkpoints") or []
        meta["current"] = answer.get("current")
        meta["session_dir"] = answer.get("session_dir")
        cache.save(meta)
        if not more:
            break
    return Fetched(new, calls, meta)


# --------------------------------------------------------------------------------------------
# The series: what is drawn, and what --csv writes


@dataclasses.dataclass
class Attempt:
    number: int
    records: list[dict[str, t.Any]]
    end: str | None
    started: float | None
    ended: float | None


def load_attempts(cache: Cache, meta: t.Mapping[str, t.Any]) -> list[Attempt]:
    out = []
    for n, m in sorted(meta["attempts"].items(), key=lambda kv: int(kv[0])):
        records = []
        try:
            lines = cache.metrics(n).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                records.append(rec)
        run, exit_rec = m.get("run") or {}, m.get("exit") or {}
        end = m.get("end")
        if end is None and not exit_rec and int(n) != meta.get("current"):
            end = "lost"  # an earlier attempt with no exit record: it did not end by itself
        out.append(Attempt(int(n), records, end, run.get("started_ts"), exit_rec.get("ended_ts")))
    return out


def at_seconds(at: t.Any) -> float | None:
    try:
        return dt.datetime.strptime(str(at), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


def worker_label(w: t.Mapping[str, t.Any]) -> str:
    if w.get("name"):
        return str(w["name"])
    return f"{w.get('role', 'worker')}-{w.get('index', '?')}"


def wait_fraction(w: t.Mapping[str, t.Any], interval: float | None) -> float | None:
    """Share of the window a worker waited on the queue (drafter: starved, target: queue full)."""
    if isinstance(w.get("wait"), (int, float)):
        return float(w["wait"])
    if isinstance(w.get("wait_s"), (int, float)) and interval:
        return min(1.0, float(w["wait_s"]) / interval)
    return None


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
)


@dataclasses.dataclass(frozen=True)
class Point:
    attempt: int
    step: int
    time: float | None  # seconds since the epoch (record_times): the x of --time
    series: str
    value: float


def record_times(records: t.Sequence[t.Mapping[str, t.Any]]) -> list[float | None]:
    """When each record was written, finer than its ``at`` (whole seconds: fast runs log several records
    a second): the attempt's last ``at``, minus the ``interval_s`` of the records after it."""
    ats = [at_seconds(r.get("at")) for r in records]
    if not records or ats[-1] is None or not all(isinstance(r.get("interval_s"), (int, float)) for r in records):
        return ats
    out: list[float | None] = []
    later = 0.0
    for rec in reversed(records):
        out.append(round(ats[-1] - later, 3))
        later += float(rec["interval_s"])
    return out[::-1]


def points(attempts: t.Sequence[Attempt], since: int | None = None) -> list[Point]:
    """Every value drawn, in order: scalars, ``acc_slot_<k>``, ``busy:<worker>``, ``wait:<worker>``."""
    out = []
    for a in attempts:
        for rec, at in zip(a.records, record_times(a.records)):
            step = rec["step"]
            if since is not None and step < since:
                continue

            def put(name: str, value: t.Any, number: int = a.number, step: int = step, at: float | None = at) -> None:
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out.append(Point(number, step, at, name, float(value)))

            for key in SCALARS:
                put(key, rec.get(key))
            for k, v in enumerate(rec.get("acc_per_slot") or []):
                put(f"acc_slot_{k + 1}", v)
            interval = rec.get("interval_s")
            for w in rec.get("workers") or []:
                if isinstance(w, dict):
                    put(f"busy:{worker_label(w)}", w.get("busy"))
                    put(f"wait:{worker_label(w)}", wait_fraction(w, interval))
    return out


def write_csv(path: str, pts: t.Sequence[Point]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["attempt", "step", "time", "series", "value"])
        for p in pts:
            w.writerow([p.attempt, p.step, "" if p.time is None else f"{p.time:.3f}", p.series, repr(p.value)])


# --------------------------------------------------------------------------------------------
# Drawing


PANELS: tuple[tuple[str, t.Callable[[str], bool]], ...] = (
    ("loss", lambda s: s == "loss"),
    ("accuracy (mean, per slot)", lambda s: s == "acc" or s.startswith("acc_slot_")),
    ("tau_tf (teacher-forced)", lambda s: s == "tau_tf"),
    ("Ktok/s", lambda s: s == "ktok_s"),
    ("queue depth / capacity", lambda s: s in ("queue_depth", "queue_capacity")),
    ("live workers", lambda s: s in ("drafters_live", "drafters_total", "targets_live")),
    ("workers: busy (solid), waiting (dashed)", lambda s: s.startswith(("busy:", "wait:"))),
    ("learning rate", lambda s: s == "lr"),
)


def draw(
    out: str,
    attempts: t.Sequence[Attempt],
    pts: t.Sequence[Point],
    checkpoints: t.Sequence[t.Mapping[str, t.Any]],
    *,
    title: str,
    use_time: bool = False,
    since: int | None = None,
) -> None:
    """One dashboard (4x2 panels) with restarts and checkpoints marked; ``.png``, ``.svg`` or ``.html``."""
    suffix = check_out(out)
    plt = require_matplotlib()
    starts = [a.started for a in attempts if a.started] + [p.time for p in pts if p.time is not None]
    t0 = min(starts) if starts else 0.0
    span = max((p.time - t0 for p in pts if p.time is not None), default=0.0)
    unit, unit_name = (3600.0, "hours") if span > 3 * 3600 else (60.0, "minutes")  # a long run in hours

    def x_of(p: Point) -> float:
        if not use_time:
            return float(p.step)
        return ((p.time if p.time is not None else t0) - t0) / unit

    fig, axes = plt.subplots(4, 2, figsize=(14, 12), sharex=True)
    flat = list(axes.flat)
    by_series: dict[str, dict[int, list[Point]]] = {}
    for p in pts:
        by_series.setdefault(p.series, {}).setdefault(p.attempt, []).append(p)
    colors: dict[str, t.Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, wanted) in zip(flat, PANELS):
        ax.set_title(name, fontsize=10)
        ax.grid(True, alpha=0.3)
        drawn = 0
        for series in sorted(s for s in by_series if wanted(s)):
            key = series.split(":", 1)[-1]
            color = colors.setdefault(
                f"{name}|{key}", cycle[len([c for c in colors if c.startswith(name + "|")]) % len(cycle)]
            )
            style = "--" if series.startswith("wait:") or series in ("queue_capacity", "drafters_total") else "-"
            for i, (_, seg) in enumerate(sorted(by_series[series].items())):
                ax.plot(
                    [x_of(p) for p in seg],
                    [p.value for p in seg],
                    style,
                    color=color,
                    linewidth=1.2,
                    label=series if i == 0 else None,
                )
                drawn += 1
        if drawn:
            ax.legend(fontsize=7, loc="best", ncol=2)
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
        if a.end in (None, "succeeded") or not a.records:
            continue
        if use_time:
            x = ((a.ended or at_seconds(a.records[-1].get("at")) or t0) - t0) / unit
        else:
            x = a.records[-1]["step"]
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
    require_matplotlib()  # before any fetch: a missing extra is said at once
    host = remote.host
    name = session_name(host, session)
    cache = Cache(state_dir, host.name, name)
    fetched = fetch(remote, name, cache)
    attempts = load_attempts(cache, fetched.meta)
    if not attempts:
        raise errors.OpsError(
            f"{host.label}: nothing to plot: session '{name}' has no attempt under "
            f"{fetched.meta.get('session_dir') or host.run_dir}"
        )
    pts = points(attempts, since)
    steps = sorted({p.step for p in pts})
    crashes = sum(1 for a in attempts if a.end not in (None, "succeeded"))
    title = (
        f"{host.name} / {name}: {len(attempts)} attempt(s), {crashes} ended early, steps {steps[0]}..{steps[-1]}"
        if steps
        else f"{host.name} / {name}: no metrics yet"
    )
    if csv_path:
        write_csv(csv_path, pts)
    draw(out, attempts, pts, fetched.meta.get("checkpoints") or [], title=title, use_time=use_time, since=since)
    return Result(out, fetched, attempts, len(pts), (steps[0], steps[-1]) if steps else None)
