"""The token store (``dflash prepare-data``): a chat corpus rendered once, memory-mapped by ``dflash train``.

Layout of a store folder (written as ``OUT.partial/``, renamed to ``OUT`` when complete)::

    tokens.bin        uint32, every sequence's tokens back to back
    loss_mask.bin     uint8, one per token (1: supervised)
    offsets.bin       int64, n + 1 (sequence i is tokens[offsets[i]:offsets[i+1]])
    first_anchor.bin  int32, per sequence: the first p with loss_mask[p] and loss_mask[p+1]
    token_counts.bin  int64, per token id: how often it occurs (the MASK-id check without a scan)
    meta.json         source sha256, tokenizer + template hash, kwargs, counts, lengths histogram, drops

Preparing is parallel and resumable: the input is cut into shards of ``shard_lines`` lines; a worker
process writes shard s to ``parts/part-s.tmp`` and renames it to ``parts/part-s`` when complete, so a
killed prepare run again skips the shards already done (when the input, tokenizer, template, kwargs and
max length are the same: ``plan.json``); the parts are then concatenated.

Opening a store reads meta.json and maps the arrays: O(1) in the corpus size. ``dflash train`` reads the
lengths from the offsets as needed (``StoreLengths``) and plans batches one window at a time
(``WindowPlan``): start-up and memory do not grow with the corpus.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import dataclasses
import hashlib
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import signal
import time
import typing as t
from pathlib import Path

import numpy as np

from dflash.chat import BadRecord, Renderer, parse_record, record_sequences, template_hash, tokenizer_hash
from dflash.errors import InputError

STORE_FORMAT = "dflash-token-store/1"
MAX_LINE_BYTES = 4 << 20  # a longer line is dropped unparsed: no conversation that long fits max_len
DROP_LINES_KEPT = 100  # line numbers kept per drop reason in meta.json
DIE_AFTER_ENV = "DFLASH_PREPARE_DIE_AFTER_SHARDS"  # test hook: SIGKILL prepare once N shards are done


class StoreError(InputError, ValueError):
    """A store that cannot be made or used; one line for the user."""


def has_anchor_at(mask: np.ndarray) -> int:
    both = np.flatnonzero(mask[:-1] & mask[1:])
    return int(both[0]) if both.size else -1


# --------------------------------------------------------------------------------------------
# Reading


class TokenStore:
    """A store folder, memory-mapped. ``read(i)`` -> (input_ids, loss_mask) numpy views."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"data.path: {self.path} is not a token store (meta.json: {e})") from None
        if self.meta.get("format") != STORE_FORMAT:
            raise StoreError(f"data.path: {self.path}: unknown store format {self.meta.get('format')!r}")
        n = int(self.meta["counts"]["sequences"])
        self.offsets = self._map("offsets.bin", np.int64, n + 1)
        total = int(self.offsets[-1]) if n else 0
        self.tokens = self._map("tokens.bin", np.uint32, total)
        self.loss_mask = self._map("loss_mask.bin", np.uint8, total)
        self.first_anchor = self._map("first_anchor.bin", np.int32, n)

    def _map(self, name: str, dtype: t.Any, count: int) -> np.ndarray:
        p = self.path / name
        want = count * np.dtype(dtype).itemsize
        size = p.stat().st_size if p.is_file() else -1
        if size != want:
            raise StoreError(
                f"data.path: {p}: expected {want} bytes, found {'none' if size < 0 else size} "
                "(an incomplete store; run dflash prepare-data again)"
            )
        if count == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(p, dtype=dtype, mode="r", shape=(count,))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def read(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]

    def token_count(self, token_id: int) -> int:
        p = self.path / "token_counts.bin"
        size = p.stat().st_size // 8
        if token_id >= size:
            return 0
        return int(np.memmap(p, dtype=np.int64, mode="r", shape=(size,))[token_id])

    def check_target(
        self,
        tokenizer: t.Any,
        kwargs: t.Mapping[str, t.Any] | None,
        *,
        vocab_size: int | None,
        mask_token_id: int | None,
    ) -> None:
        """Refuse (one line) a store made for another tokenizer, template or vocabulary."""
        made = self.meta.get("tokenizer") or {}
        name = self.path.name
        if tokenizer is not None and made.get("sha256"):
            mine = tokenizer_hash(tokenizer)
            if mine != made["sha256"]:
                raise StoreError(
                    f"data.path: the token store {name} was made for another tokenizer "
                    f"({made.get('name')}, sha256 {made['sha256'][:12]}; the target's is {mine[:12]}): "
                    "run dflash prepare-data again for this target"
                )
            if made.get("template_sha256") and template_hash(tokenizer) != made["template_sha256"]:
                raise StoreError(
                    f"data.path: the token store {name} was rendered with another chat template "
                    "than the target's: run dflash prepare-data again for this target"
                )
            if (
                kwargs is not None
                and made.get("template_sha256")
                and dict(kwargs) != self.meta.get("chat_template_kwargs", {})
            ):
                raise StoreError(
                    f"data.path: the token store {name} was rendered with chat_template_kwargs "
                    f"{json.dumps(self.meta.get('chat_template_kwargs', {}))}, the run asks for "
                    f"{json.dumps(dict(kwargs))}: run dflash prepare-data again"
                )
        top = int(self.meta["counts"].get("max_token_id", -1))
        if vocab_size is not None and top >= vocab_size:
            raise StoreError(
                f"data.path: the token store {name} has token id {top}, outside the target "
                f"vocabulary ({vocab_size}): it was made for another target"
            )
        if mask_token_id is not None and self.token_count(mask_token_id):
            raise StoreError(
                f"data.path: the token store {name} uses token {mask_token_id}, the MASK id "
                "(drafter.mask_token_id); MASK must be an unused row of the target vocabulary"
            )

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.path.name.encode())
        for k in ("source", "tokenizer", "counts", "max_len"):
            h.update(json.dumps(self.meta.get(k), sort_keys=True).encode())
        return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Preparing


@dataclasses.dataclass(frozen=True, slots=True)
class PrepareSpec:
    src: str
    out: str
    tokenizer_path: str | None
    kwargs: dict[str, t.Any]
    max_len: int
    workers: int = 1
    strict: bool = False
    shard_lines: int = 10_000


@dataclasses.dataclass(frozen=True, slots=True)
class ShardJob:
    index: int
    src: str
    start: int  # byte offsets
    end: int
    first_line: int  # 1-based line number of the first line
    part: str  # final part folder


_RENDERER: Renderer | None = None


def _init_worker(tokenizer_path: str | None, kwargs: dict[str, t.Any]) -> None:
    """A pool worker: Ctrl-C is the parent's to handle, and the worker dies with its parent."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    try:  # Linux: die with the parent, so a killed prepare leaves no worker behind (and no pipe held open)
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _init_renderer(tokenizer_path, kwargs)


def _init_renderer(tokenizer_path: str | None, kwargs: dict[str, t.Any]) -> None:
    global _RENDERER
    if tokenizer_path is not None:
        from dflash.data import load_tokenizer

        _RENDERER = Renderer(load_tokenizer(tokenizer_path), kwargs)
    else:
        _RENDERER = None


def _die_after(done: int) -> None:
    """The test hook: a real SIGKILL of the prepare process once ``done`` shards reach DIE_AFTER_ENV."""
    n = int(os.environ.get(DIE_AFTER_ENV, "0") or 0)
    if n and done >= n:
        if mp.parent_process() is not None:  # a pool worker: the parent, then at once itself (PDEATHSIG comes
            os.kill(os.getppid(), signal.SIGKILL)  # only once the parent is gone: time for another shard)
        os.kill(os.getpid(), signal.SIGKILL)


def _pool_shard(job: ShardJob, max_len: int) -> None:
    """``run_shard`` in a pool worker. The test hook fires here, right after the rename: from the parent it
    fired only once the parent had seen the result, by when the other workers had often done every shard."""
    run_shard(job, max_len)
    _die_after(sum(1 for p in Path(job.part).parent.iterdir() if not p.name.endswith(".tmp")))


def run_shard(job: ShardJob, max_len: int) -> None:
    """Render one shard's lines into ``job.part`` (written as ``.tmp``, renamed when complete)."""
    tmp = Path(job.part + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    drops: dict[str, list[int]] = {}
    messages: dict[str, str] = {"line-too-long": f"a line longer than {MAX_LINE_BYTES >> 20} MiB"}
    counts = {
        "records": 0,
        "sequences": 0,
        "tokens": 0,
        "supervised": 0,
        "cut": 0,
        "dropped_turns": 0,
        "max_token_id": -1,
    }
    lengths: list[int] = []
    anchors: list[int] = []
    token_counts = np.zeros(0, dtype=np.int64)
    with open(job.src, "rb") as f, open(tmp / "tokens.bin", "wb") as tf, open(tmp / "loss_mask.bin", "wb") as mf:
        f.seek(job.start)
        lineno = job.first_line - 1
        while f.tell() < job.end:
            lineno += 1
            raw = f.readline(MAX_LINE_BYTES + 1)
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # skip the rest of the line unread
                    raw = f.readline(MAX_LINE_BYTES)
                counts["records"] += 1
                drops.setdefault("line-too-long", []).append(lineno)
                continue
            if not raw.strip():
                continue
            counts["records"] += 1
            try:
                rendered = record_sequences(parse_record(raw), _RENDERER)
            except BadRecord as e:
                drops.setdefault(e.reason, []).append(lineno)
                messages.setdefault(e.reason, str(e))
                continue
            counts["dropped_turns"] += rendered.dropped_turns
            kept = 0
            for seq in rendered.sequences:
                ids = np.asarray(seq.input_ids, dtype=np.uint32)
                mask = np.asarray(seq.loss_mask, dtype=np.uint8)
                if len(ids) > max_len:
                    ids, mask = ids[:max_len], mask[:max_len]
                    counts["cut"] += 1
                first = has_anchor_at(mask)
                if first < 0:
                    continue
                kept += 1
                tf.write(ids.tobytes())
                mf.write(mask.tobytes())
                lengths.append(len(ids))
                anchors.append(first)
                counts["tokens"] += len(ids)
                counts["supervised"] += int(mask.sum())
                top = int(ids.max())
                counts["max_token_id"] = max(counts["max_token_id"], top)
                if top >= len(token_counts):
                    token_counts = np.concatenate([token_counts, np.zeros(top + 1 - len(token_counts), np.int64)])
                token_counts[: top + 1] += np.bincount(ids, minlength=top + 1)
            if kept:
                counts["sequences"] += kept
            else:
                drops.setdefault("no-anchor", []).append(lineno)
                messages.setdefault("no-anchor", "no two consecutive supervised tokens (nothing to learn)")
    np.asarray(lengths, dtype=np.int64).tofile(tmp / "lengths.bin")
    np.asarray(anchors, dtype=np.int32).tofile(tmp / "first_anchor.bin")
    token_counts.tofile(tmp / "token_counts.bin")
    (tmp / "part.json").write_text(json.dumps({"counts": counts, "drops": drops, "messages": messages}))
    os.replace(tmp, job.part)


def _pass_over(src: Path, shard_lines: int) -> tuple[str, int, list[tuple[int, int, int]]]:
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


def _as_json_lines(src: Path, tabular: str | None, head: bytes, work: Path) -> Path:
    """``src`` as JSON lines (record k is line k): itself, or a JSON array / parquet / datasets folder
    converted once into ``work/input.jsonl`` (prepare-data and regen, both resumable, reuse it)."""
    if not (tabular or head.startswith(b"[")):
        return src
    work.mkdir(parents=True, exist_ok=True)
    lines = work / "input.jsonl"
    if not lines.is_file():
        tmp = work / "input.jsonl.tmp"
        if tabular:
            _rows_to_jsonl(src, tabular, tmp)
        else:
            _json_array_to_jsonl(src, tmp)
        os.replace(tmp, lines)
    return lines


def _json_array_to_jsonl(src: Path, dest: Path) -> None:
    try:
        data = json.loads(src.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(f"prepare-data: {src} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise StoreError(f"prepare-data: {src}: expected a JSON array of records or JSON lines")
    with open(dest, "w") as f:
        for rec in data:  # record k of the array becomes line k
            f.write(json.dumps(rec) + "\n")


DATASETS_HINT = "pip install 'dflash[datasets]'"


def _tabular_kind(src: Path) -> str:
    """ "parquet", "datasets" (a ``save_to_disk`` folder) or "" (JSON lines / a JSON array)."""
    if src.is_dir():
        if (src / "dataset_dict.json").is_file():
            splits = json.loads((src / "dataset_dict.json").read_text()).get("splits", [])
            raise StoreError(
                f"prepare-data: --in {src} holds several splits ({', '.join(splits)}): give one "
                f"split's folder, e.g. {src / (splits[0] if splits else 'train')}"
            )
        if not (src / "dataset_info.json").is_file() and not (src / "state.json").is_file():
            raise StoreError(
                f"prepare-data: --in {src} is a folder but not a dataset saved with save_to_disk "
                "(no state.json); give a JSONL, JSON or parquet file or such a folder"
            )
        return "datasets"
    with src.open("rb") as f:
        magic = f.read(4)
    return "parquet" if magic == b"PAR1" or src.suffix == ".parquet" else ""


def _rows_to_jsonl(src: Path, kind: str, dest: Path) -> None:
    """Row k of a parquet file or datasets folder becomes line k + 1, in batches (memory: one batch)."""
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq
        else:
            import datasets
    except ImportError:
        raise StoreError(f"prepare-data: reading {kind} input needs the datasets extra: {DATASETS_HINT}") from None
    try:
        if kind == "parquet":
            batches: t.Iterable[t.Any] = (b.to_pylist() for b in pq.ParquetFile(src).iter_batches(batch_size=1024))
        else:
            ds = datasets.load_from_disk(str(src))
            batches = ([dict(zip(b, row)) for row in zip(*b.values())] for b in ds.iter(batch_size=1024))
        with open(dest, "w") as f:
            for rows in batches:
                f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    except StoreError:
        raise
    except Exception as e:  # a broken file: pyarrow and datasets raise many kinds; one line, never a traceback
        raise StoreError(
            f"prepare-data: --in {src}: cannot read it as {kind}: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def _histogram(lengths: np.ndarray) -> dict[str, int]:
    out: dict[str, int] = {}
    lo = 0
    hi = 64
    while lo <= (int(lengths.max()) if lengths.size else 0):
        c = int(((lengths > lo) & (lengths <= hi)).sum())
        if c:
            out[f"{lo + 1}-{hi}"] = c
        lo, hi = hi, hi * 2
    return out


def prepare(spec: PrepareSpec, *, log: t.Callable[[str], None] = print) -> dict[str, t.Any]:
    """Render ``spec.src`` into the store ``spec.out``; returns meta.json's content. StoreError: one line."""
    t0 = time.monotonic()
    src, out = Path(spec.src), Path(spec.out)
    if not src.is_file() and not src.is_dir():
        raise StoreError(f"prepare-data: --in {src}: no such file")
    if (out / "meta.json").is_file():
        raise StoreError(f"prepare-data: --out {out} is already a token store; remove it or choose another folder")
    tabular = _tabular_kind(src)  # parquet / a datasets folder: rows, streamed to JSON lines like a JSON array
    work = Path(str(out) + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    head = b"" if tabular else src.open("rb").read(4096).lstrip()
    if not head and not tabular:
        raise StoreError(f"prepare-data: --in {src} is empty: no conversations")
    lines_src = _as_json_lines(src, tabular, head, work)
    if tabular and not lines_src.stat().st_size:
        raise StoreError(f"prepare-data: --in {src} has no rows: no conversations")
    sha, nlines, ranges = _pass_over(lines_src, spec.shard_lines)
    tok_info: dict[str, t.Any] = {}
    if spec.tokenizer_path is not None:
        from dflash.data import load_tokenizer

        tok = load_tokenizer(spec.tokenizer_path)
        tok_info = {
            "name": spec.tokenizer_path,
            "sha256": tokenizer_hash(tok),
            "template_sha256": template_hash(tok),
            "vocab_size": len(tok),
            "eos_token": getattr(tok, "eos_token", None),
        }
    plan = {
        "source_sha256": sha,
        "tokenizer": tok_info,
        "chat_template_kwargs": spec.kwargs,
        "max_len": spec.max_len,
        "shard_lines": spec.shard_lines,
        "format": STORE_FORMAT,
    }
    plan_path = work / "plan.json"
    parts = work / "parts"
    if plan_path.is_file() and json.loads(plan_path.read_text()) != plan:
        log(f"prepare-data: {work} holds parts of another input or setting: starting over")
        shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir(exist_ok=True)
    plan_path.write_text(json.dumps(plan, indent=1))
    jobs = [
        ShardJob(i, str(lines_src), a, b, first, str(parts / f"part-{i:06d}")) for i, (a, b, first) in enumerate(ranges)
    ]
    todo = [j for j in jobs if not Path(j.part).is_dir()]
    if len(todo) < len(jobs):
        log(f"prepare-data: resuming: {len(jobs) - len(todo)} of {len(jobs)} shards already done")
    if spec.workers <= 1 or len(todo) <= 1:
        # in this process: never _init_worker, whose SIG_IGN for Ctrl-C every later child would inherit
        _init_renderer(spec.tokenizer_path, spec.kwargs)
        for done, j in enumerate(todo, 1):
            run_shard(j, spec.max_len)
            _die_after(done)
    else:
        ctx = mp.get_context("spawn")  # no fork of a process that holds torch and tokenizer threads
        with cf.ProcessPoolExecutor(
            spec.workers, mp_context=ctx, initializer=_init_worker, initargs=(spec.tokenizer_path, spec.kwargs)
        ) as pool:
            futures = [pool.submit(_pool_shard, j, spec.max_len) for j in todo]
            for fut in cf.as_completed(futures):
                fut.result()
    meta = _concatenate(work, jobs, spec, plan, src, nlines)
    meta["source"]["kind"] = tabular or ("json" if lines_src != src else "jsonl")
    if tabular:  # drops by row (0-based, as ds[k] and the parquet row), not by line of our conversion
        meta["source"]["bytes"] = (
            sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) if src.is_dir() else src.stat().st_size
        )
        for d in meta["drops"].values():
            d["rows"] = [line - 1 for line in d.pop("lines")]
    if not meta["counts"]["sequences"]:
        reasons = ", ".join(f"{d['count']} {r}" for r, d in meta["drops"].items()) or "no records"
        raise StoreError(f"prepare-data: no usable sequences in {src} ({reasons})")
    if spec.strict and meta["counts"]["dropped"]:
        unit = "row" if tabular else "line"
        first = min((d[unit + "s"][0], reason) for reason, d in meta["drops"].items())
        msg = meta["drops"][first[1]].get("message", first[1])
        raise StoreError(
            f"prepare-data: {unit} {first[0]}: {msg} ({first[1]}; --strict; "
            f"{meta['counts']['dropped']} records dropped in all)"
        )
    shutil.rmtree(parts)
    (work / "plan.json").unlink()
    if lines_src != src:
        lines_src.unlink()
    (work / "meta.json").write_text(json.dumps(meta, indent=1))  # last: a store with meta.json is complete
    os.replace(work, out)
    meta["seconds"] = time.monotonic() - t0
    return meta


def _concatenate(
    work: Path, jobs: list[ShardJob], spec: PrepareSpec, plan: dict[str, t.Any], src: Path, nlines: int
) -> dict[str, t.Any]:
    counts = {
        "records": 0,
        "sequences": 0,
        "tokens": 0,
        "supervised": 0,
        "cut": 0,
        "dropped_turns": 0,
        "max_token_id": -1,
    }
    drops: dict[str, dict[str, t.Any]] = {}
    token_counts = np.zeros(0, dtype=np.int64)
    lengths_all = []
    with (
        open(work / "tokens.bin", "wb") as tf,
        open(work / "loss_mask.bin", "wb") as mf,
        open(work / "first_anchor.bin", "wb") as af,
    ):
        for j in jobs:
            p = Path(j.part)
            info = json.loads((p / "part.json").read_text())
            for k, v in info["counts"].items():
                counts[k] = max(counts[k], v) if k == "max_token_id" else counts[k] + v
            for reason, lines in info["drops"].items():
                d = drops.setdefault(reason, {"count": 0, "lines": [], "message": info["messages"].get(reason, "")})
                d["count"] += len(lines)
                d["lines"] = (d["lines"] + lines)[:DROP_LINES_KEPT]
            for name, fh in (("tokens.bin", tf), ("loss_mask.bin", mf), ("first_anchor.bin", af)):
                with open(p / name, "rb") as f:
                    shutil.copyfileobj(f, fh, 1 << 22)
            lengths_all.append(np.fromfile(p / "lengths.bin", dtype=np.int64))
            tc = np.fromfile(p / "token_counts.bin", dtype=np.int64)
            if len(tc) > len(token_counts):
                token_counts = np.concatenate([token_counts, np.zeros(len(tc) - len(token_counts), np.int64)])
            token_counts[: len(tc)] += tc
    lengths = np.concatenate(lengths_all) if lengths_all else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    offsets.tofile(work / "offsets.bin")
    token_counts.tofile(work / "token_counts.bin")
    counts["dropped"] = sum(d["count"] for d in drops.values())
    counts["lines"] = nlines
    return {
        "format": STORE_FORMAT,
        "source": {
            "path": str(src.resolve()),
            "sha256": plan["source_sha256"],
            "bytes": src.stat().st_size if src.is_file() else 0,
        },
        "tokenizer": plan["tokenizer"],
        "chat_template_kwargs": spec.kwargs,
        "max_len": spec.max_len,
        "counts": counts,
        "lengths_histogram": _histogram(lengths),
        "max_length": int(lengths.max()) if lengths.size else 0,
        "drops": dict(sorted(drops.items())),
    }


class StoreLengths:
    """Per usable sequence of a store its length cut to ``max_length``, read from the offsets memmap as needed.

    ``lengths[idx]`` (an index array) gathers; ``len``, ``max`` and ``dtype`` are O(1). Only a run whose
    ``max_length`` is below the store's longest sequence pays one pass over ``first_anchor`` (4 bytes per
    sequence) to leave out the sequences whose first anchor the cut loses; ``np.asarray`` materializes.
    """

    dtype = np.dtype(np.int64)

    def __init__(self, store: TokenStore, max_length: int) -> None:
        self.offsets = store.offsets
        self.max_length = max_length
        n = len(store)
        longest = int(store.meta.get("max_length", -1))
        if longest < 0 and n:  # a store without the key (older): one pass
            longest = int(np.diff(store.offsets).max())
        self.index: np.ndarray | None = None
        if longest > max_length and n:
            keep = np.asarray(store.first_anchor) + 2 <= max_length  # a cut sequence keeps an anchor
            if not keep.all():
                self.index = np.flatnonzero(keep)
        self._len = n if self.index is None else len(self.index)
        self._max = min(longest, max_length) if n else 0

    def __len__(self) -> int:
        return self._len

    def max(self) -> int:
        return self._max

    def store_index(self, i: t.Any) -> t.Any:
        return i if self.index is None else self.index[i]

    def __getitem__(self, i: t.Any) -> t.Any:
        j = np.asarray(self.store_index(i), dtype=np.int64)
        return np.minimum(self.offsets[j + 1] - self.offsets[j], self.max_length)

    def __array__(self, dtype: t.Any = None, copy: t.Any = None) -> np.ndarray:
        out = self[np.arange(self._len)]
        return out if dtype is None else out.astype(dtype)


def store_lengths(store: TokenStore, max_length: int) -> StoreLengths:
    return StoreLengths(store, max_length)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9))


class Permutation:
    """A seeded pseudo-random permutation of ``range(n)``, evaluated at any positions in O(positions).

    A 4-round Feistel network on ``Z_a x Z_b`` (a ~ b ~ sqrt(n), a * b >= n; each round maps (L, R) to
    (R, (L + F(R)) mod |L's range|), invertible, so a bijection), with cycle-walking (apply again while the
    value is >= n, rare: a * b - n < a): a bijection of ``range(n)``, and nothing is built over n.
    """

    def __init__(self, n: int, key: t.Sequence[int]) -> None:
        self.n = n
        self.a = math.isqrt(max(n - 1, 0)) + 1
        self.b = -(-n // self.a)
        self.keys = [np.uint64(k & 0xFFFFFFFFFFFFFFFF) for k in key]

    def _once(self, x: np.ndarray) -> np.ndarray:
        mods = (np.uint64(self.a), np.uint64(self.b))
        left, right = x // mods[1], x % mods[1]
        for r, k in enumerate(self.keys):
            f = (right ^ k) * _MIX[0]
            f ^= f >> np.uint64(32)
            f *= _MIX[1]
            f ^= f >> np.uint64(29)
            left, right = right, (left + f % mods[r % 2]) % mods[r % 2]
        return left * mods[1] + right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            x = self._once(np.asarray(positions, dtype=np.uint64))
            out = x >= self.n
            while out.any():  # cycle-walking
                x[out] = self._once(x[out])
                out = x >= self.n
        return x.astype(np.int64)


def cut_window(chunk: list[int], lens: list[int], *, batch_size: int, max_batch_tokens: int) -> list[list[int]]:
    """Greedy batches of a window sorted by length (ascending: each new sample is the longest so far)."""
    window: list[list[int]] = []
    cur: list[int] = []
    for i, n in zip(chunk, lens):
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * n > max_batch_tokens):
            window.append(cur)
            cur = []
        cur.append(i)
    if cur:
        window.append(cur)
    return window


class WindowPlan:
    """The batch plan of a token store, built one window at a time (O(window), never O(corpus)).

    Epoch e orders the samples by a seeded permutation (``Permutation``, evaluated per window); window w
    is positions ``[w * window, (w + 1) * window)`` of that order, sorted by length (stably), cut greedily
    and its batch order shuffled: the list plan's rules. A window's batches are built when a global index
    falls into it (the last 64 kept). When every batch is full (``max_batch_tokens`` at its default,
    ``batch_size`` x the longest) a window's batch count is its size / batch_size, so global index ->
    (epoch, window, batch) is arithmetic. Otherwise per-window counts are kept (one int per window) and
    ``locate`` walks the windows up to the index asked for: a resume far into such a run builds every window
    before its position once (about 0.5 ms each).
    """

    ESTIMATE_WINDOWS = 32  # batches per epoch of a bigger corpus: estimated from this many windows

    def __init__(
        self, lengths: t.Any, *, batch_size: int, max_batch_tokens: int, window: int, shuffle: bool, seed: int
    ) -> None:
        self.lengths = lengths
        self.n = len(lengths)
        self.batch_size, self.max_batch_tokens, self.window = batch_size, max_batch_tokens, window
        self.shuffle, self.seed = shuffle, seed
        self.windows = -(-self.n // window)  # per epoch
        # every batch full (max_batch_tokens at its default, batch_size x longest): counts are arithmetic
        self.full = batch_size * int(lengths.max()) <= max_batch_tokens
        self._perms: dict[int, Permutation] = {}
        self._counts: dict[int, list[int]] = {}  # epoch -> cumulative batch counts of its first windows
        self._starts = [0]  # global index of epoch e's first batch, for the epochs fully counted
        self._cache: dict[tuple[int, int], list[list[int]]] = {}

    def _perm(self, e: int) -> Permutation | None:
        if not self.shuffle:
            return None
        p = self._perms.get(e)
        if p is None:
            key = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, e]).integers(0, 2**63, size=4)
            p = self._perms[e] = Permutation(self.n, [int(k) for k in key])
            for old in [k for k in self._perms if k < e - 2]:
                del self._perms[old]
        return p

    def window_batches(self, e: int, w: int) -> list[list[int]]:
        got = self._cache.get((e, w))
        if got is not None:
            return got
        pos = np.arange(w * self.window, min((w + 1) * self.window, self.n), dtype=np.int64)
        perm = self._perm(e)
        idx = perm(pos) if perm is not None else pos
        lens = np.asarray(self.lengths[idx])
        s = np.argsort(lens, kind="stable")
        batches = self._cut(idx[s].tolist(), lens[s])
        if self.shuffle:
            random.Random((self.seed * 1_000_003 + e) * 1_000_003 + w).shuffle(batches)
        if len(self._cache) >= 64:  # the windows the target threads are in, and a few behind
            del self._cache[next(iter(self._cache))]
        self._cache[(e, w)] = batches
        return batches

    def _cut(self, chunk: list[int], lens: np.ndarray) -> list[list[int]]:
        """``cut_window`` vectorized: k[p], how many samples the greedy batch starting at p takes, for every p."""
        m = len(lens)
        if self.full:
            return [chunk[p : p + self.batch_size] for p in range(0, m, self.batch_size)]
        pos = np.arange(m)
        k = np.ones(m, dtype=np.int64)
        for j in range(2, self.batch_size + 1):
            last = pos + j - 1
            grow = (k == j - 1) & (last < m) & (j * lens[np.minimum(last, m - 1)] <= self.max_batch_tokens)
            if not grow.any():
                break
            k[grow] = j
        takes = k.tolist()
        out = []
        p = 0
        while p < m:
            out.append(chunk[p : p + takes[p]])
            p += takes[p]
        return out

    def _count_to(self, e: int, w: int) -> list[int]:
        """Epoch e's cumulative counts through window w (``counts[w + 1]``: batches in windows 0..w)."""
        counts = self._counts.setdefault(e, [0])
        while len(counts) <= w + 1:
            v = len(counts) - 1
            c = -(-self._window_len(v) // self.batch_size) if self.full else len(self.window_batches(e, v))
            counts.append(counts[-1] + c)
        return counts

    def _window_len(self, w: int) -> int:
        return min(self.window, self.n - w * self.window)

    def epoch_len(self, e: int) -> int:
        if self.full:
            return self.estimate_epoch_len()[0]
        return self._count_to(e, self.windows - 1)[-1]

    def estimate_epoch_len(self) -> tuple[int, bool]:
        """(batches in epoch 0, exact?): exact up to ESTIMATE_WINDOWS windows, else from that many spread
        over the epoch (the full count walks every window: O(corpus))."""
        if self.full:
            full = -(-self.window // self.batch_size)
            return full * (self.windows - 1) + -(-self._window_len(self.windows - 1) // self.batch_size), True
        if self.windows <= self.ESTIMATE_WINDOWS:
            return self.epoch_len(0), True
        ws = np.linspace(0, self.windows - 2, self.ESTIMATE_WINDOWS).round().astype(int)  # full windows
        per = sum(len(self.window_batches(0, int(w))) for w in ws) / len(ws)
        last = len(self.window_batches(0, self.windows - 1))
        return max(1, round(per * (self.windows - 1)) + last), False

    def locate(self, g: int) -> tuple[int, int, int]:
        """(epoch, window, index within the window) of global batch g."""
        if g < 0:
            raise IndexError(g)
        if self.full:  # every window but an epoch's last has the same count: arithmetic, O(1) anywhere
            per_epoch = self.estimate_epoch_len()[0]
            e, j = divmod(g, per_epoch)
            w, k = divmod(j, -(-self.window // self.batch_size))
            return e, w, k
        while True:
            e = bisect.bisect_right(self._starts, g) - 1
            j = g - self._starts[e]
            if e < len(self._starts) - 1:  # an epoch fully counted before (its counts may have been dropped)
                counts = self._count_to(e, self.windows - 1)
                break
            counts = self._count_to(e, 0)
            while counts[-1] <= j and len(counts) <= self.windows:  # count windows until g is in one
                counts = self._count_to(e, len(counts) - 1)
            if counts[-1] > j:
                break
            self._starts.append(self._starts[e] + counts[-1])  # epoch e is complete and g lies beyond it
            for old in [k for k in self._counts if k < e - 2]:
                del self._counts[old]
        w = bisect.bisect_right(counts, j) - 1
        return e, w, j - counts[w]

    def batch(self, g: int) -> list[int]:
        e, w, j = self.locate(g)
        return self.window_batches(e, w)[j]

    def index_in_epoch(self, e: int, w: int, k: int) -> int:
        if self.full:
            return w * -(-self.window // self.batch_size) + k
        return self._count_to(e, w)[w] + k

    def epoch_batch(self, e: int, j: int) -> list[int]:
        if self.full:
            w, k = divmod(j, -(-self.window // self.batch_size))
            return self.window_batches(e, w)[k]
        counts = self._count_to(e, self.windows - 1)
        w = bisect.bisect_right(counts, j) - 1
        return self.window_batches(e, w)[j - counts[w]]


class LazyEpoch:
    """One epoch of a ``WindowPlan`` as a sequence of batches (``len`` counts every window: O(corpus))."""

    def __init__(self, plan: WindowPlan, e: int, lock: t.Any) -> None:
        self.plan, self.e, self.lock = plan, e, lock

    def __len__(self) -> int:
        with self.lock:
            return self.plan.epoch_len(self.e)

    def __getitem__(self, j: int) -> list[int]:
        if not 0 <= j < len(self):
            raise IndexError(j)
        with self.lock:
            return self.plan.epoch_batch(self.e, j)

    def __iter__(self) -> t.Iterator[list[int]]:
        return (self[j] for j in range(len(self)))


def is_store(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / "meta.json").is_file()


__all__ = [
    "LazyEpoch",
    "Permutation",
    "PrepareSpec",
    "StoreError",
    "StoreLengths",
    "TokenStore",
    "WindowPlan",
    "cut_window",
    "is_store",
    "prepare",
    "store_lengths",
]
