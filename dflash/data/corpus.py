"""The corpus pass ``prepare-data`` and ``regen`` share: input formats, resumable shards, drop records.

Both read a chat corpus (JSONL, a JSON array, parquet or a ``datasets`` ``save_to_disk`` folder) record by
record and write their output resumably, one shard at a time:

- input formats: anything but JSON lines is converted into ``WORK/input.jsonl`` (record k is line k;
  ``as_json_lines``; again when the input changed: ``WORK/input.source.json`` keys it on the input's size,
  mtime and sha256), so a shard is a byte range of one file of lines (``shard_ranges``: the input's sha256,
  line count and ranges of ``shard_lines`` lines, in one read);
- resumable parts: ``WORK/plan.json`` says what the parts were made from (``start_parts``: another plan
  starts over); shard s is written to ``WORK/parts/part-s.tmp`` and renamed to ``part-s`` when complete
  (``fresh_part``, ``finish_part``), so a killed run again skips the shards done (``pending``);
- drop records: a shard's ``part.json`` holds its counts, the line numbers of the records it dropped per
  reason and each reason's message; ``merge_part`` adds them up (``DROP_LINES_KEPT`` lines kept per reason),
  ``drops_by_row`` restates them as 0-based rows for tabular input, ``drop_lines`` is the "dropped N"
  summary the commands print.

What a shard does with its records (render tokens, regenerate answers) is the command's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.errors import InputError

MAX_LINE_BYTES = 4 << 20  # a longer line is dropped unparsed: no conversation that long fits max_len
LINE_TOO_LONG = f"a line longer than {MAX_LINE_BYTES >> 20} MiB"  # its drop message
DROP_LINES_KEPT = 100  # line numbers kept per drop reason
DATASETS_HINT = "pip install 'dflash[datasets]'"


class CorpusError(InputError, ValueError):
    """The input cannot be read as a corpus; one line that starts with the command's name."""


# --------------------------------------------------------------------------------------------
# Input formats


def tabular_kind(src: Path, *, command: str) -> str:
    """ "parquet", "datasets" (a ``save_to_disk`` folder) or "" (JSON lines / a JSON array)."""
    if src.is_dir():
        if (src / "dataset_dict.json").is_file():
            info = _read_json(src / "dataset_dict.json", command)
            splits = [str(x) for x in info.get("splits") or []] if isinstance(info, dict) else []
            raise CorpusError(
                f"{command}: --in {src} holds several splits ({', '.join(splits)}): give one "
                f"split's folder, e.g. {src / (splits[0] if splits else 'train')}"
            )
        if not (src / "dataset_info.json").is_file() and not (src / "state.json").is_file():
            raise CorpusError(
                f"{command}: --in {src} is a folder but not a dataset saved with save_to_disk "
                "(no state.json); give a JSONL, JSON or parquet file or such a folder"
            )
        return "datasets"
    try:
        fd = inputs.open_regular(src, f"{command}: --in")  # a FIFO would block here
    except inputs.InputFileError as e:
        raise CorpusError(str(e)) from None
    with os.fdopen(fd, "rb") as f:
        magic = f.read(4)
    return "parquet" if magic == b"PAR1" or src.suffix == ".parquet" else ""


def _read_json(path: Path, command: str) -> t.Any:
    try:
        return inputs.read_json(path, f"{command}: --in")
    except inputs.InputFileError as e:
        raise CorpusError(str(e)) from None


def source_key(src: Path) -> dict[str, t.Any]:
    """What identifies the input a conversion was made from: its size, mtime and sha256 (a folder: of its
    files, by relative path)."""
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else [src]
    h = hashlib.sha256()
    size = mtime = 0
    for p in files:
        st = p.stat()
        size += st.st_size
        mtime = max(mtime, st.st_mtime_ns)
        if src.is_dir():
            h.update(f"{p.relative_to(src)}\0{st.st_size}\0".encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
    return {"path": str(src.resolve()), "size": size, "mtime_ns": mtime, "sha256": h.hexdigest()}


def as_json_lines(
    src: Path,
    tabular: str | None,
    head: bytes,
    work: Path,
    *,
    command: str,
    log: t.Callable[[str], None] = lambda m: None,
) -> Path:
    """``src`` as JSON lines (record k is line k): itself, or a JSON array / parquet / datasets folder
    converted into ``work/input.jsonl`` (prepare-data and regen, both resumable, reuse it while
    ``work/input.source.json`` says it was made from the same input: size, mtime and sha256)."""
    if not (tabular or head.startswith(b"[")):
        return src
    work.mkdir(parents=True, exist_ok=True)
    lines, stamp = work / "input.jsonl", work / "input.source.json"
    key = source_key(src)
    try:  # bounded: a stamp 100,000 levels deep is another input's, not a RecursionError
        made = inputs.read_json(stamp, "input.source.json") if lines.is_file() else None
    except inputs.InputFileError:
        made = None
    if made == key:
        return lines
    if lines.is_file():
        log(f"{command}: --in {src} changed since {work} was made from it: converting it again")
    stamp.unlink(missing_ok=True)  # first: a conversion killed midway is never taken for a complete one
    tmp = work / "input.jsonl.tmp"
    if tabular:
        _rows_to_jsonl(src, tabular, tmp, command)
    else:
        _json_array_to_jsonl(src, tmp, command)
    os.replace(tmp, lines)
    stamp.write_text(json.dumps(key))
    return lines


_WS = re.compile(r"[ \t\n\r]*")


def _ws(text: str, i: int) -> int:
    """The first position at or after ``i`` that is not JSON whitespace."""
    m = _WS.match(text, i)
    return m.end() if m else i


_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string, or a bracket


def _skip_value(text: str, i: int) -> int:
    """The end of the array or object at ``i`` that the parser could not take (nested too deeply): its
    brackets counted, strings skipped."""
    depth = 0
    for m in _TOKEN.finditer(text, i):
        tok = m.group()
        if tok in "[{":
            depth += 1
        elif tok in "]}":
            depth -= 1
            if depth == 0:
                return m.end()
    raise ValueError("unterminated")


def _json_array_to_jsonl(src: Path, dest: Path, command: str) -> None:
    """Record k of the array becomes line k, as its own text on one line (JSON has no raw newline inside a
    string): each record is then read, and dropped with its number when bad, like a JSON line. A record
    nested too deeply for the parser is found by its brackets and kept as it is (its line is dropped)."""
    try:
        text = inputs.without_bom(inputs.read_bytes(src, f"{command}: --in")).decode("utf-8")
    except inputs.InputFileError as e:
        raise CorpusError(str(e)) from None
    except UnicodeDecodeError as e:
        raise CorpusError(f"{command}: {src} is not valid JSON: not UTF-8 (byte {e.start})") from None
    decoder = json.JSONDecoder()
    i = _ws(text, 0)
    if not text.startswith("[", i):
        raise CorpusError(f"{command}: {src}: expected a JSON array of records or JSON lines")
    i = _ws(text, i + 1)
    with open(dest, "w") as f:
        if text.startswith("]", i):
            i += 1
        else:
            while True:
                try:
                    _, end = decoder.raw_decode(text, i)
                except RecursionError:
                    try:
                        end = _skip_value(text, i)
                    except ValueError:
                        raise CorpusError(f"{command}: {src} is not valid JSON: a record never ends") from None
                except json.JSONDecodeError as e:
                    raise CorpusError(f"{command}: {src} is not valid JSON: {e}") from None
                f.write(text[i:end].replace("\n", " ").replace("\r", " ") + "\n")
                i = _ws(text, end)
                if text.startswith(",", i):
                    i = _ws(text, i + 1)
                    continue
                if text.startswith("]", i):
                    i += 1
                    break
                raise CorpusError(f"{command}: {src} is not valid JSON: expected ',' or ']' at char {i}")
    if _ws(text, i) != len(text):
        raise CorpusError(f"{command}: {src} is not valid JSON: extra data after the array (char {i})")


def _rows_to_jsonl(src: Path, kind: str, dest: Path, command: str) -> None:
    """Row k of a parquet file or datasets folder becomes line k + 1, in batches (memory: one batch)."""
    try:  # the optional [datasets] extra (pyarrow comes with it): imported only for such input
        if kind == "parquet":
            import pyarrow.parquet as pq
        else:
            import datasets
    except ImportError:
        raise CorpusError(f"{command}: reading {kind} input needs the datasets extra: {DATASETS_HINT}") from None
    try:
        if kind == "parquet":
            batches: t.Iterable[t.Any] = (b.to_pylist() for b in pq.ParquetFile(src).iter_batches(batch_size=1024))
        else:
            datasets.disable_progress_bars()  # a many-shard folder's "Loading dataset from disk" bar: noise in stderr
            ds = datasets.load_from_disk(str(src))
            batches = ([dict(zip(b, row)) for row in zip(*b.values())] for b in ds.iter(batch_size=1024))
        with open(dest, "w") as f:
            for rows in batches:
                f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    except CorpusError:
        raise
    except Exception as e:  # a broken file: pyarrow and datasets raise many kinds; one line, never a traceback
        raise CorpusError(
            f"{command}: --in {src}: cannot read it as {kind}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None


# --------------------------------------------------------------------------------------------
# Shards and resumable parts


def shard_ranges(src: Path, shard_lines: int) -> tuple[str, int, list[tuple[int, int, int]]]:
    """sha256, line count and shard byte ranges ``(start, end, first_line)`` of the input, in one read."""
    h = hashlib.sha256()
    ranges: list[tuple[int, int, int]] = []
    offset = start = 0
    lines = 0
    with open(src, "rb") as f:
        for raw in iter(lambda: f.readline(1 << 20), b""):
            h.update(raw)
            offset += len(raw)
            if raw.endswith(b"\n") or len(raw) < (1 << 20):
                lines += 1
                if lines % shard_lines == 0:
                    ranges.append((start, offset, lines - shard_lines + 1))
                    start = offset
    if offset > start:
        ranges.append((start, offset, (lines // shard_lines) * shard_lines + 1))
    return h.hexdigest(), lines, ranges


@dataclasses.dataclass(frozen=True, slots=True)
class ShardJob:
    index: int
    src: str
    start: int  # byte offsets
    end: int
    first_line: int  # 1-based line number of the first line
    lines: int
    part: str  # the finished part folder


def start_parts(work: Path, plan: dict[str, t.Any], *, command: str, log: t.Callable[[str], None]) -> Path:
    """``work/parts``, kept when ``work/plan.json`` is this plan, else emptied (parts of another input or setting)."""
    plan_path, parts = work / "plan.json", work / "parts"
    if plan_path.exists():
        try:  # written by an earlier run, perhaps of another version, perhaps cut short: read bounded
            made = inputs.read_json(plan_path, "plan.json")
        except inputs.InputFileError as e:
            log(f"{command}: {e}: starting over")
            shutil.rmtree(parts, ignore_errors=True)
        else:
            if made != plan:
                log(f"{command}: {work} holds parts of another input or setting: starting over")
                shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir(exist_ok=True)
    plan_path.write_text(json.dumps(plan, indent=1))
    return parts


def shard_jobs(lines_src: Path, ranges: list[tuple[int, int, int]], nlines: int, parts: Path) -> list[ShardJob]:
    jobs = []
    for i, (a, b, first) in enumerate(ranges):
        last = ranges[i + 1][2] - 1 if i + 1 < len(ranges) else nlines
        jobs.append(ShardJob(i, str(lines_src), a, b, first, last - first + 1, str(parts / f"part-{i:06d}")))
    return jobs


def pending(jobs: list[ShardJob], *, command: str, log: t.Callable[[str], None]) -> list[ShardJob]:
    """The jobs whose part is not complete yet (a resumed run says how many are done)."""
    todo = []
    for j in jobs:
        if Path(j.part).is_dir():
            problem = read_part(Path(j.part))[1]
            if problem is None:
                continue
            log(f"{command}: {problem}: making that shard again")
            shutil.rmtree(j.part)
        todo.append(j)
    if len(todo) < len(jobs):
        log(f"{command}: resuming: {len(jobs) - len(todo)} of {len(jobs)} shards already done")
    return todo


def read_lines(job: ShardJob) -> t.Iterator[tuple[int, bytes | None]]:
    """(line number, line) of the shard's lines, blank ones included; None for a line over MAX_LINE_BYTES
    (skipped unread)."""
    with open(job.src, "rb") as f:
        f.seek(job.start)
        lineno = job.first_line - 1
        while f.tell() < job.end:
            lineno += 1
            raw = f.readline(MAX_LINE_BYTES + 1)
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line unread
                    raw = f.readline(MAX_LINE_BYTES)
                yield lineno, None
                continue
            yield lineno, raw


def fresh_part(job: ShardJob) -> Path:
    """The shard's ``.tmp`` folder, empty."""
    tmp = Path(job.part + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_part(
    tmp: Path, job: ShardJob, counts: dict[str, int], drops: dict[str, list[int]], messages: dict[str, str]
) -> None:
    """The part's record (``part.json``), then the rename that makes it complete."""
    (tmp / "part.json").write_text(json.dumps({"counts": counts, "drops": drops, "messages": messages}))
    os.replace(tmp, job.part)


# --------------------------------------------------------------------------------------------
# Drop records


def read_part(part: Path) -> tuple[dict[str, t.Any] | None, str | None]:
    """A finished part's ``part.json``, read bounded and field by field: (it, None), or (None, why not)."""
    try:
        rec = inputs.read_record(part / "part.json", "part.json")
        counts = rec.record("counts")
        for k in counts.data:
            counts.integer(k, lo=-1)  # max_token_id: -1 for a shard without tokens
        drops = rec.record("drops")
        for k, lines in drops.data.items():
            if not isinstance(lines, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in lines):
                drops.bad(k, "a list of line numbers")
        messages = rec.record("messages")
        for k in messages.data:
            messages.text(k)
    except (inputs.InputFileError, inputs.RecordError) as e:
        return None, str(e)
    return dict(rec.data), None


def merge_part(
    part: Path, counts: dict[str, int], drops: dict[str, dict[str, t.Any]], *, maxed: t.Collection[str] = ()
) -> None:
    """Add a part's counts (the largest for the keys in ``maxed``) and drops into the totals."""
    info, problem = read_part(part)
    if info is None:
        raise inputs.RecordError(str(problem))
    for k in info["counts"]:
        if k not in counts:
            raise inputs.RecordError(f"{part / 'part.json'}: counts.{k} is no count this command keeps")
    for k, v in info["counts"].items():
        counts[k] = max(counts[k], v) if k in maxed else counts[k] + v
    for reason, lines in info["drops"].items():
        d = drops.setdefault(reason, {"count": 0, "lines": [], "message": info["messages"].get(reason, "")})
        d["count"] += len(lines)
        d["lines"] = sorted(d["lines"] + lines)[:DROP_LINES_KEPT]


def drops_by_row(drops: dict[str, dict[str, t.Any]]) -> None:
    """Tabular input: drops by row (0-based, as ds[k] and the parquet row), not by line of our conversion."""
    for d in drops.values():
        d["rows"] = [line - 1 for line in d.pop("lines")]


def drop_lines(command: str, drops: t.Mapping[str, t.Mapping[str, t.Any]]) -> list[str]:
    """The summary a command prints: one "dropped N" line per reason, with the first lines (or rows)."""
    out = []
    for reason, d in drops.items():
        unit = "row" if "rows" in d else "line"  # parquet / datasets input: rows
        more = " ..." if d["count"] > len(d[unit + "s"]) else ""
        out.append(
            f"{command}: dropped {d['count']} {reason}: {d['message']} ({unit} "
            f"{', '.join(map(str, d[unit + 's'][:10]))}{more})"
        )
    return out


__all__ = [
    "DATASETS_HINT",
    "DROP_LINES_KEPT",
    "LINE_TOO_LONG",
    "MAX_LINE_BYTES",
    "CorpusError",
    "ShardJob",
    "as_json_lines",
    "source_key",
    "drop_lines",
    "drops_by_row",
    "finish_part",
    "fresh_part",
    "merge_part",
    "read_part",
    "pending",
    "read_lines",
    "shard_jobs",
    "shard_ranges",
    "start_parts",
    "tabular_kind",
]
