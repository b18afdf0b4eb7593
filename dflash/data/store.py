"""The token store (``dflash prepare-data``): a chat corpus rendered once, memory-mapped by ``dflash train``.

Layout of a store folder (written as ``OUT.partial/``, renamed to ``OUT`` when complete)::

    tokens.bin        uint32, every sequence's tokens back to back
    loss_mask.bin     uint8, one per token (1: supervised)
    offsets.bin       int64, n + 1 (sequence i is tokens[offsets[i]:offsets[i+1]])
    first_anchor.bin  int32, per sequence: the first p with loss_mask[p] and loss_mask[p+1]
    token_counts.bin  int64, per token id: how often it occurs (the MASK-id check without a scan)
    meta.json         source sha256, tokenizer + template hash, kwargs, counts, lengths histogram, drops

Preparing is parallel and resumable (the corpus pass of ``dflash.data.corpus``): the input is cut into shards of
``shard_lines`` lines; a worker process writes shard s to ``parts/part-s.tmp`` and renames it to
``parts/part-s`` when complete, so a killed prepare run again skips the shards already done (when the
input, tokenizer, template, kwargs and max length are the same: ``plan.json``); the parts are then
concatenated.

Opening a store (``TokenStore``) reads meta.json and maps the arrays: O(1) in the corpus size; verifying it
for a run (``check_target``) refuses one made for another tokenizer, template or vocabulary. ``dflash
train`` plans its batches one window at a time (``dflash.data.batching``): start-up and memory do not grow with
the corpus.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import signal
import time
import typing as t
from pathlib import Path

import numpy as np

from dflash import inputs, outputs
from dflash.data.chat import (
    BadRecord,
    Renderer,
    load_tokenizer,
    parse_record,
    record_sequences,
    template_hash,
    tokenizer_hash,
)
from dflash.data.corpus import (
    LINE_TOO_LONG,
    CorpusError,
    ShardJob,
    as_json_lines,
    drops_by_row,
    finish_part,
    fresh_part,
    merge_part,
    pending,
    read_lines,
    shard_jobs,
    shard_ranges,
    start_parts,
    tabular_kind,
)
from dflash.errors import InputError

STORE_FORMAT = "dflash-token-store/1"
MAX_SEQUENCES = 1 << 40  # meta.json's sequence count: far above any corpus, far below an overflow
COMMAND = "prepare-data"  # what its messages start with
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
        try:  # a user's folder: its meta.json read bounded, like every JSON a user hands us
            self.meta = inputs.read_json(self.path / "meta.json", "meta.json")
        except inputs.InputFileError as e:
            raise StoreError(f"data.path: {self.path} is not a token store ({e})") from None
        if not isinstance(self.meta, dict):
            raise StoreError(f"data.path: {self.path} is not a token store (meta.json: not a JSON object)")
        if self.meta.get("format") != STORE_FORMAT:
            raise StoreError(f"data.path: {self.path}: unknown store format {inputs.show(self.meta.get('format'))}")
        n = self._check_meta(inputs.as_record(self.meta, str(self.path / "meta.json")))
        self.offsets = self._map("offsets.bin", np.int64, n + 1)
        total = int(self.offsets[-1]) if n else 0
        self._check_offsets(n)
        self.tokens = self._map("tokens.bin", np.uint32, total)
        self.loss_mask = self._map("loss_mask.bin", np.uint8, total)
        self.first_anchor = self._map("first_anchor.bin", np.int32, n)

    def _check_meta(self, meta: inputs.Record) -> int:
        """Every meta.json field the store's readers use, checked (one line naming the key); the sequence count."""
        try:
            counts = meta.record("counts")
            n = counts.integer("sequences", lo=0, hi=MAX_SEQUENCES)
            counts.integer("max_token_id", lo=-1, hi=np.iinfo(np.uint32).max, default=-1)
            meta.integer("max_length", lo=-1, default=-1)
            tok = meta.record("tokenizer", default=None)
            if tok is not None:
                for key in ("sha256", "template_sha256", "name"):
                    tok.text(key, default=None)
            meta.record("chat_template_kwargs", default=None)
        except inputs.RecordError as e:
            raise StoreError(f"data.path: {e} (not what prepare-data writes; run it again)") from None
        return t.cast(int, n)

    def _check_offsets(self, n: int) -> None:
        """offsets.bin starts at 0 and never goes down: else a sample would be another's tokens or none (read
        in chunks: a store of millions of sequences is not copied into memory)."""
        step = 1 << 20
        ok = n == 0 or int(self.offsets[0]) == 0
        for a in range(0, n if ok else 0, step):  # chunks overlap by one: the rise is checked across them
            if (np.diff(np.asarray(self.offsets[a : a + step + 1])) < 0).any():
                ok = False
                break
        if ok:
            return
        raise StoreError(
            f"data.path: {self.path / 'offsets.bin'}: offsets do not start at 0 and rise (a damaged store; "
            "run dflash prepare-data again)"
        )

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
        if not p.is_file() or p.stat().st_size % 8:
            raise StoreError(f"data.path: {p}: missing or not whole int64 counts (an incomplete store)")
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


def is_store(path: str | os.PathLike[str]) -> bool:
    return Path(path).is_dir() and (Path(path) / "meta.json").is_file()


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
    vocab_size: int | None = None  # without a tokenizer: the target's vocabulary (else NO_VOCAB_LIMIT)


NO_VOCAB_LIMIT = 1 << 24  # no tokenizer and no vocabulary given: above every real vocabulary (Gemma: 262144)
PARTS_FORMAT = 2  # what a part holds (2: sparse token counts); parts of another format are made again


_RENDERER: Renderer | None = None


def _init_worker(tokenizer_path: str | None, kwargs: dict[str, t.Any]) -> None:
    """A pool worker: Ctrl-C is the parent's to handle, and the worker dies with its parent."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    try:  # Linux: die with the parent, so a killed prepare leaves no worker behind (and no pipe held open)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    _init_renderer(tokenizer_path, kwargs)


def _init_renderer(tokenizer_path: str | None, kwargs: dict[str, t.Any]) -> None:
    global _RENDERER
    if tokenizer_path is not None:
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


def _pool_shard(job: ShardJob, max_len: int, vocab_size: int) -> None:
    """``run_shard`` in a pool worker. The test hook fires here, right after the rename: from the parent it
    fired only once the parent had seen the result, by when the other workers had often done every shard."""
    run_shard(job, max_len, vocab_size)
    _die_after(sum(1 for p in Path(job.part).parent.iterdir() if not p.name.endswith(".tmp")))


class _Counts:
    """How often each token id occurs, counted in chunks of tokens (one bincount per MiB of ids, not one
    vocabulary-sized array per sequence); ids are below the vocabulary (``out-of-vocab`` drops the rest)."""

    CHUNK = 1 << 20

    def __init__(self) -> None:
        self.dense = np.zeros(0, dtype=np.int64)
        self.pending: list[np.ndarray] = []
        self.size = 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(ids)
        self.size += len(ids)
        if self.size >= self.CHUNK:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        ids = np.concatenate(self.pending)
        self.pending, self.size = [], 0
        counts = np.bincount(ids, minlength=len(self.dense))
        if len(counts) > len(self.dense):
            counts[: len(self.dense)] += self.dense
            self.dense = counts.astype(np.int64, copy=False)
        else:
            self.dense += counts

    def save(self, folder: Path) -> None:
        """Sparse: the ids that occur (uint32) and their counts (int64)."""
        self.flush()
        nz = np.flatnonzero(self.dense)
        nz.astype(np.uint32).tofile(folder / "token_ids.bin")
        self.dense[nz].tofile(folder / "token_freq.bin")


def run_shard(job: ShardJob, max_len: int, vocab_size: int) -> None:
    """Render one shard's lines into ``job.part`` (written as ``.tmp``, renamed when complete)."""
    tmp = fresh_part(job)
    drops: dict[str, list[int]] = {}
    messages: dict[str, str] = {"line-too-long": LINE_TOO_LONG}
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
    token_counts = _Counts()
    with open(tmp / "tokens.bin", "wb") as tf, open(tmp / "loss_mask.bin", "wb") as mf:
        for lineno, raw in read_lines(job):
            if raw is None:  # over MAX_LINE_BYTES
                counts["records"] += 1
                drops.setdefault("line-too-long", []).append(lineno)
                continue
            if not raw.strip():
                continue
            counts["records"] += 1
            try:
                rendered = record_sequences(parse_record(raw), _RENDERER, max_len=max_len, vocab_size=vocab_size)
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
                counts["max_token_id"] = max(counts["max_token_id"], int(ids.max()))
                token_counts.add(ids)
            if kept:
                counts["sequences"] += kept
            else:
                drops.setdefault("no-anchor", []).append(lineno)
                messages.setdefault("no-anchor", "no two consecutive supervised tokens (nothing to learn)")
    np.asarray(lengths, dtype=np.int64).tofile(tmp / "lengths.bin")
    np.asarray(anchors, dtype=np.int32).tofile(tmp / "first_anchor.bin")
    token_counts.save(tmp)
    finish_part(tmp, job, counts, drops, messages)


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


def check_out(spec: PrepareSpec) -> Path:
    """StoreError (one line) for an ``--out`` that cannot become the store: the working directory or a folder
    above it, a folder holding ``--in``, a file, a store already, a folder that is not a store (the final
    rename would fail after all the work), a place that takes no new file. Said before any work."""
    out = Path(spec.out)
    try:
        outputs.check_out(out, what=f"{COMMAND}: --out", kind="dir", sources=[spec.src])
    except outputs.OutputError as e:
        raise StoreError(str(e)) from None
    if (out / "meta.json").is_file():
        raise StoreError(f"prepare-data: --out {out} is already a token store; remove it or choose another folder")
    if out.is_dir() and any(out.iterdir()):
        raise StoreError(
            f"prepare-data: --out {out} is a folder that is not a token store (it holds other files); "
            "remove it or choose another folder"
        )
    return out


def prepare(spec: PrepareSpec, *, log: t.Callable[[str], None] = print) -> dict[str, t.Any]:
    """Render ``spec.src`` into the store ``spec.out``; returns meta.json's content. StoreError: one line
    (bad input, exit 2); outputs.OutputBusy: another prepare-data writes the same store (exit 2);
    outputs.WriteFailed: a write failed midway, e.g. a full disk (exit 1; the finished shards are kept)."""
    t0 = time.monotonic()
    src, out = Path(spec.src), Path(spec.out)
    if not src.is_file() and not src.is_dir():
        kind = "not a regular file" if src.exists() else "no such file"  # a FIFO would block the read
        raise StoreError(f"prepare-data: --in {src}: {kind}")
    check_out(spec)
    work = Path(str(out) + ".partial")
    with outputs.OutputLock(out, command=COMMAND):
        check_out(spec)  # again, holding the lock: a run that just finished made OUT
        with outputs.writing(command=COMMAND, where=work, kept=f"the finished shards are kept in {work}"):
            meta = _prepare(spec, src, out, work, log)
    meta["seconds"] = time.monotonic() - t0
    return meta


def _prepare(spec: PrepareSpec, src: Path, out: Path, work: Path, log: t.Callable[[str], None]) -> dict[str, t.Any]:
    try:
        tabular = tabular_kind(src, command=COMMAND)  # parquet / a datasets folder: rows, streamed to JSON lines
        work.mkdir(parents=True, exist_ok=True)
        head = b"" if tabular else inputs.head(src)
        if not head and not tabular:
            raise StoreError(f"prepare-data: --in {src} is empty: no conversations")
        lines_src = as_json_lines(src, tabular, head, work, command=COMMAND, log=log)
    except CorpusError as e:
        raise StoreError(str(e)) from None
    if tabular and not lines_src.stat().st_size:
        raise StoreError(f"prepare-data: --in {src} has no rows: no conversations")
    sha, nlines, ranges = shard_ranges(lines_src, spec.shard_lines)
    tok_info: dict[str, t.Any] = {}
    vocab = spec.vocab_size or NO_VOCAB_LIMIT
    if spec.tokenizer_path is not None:
        tok = load_tokenizer(spec.tokenizer_path)
        vocab = len(tok)
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
        "vocab_size": vocab,
        "shard_lines": spec.shard_lines,
        "format": STORE_FORMAT,
        "parts_format": PARTS_FORMAT,
    }
    parts = start_parts(work, plan, command=COMMAND, log=log)
    jobs = shard_jobs(lines_src, ranges, nlines, parts)
    todo = pending(jobs, command=COMMAND, log=log)
    if spec.workers <= 1 or len(todo) <= 1:
        # in this process: never _init_worker, whose SIG_IGN for Ctrl-C every later child would inherit
        _init_renderer(spec.tokenizer_path, spec.kwargs)
        for done, j in enumerate(todo, 1):
            run_shard(j, spec.max_len, vocab)
            _die_after(done)
    else:
        ctx = mp.get_context("spawn")  # no fork of a process that holds torch and tokenizer threads
        with cf.ProcessPoolExecutor(
            spec.workers, mp_context=ctx, initializer=_init_worker, initargs=(spec.tokenizer_path, spec.kwargs)
        ) as pool:
            futures = [pool.submit(_pool_shard, j, spec.max_len, vocab) for j in todo]
            for fut in cf.as_completed(futures):
                fut.result()
    meta = _concatenate(work, jobs, spec, plan, src, nlines)
    meta["source"]["kind"] = tabular or ("json" if lines_src != src else "jsonl")
    if tabular:
        meta["source"]["bytes"] = (
            sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) if src.is_dir() else src.stat().st_size
        )
        drops_by_row(meta["drops"])
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
        (work / "input.source.json").unlink(missing_ok=True)
    (work / "meta.json").write_text(json.dumps(meta, indent=1))  # last: a store with meta.json is complete
    os.replace(work, out)
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
            merge_part(p, counts, drops, maxed=("max_token_id",))
            for name, fh in (("tokens.bin", tf), ("loss_mask.bin", mf), ("first_anchor.bin", af)):
                with open(p / name, "rb") as f:
                    shutil.copyfileobj(f, fh, 1 << 22)
            lengths_all.append(np.fromfile(p / "lengths.bin", dtype=np.int64))
            ids = np.fromfile(p / "token_ids.bin", dtype=np.uint32).astype(np.int64)
            if ids.size and int(ids[-1]) >= len(token_counts):
                token_counts = np.concatenate([token_counts, np.zeros(int(ids[-1]) + 1 - len(token_counts), np.int64)])
            token_counts[ids] += np.fromfile(p / "token_freq.bin", dtype=np.int64)
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


__all__ = [
    "DIE_AFTER_ENV",
    "NO_VOCAB_LIMIT",
    "STORE_FORMAT",
    "PrepareRequest",
    "PrepareSpec",
    "StoreError",
    "TokenStore",
    "check_out",
    "is_store",
    "prepare",
]


# --------------------------------------------------------------------------------------------
# The command: `dflash prepare-data`'s options -> a token store and a summary on stdout


@dataclasses.dataclass(frozen=True)
class PrepareRequest:
    """What `dflash prepare-data` was asked, one field per option (docs/training.md)."""

    src: str
    out: str
    config_path: str | None = None
    tokenizer_path: str | None = None
    template_kwargs: str | None = None
    workers: int = 1
    strict: bool = False
    max_len: int | None = None
    shard_lines: int = 10_000


def run_prepare(req: PrepareRequest, *, say: t.Callable[[str], None], note: t.Callable[[str], None]) -> None:
    """Run `dflash prepare-data`: the summary's lines to ``say`` (stdout), progress to ``note`` (stderr)."""
    from dflash.config import ConfigError, load_config
    from dflash.data.corpus import drop_lines
    from dflash.errors import BadInput, DataError

    def fail(msg: str) -> t.NoReturn:
        raise BadInput(msg)

    if (req.config_path is None) == (req.tokenizer_path is None):
        fail("prepare-data: give exactly one of --config RUN.toml or --tokenizer PATH")
    kwargs: dict[str, t.Any] = {}
    vocab_size: int | None = None
    max_len = req.max_len
    tokenizer_path = req.tokenizer_path
    if req.config_path is not None:
        if req.template_kwargs is not None:
            fail("prepare-data: --template-kwargs goes with --tokenizer; with --config set data.chat_template_kwargs")
        try:
            cfg = load_config(req.config_path, ())
        except ConfigError as e:
            fail(f"prepare-data: {e}")
        kwargs = dict(cfg.data.chat_template_kwargs)
        max_len = max_len or cfg.data.max_length
        tokenizer_path = cfg.data.tokenizer or cfg.target.path
        if tokenizer_path is not None and cfg.data.tokenizer is None:
            try:  # a target folder without a tokenizer still prepares pre-tokenized data
                load_tokenizer(tokenizer_path)
            except DataError:
                tokenizer_path = None
        if tokenizer_path is None:  # pre-tokenized ids are checked against the target's vocabulary instead
            vocab_size = _target_vocab(cfg)
    elif req.template_kwargs is not None:
        try:
            kwargs = inputs.loads(req.template_kwargs)
        except inputs.JsonProblem as e:
            fail(f"prepare-data: --template-kwargs: {e}")
        if not isinstance(kwargs, dict):
            fail("prepare-data: --template-kwargs: expected a JSON object")
    spec = PrepareSpec(
        src=req.src,
        out=req.out,
        tokenizer_path=tokenizer_path,
        kwargs=kwargs,
        max_len=max_len or 3072,
        workers=req.workers,
        strict=req.strict,
        shard_lines=req.shard_lines,
        vocab_size=vocab_size,
    )
    try:
        meta = prepare(spec, log=note)
    except (StoreError, DataError) as e:
        fail(str(e))
    c = meta["counts"]
    secs = meta["seconds"]
    sup = 100.0 * c["supervised"] / max(c["tokens"], 1)
    say(
        f"prepare-data: {c['records']} records -> {c['sequences']} sequences, {c['tokens']} tokens "
        f"({sup:.0f}% supervised) in {secs:.1f}s ({c['records'] / max(secs, 1e-9):.0f} records/s, "
        f"{req.workers} worker{'s' if req.workers > 1 else ''}); wrote {req.out}"
    )
    if c["cut"]:
        say(f"prepare-data: {c['cut']} sequences cut to {spec.max_len} tokens")
    if c["dropped_turns"]:
        say(f"prepare-data: {c['dropped_turns']} assistant turns not rendered as serving shows them (left out)")
    for line in drop_lines("prepare-data", meta["drops"]):
        say(line)


def _target_vocab(cfg: t.Any) -> int | None:
    """The vocabulary of the run's target without loading it: target.tiny, else its config.json (None: no
    config.json there; one that is no model's is one line, never a vocabulary left unchecked)."""
    from dflash.errors import BadInput
    from dflash.model import model_config

    if cfg.target.tiny is not None:
        return int(cfg.target.tiny.vocab_size)
    if not (Path(cfg.target.path).expanduser() / model_config.CONFIG_FILE).exists():
        return None
    try:
        return model_config.read_vocab_size(cfg.target.path, "target.path")
    except (inputs.InputFileError, inputs.RecordError) as e:
        raise BadInput(f"prepare-data: target.path: {e}") from None
