"""``dflash regen``: the target rewrites every assistant turn of a chat corpus (temperature 0).

The DFlash and SpecForge recipes train on answers the target itself wrote, with the serving chat template
and thinking setting. ``regen`` reads what ``prepare-data`` reads (OpenAI ``messages``, ShareGPT
``conversations``; JSONL, a JSON array, parquet or a ``datasets`` ``save_to_disk`` folder) and writes JSONL in OpenAI ``messages`` form: the same records,
each assistant turn replaced by the target's greedy answer. Turn k is generated with the regenerated turns
before it as history (what the target would have seen had it answered every turn itself).

Backends (each a ``Generator``):

- ``hf``: the run's target loaded with transformers on its devices (one replica per distinct device of
  ``devices.targets``), batched greedy ``generate`` with left padding, stopping at EOS (the tokenizer's and
  the model's ``generation_config``'s) or ``max_new_tokens``. Prompts are rendered as ``prepare-data``
  renders them (``Renderer.prompt_ids``).
- ``openai``: any OpenAI-compatible server (vLLM, SGLang, ``transformers serve``): ``POST
  /v1/chat/completions`` with ``temperature 0``, ``max_tokens`` and ``chat_template_kwargs``; N requests in
  flight; 5xx, 408, 429, timeouts and refused connections retried with exponential backoff (bounded); any
  other 4xx stops the run with the status and the server's message. A ``reasoning_content`` the server split
  off (a reasoning parser) is put back as ``<think>\\n...\\n</think>\\n\\n`` in front of the content, the
  shape Qwen3's template renders.

Length: with a local tokenizer, a turn whose prompt already fills ``max_len`` tokens (``data.max_length``)
ends the conversation there (training would cut it anyway); answers get at most ``max_len - prompt`` and
``max_new_tokens`` tokens.

Resumable by shard, like ``prepare-data`` (the corpus pass of ``dflash.corpus``): the input is cut into shards of ``shard_lines`` lines; shard s
is written to ``NEW.partial/parts/part-s.tmp/`` and renamed to ``part-s`` when complete, so a killed run
again skips the shards done (``plan.json``: same input, model, template, kwargs and lengths). The parts are
then concatenated into ``NEW.tmp`` and renamed to ``NEW``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import http.client
import json
import os
import shutil
import signal
import sys
import threading
import time
import typing as t
import urllib.error
import urllib.request
from pathlib import Path

from dflash.chat import BadRecord, Renderer, messages_of, parse_record, template_hash, tokenizer_hash
from dflash.config import ConfigError
from dflash.corpus import (
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
from dflash.errors import DflashError, InputError

FORMAT = "dflash-regen/1"
COMMAND = "regen"  # what its messages start with
DIE_AFTER_ENV = "DFLASH_REGEN_DIE_AFTER_SHARDS"  # test hook: SIGKILL regen once N shards are done


class RegenError(InputError, ValueError):
    """Bad input or setting: one line for the user (exit 2)."""


class ServerError(DflashError, RuntimeError):
    """The server refused a request (4xx) or stayed unreachable after the retries: one line (exit 1)."""

    traceback = False


class _Stopped(ServerError):
    """A request given up because another one failed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Turn:
    """One assistant turn to generate: the history before it, its rendered prompt (when a tokenizer is
    local) and the most tokens its answer may take."""

    history: list[dict[str, str]]
    prompt_ids: list[int] | None
    max_new: int


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    text: str
    cut: bool  # stopped by the token limit, not by EOS


class Generator(t.Protocol):
    identity: dict[str, t.Any]  # what decides the answers besides the prompt (the resume plan keeps it)

    def generate(self, turns: list[Turn]) -> list[Answer]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RegenSpec:
    src: str
    out: str
    kwargs: dict[str, t.Any]
    max_new_tokens: int
    max_len: int | None  # None: no prompt-length rule (no local tokenizer)
    shard_lines: int = 1000
    log_every: int = 1000


# --------------------------------------------------------------------------------------------
# Backend hf: the target in this process


class HFGenerator:
    """Batched greedy generation with a transformers causal LM (left padding, stop at EOS)."""

    def __init__(self, model: t.Any, tokenizer: t.Any, *, batch_size: int, identity: dict[str, t.Any]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.identity = identity
        eos: set[int] = set()
        for src in (getattr(tokenizer, "eos_token_id", None), getattr(model.generation_config, "eos_token_id", None)):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        self.eos = eos
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad) if isinstance(pad, int) else min(eos) if eos else 0

    def generate(self, turns: list[Turn]) -> list[Answer]:
        out: list[Answer | None] = [None] * len(turns)
        order = sorted(range(len(turns)), key=lambda i: len(turns[i].prompt_ids or ()))  # less padding
        for a in range(0, len(order), self.batch_size):
            idx = order[a : a + self.batch_size]
            for i, ans in zip(idx, self._batch([turns[i] for i in idx])):
                out[i] = ans
        return [a for a in out if a is not None]

    def _batch(self, turns: list[Turn]) -> list[Answer]:
        import torch  # the hf backend only: torch and transformers take seconds to import, openai needs neither
        from transformers import GenerationConfig

        prompts = [list(tn.prompt_ids or ()) for tn in turns]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[r, width - len(p) :] = 1
        longest = max(tn.max_new for tn in turns)
        gc = GenerationConfig(
            do_sample=False, max_new_tokens=longest, eos_token_id=sorted(self.eos) or None, pad_token_id=self.pad
        )
        device = self.model.device
        with torch.inference_mode():
            seqs = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gc)
        answers = []
        for r, tn in enumerate(turns):
            new = seqs[r, width : width + tn.max_new].tolist()  # greedy: a shorter limit is a prefix of a longer one
            stop = next((k for k, x in enumerate(new) if x in self.eos), None)
            if stop is not None:
                new = new[:stop]
            answers.append(
                Answer(
                    self.tokenizer.decode(new, skip_special_tokens=True), cut=stop is None and len(new) >= tn.max_new
                )
            )
        return answers


def load_hf(cfg: t.Any, tokenizer: t.Any, *, batch_size: int) -> list[HFGenerator]:
    """One generator per distinct device of ``devices.targets`` (a device named twice gets one replica)."""
    import torch  # the hf backend only (as HFGenerator._batch): seconds to import, openai needs none of these
    from transformers import AutoModelForCausalLM

    from dflash.replicas import torch_dtype
    from dflash.target import TargetModel, tiny_target_config_of

    dtype = torch_dtype(cfg.target.dtype)
    gens = []
    for dev in dict.fromkeys(cfg.devices.targets):
        if dev != "cpu" and not torch.cuda.is_available():
            raise RegenError(f"regen: devices.targets names {dev}, but this torch has no CUDA device")
        if cfg.target.tiny is not None:  # a random-init target from the config (tests)
            tiny = cfg.target.tiny
            tc = tiny_target_config_of(tiny)
            model = TargetModel.from_config(tc, dtype=dtype, device=dev, seed=tiny.seed).model
            identity: dict[str, t.Any] = {"backend": "hf", "tiny": dataclasses.asdict(tiny), "dtype": cfg.target.dtype}
        else:
            placement = {} if dev == "cpu" else {"device_map": {"": dev}}
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    cfg.target.path, dtype=dtype, local_files_only=True, **placement
                )
            except OSError as e:
                raise ConfigError("target.path", f"cannot load a model from {cfg.target.path}: {e}") from e
            model.to(dev)
            identity = {"backend": "hf", "target": str(cfg.target.path), "dtype": cfg.target.dtype}
        model.eval()
        gens.append(HFGenerator(model, tokenizer, batch_size=batch_size, identity=identity))
    return gens


# --------------------------------------------------------------------------------------------
# Backend openai: an OpenAI-compatible server


RETRY_STATUS = {408, 429}  # and every 5xx


def _server_message(body: bytes) -> str:
    """The server's own words from an error body (OpenAI: error.message; FastAPI: detail)."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body.decode("utf-8", "replace").strip()[:300] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        for key in ("detail", "message", "error"):
            if data.get(key):
                v = data[key]
                return (v if isinstance(v, str) else json.dumps(v))[:300]
    return json.dumps(data)[:300]


class OpenAIGenerator:
    """Chat completions against ``server`` with ``concurrency`` requests in flight (stdlib urllib + threads)."""

    def __init__(
        self,
        server: str,
        *,
        model: str | None,
        kwargs: dict[str, t.Any],
        concurrency: int,
        timeout: float = 600.0,
        retries: int = 6,
        backoff: float = 1.0,
    ) -> None:
        base = server.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise RegenError(f"regen: --server {server}: expected an http:// or https:// URL")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.kwargs = dict(kwargs)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._abort = threading.Event()
        self._pool = cf.ThreadPoolExecutor(concurrency, thread_name_prefix="regen-request")
        self.model = model or self._only_model()
        self.identity = {"backend": "openai", "server": self.base, "model": self.model}

    def close(self) -> None:
        self._abort.set()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def request(self, path: str, body: dict[str, t.Any] | None) -> dict[str, t.Any]:
        """One call with the retries; ServerError (one line) on a 4xx or when the retries are spent."""
        url = self.base + path
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:  # backoff; another request's failure ends the wait
                self._abort.wait(min(self.backoff * 2 ** (attempt - 1), 30.0))
            if self._abort.is_set():
                raise _Stopped("regen: stopped (another request failed)")
            req = urllib.request.Request(
                url, data=data, method="GET" if body is None else "POST", headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                msg = _server_message(e.read())
                if e.code >= 500 or e.code in RETRY_STATUS:
                    last = f"{e.code} {e.reason}: {msg}"
                    continue
                self._abort.set()
                raise ServerError(f"regen: {url} answered {e.code} {e.reason}: {msg}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
                last = str(getattr(e, "reason", None) or e) or type(e).__name__
                continue
            try:
                out = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                last = f"not JSON: {raw[:120]!r}"
                continue
            if not isinstance(out, dict):
                last = f"not a JSON object: {raw[:120]!r}"
                continue
            return out
        self._abort.set()
        raise ServerError(f"regen: {url}: {last} (gave up after {self.retries + 1} tries)")

    def _only_model(self) -> str:
        ids = [m.get("id") for m in self.request("/models", None).get("data", []) if isinstance(m, dict)]
        if len(ids) != 1 or not isinstance(ids[0], str):
            raise RegenError(
                f"regen: {self.base}/models lists {len(ids)} models ({', '.join(map(str, ids[:5]))}): "
                "name one with --model"
            )
        return ids[0]

    def _one(self, turn: Turn) -> Answer:
        body: dict[str, t.Any] = {
            "model": self.model,
            "messages": turn.history,
            "temperature": 0,
            "max_tokens": turn.max_new,
            "stream": False,
        }
        if self.kwargs:
            body["chat_template_kwargs"] = self.kwargs
        out = self.request("/chat/completions", body)
        try:
            choice = out["choices"][0]
            msg = choice["message"]
            content = msg.get("content") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise ServerError(
                f"regen: {self.base}/chat/completions: unexpected answer {json.dumps(out)[:200]}"
            ) from None
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if isinstance(reasoning, str) and reasoning:  # a reasoning parser split it off: put it back
            content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
        return Answer(str(content), cut=choice.get("finish_reason") == "length")

    def generate(self, turns: list[Turn]) -> list[Answer]:
        futures = [self._pool.submit(self._one, tn) for tn in turns]
        try:
            cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        finally:
            for f in futures:
                f.cancel()
        errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
        if errors:  # the request that failed, not one that stopped because of it
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
        return [f.result() for f in futures]


# --------------------------------------------------------------------------------------------
# Progress


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """done/total, conversations/s and ETA: one line rewritten with \\r on a TTY, a log line every
    ``every`` conversations (and at the end) on a pipe."""

    def __init__(self, total: int, done: int, *, stream: t.TextIO, every: int, tty: bool | None = None) -> None:
        self.total, self.done, self.start_done = total, done, done
        self.stream = stream
        self.every = max(1, every)
        self.tty = stream.isatty() if tty is None else tty
        self.t0 = time.monotonic()
        self._shown = 0.0
        self._next = done + self.every
        self._logged = -1
        self._lock = threading.Lock()

    def line(self) -> str:
        secs = max(time.monotonic() - self.t0, 1e-9)
        rate = (self.done - self.start_done) / secs
        eta = _clock((self.total - self.done) / rate) if rate > 0 else "?"
        return f"regen: {self.done}/{self.total} conversations, {rate:.2f} conv/s, ETA {eta}"

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.tty:
                if now - self._shown >= 0.2:
                    self._shown = now
                    self.stream.write("\r" + self.line().ljust(72))
                    self.stream.flush()
            elif self.done >= self._next:
                self._next = (self.done // self.every + 1) * self.every
                self._logged = self.done
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def finish(self) -> None:
        with self._lock:
            if self.tty:
                self.stream.write("\r" + self.line().ljust(72) + "\n")
            elif self._logged != self.done:
                self.stream.write(self.line() + "\n")
            self.stream.flush()


# --------------------------------------------------------------------------------------------
# Shards


@dataclasses.dataclass(slots=True)
class _Conv:
    lineno: int
    rec: dict[str, t.Any]
    msgs: list[dict[str, str]]
    turns: list[int]  # indices of the assistant messages
    k: int = 0  # turns done
    keep: int | None = None  # messages kept when cut before a turn that does not fit


def _read_shard(job: ShardJob, drops: dict[str, list[int]], messages: dict[str, str]) -> tuple[list[_Conv], int]:
    """The shard's usable conversations, and how many of its lines were not (blank, dropped)."""
    convs = []
    other = 0
    for lineno, raw in read_lines(job):
        if raw is None:  # over MAX_LINE_BYTES
            drops.setdefault("line-too-long", []).append(lineno)
            messages.setdefault("line-too-long", LINE_TOO_LONG)
            other += 1
            continue
        if not raw.strip():
            other += 1
            continue
        try:
            rec = parse_record(raw)
            if "input_ids" in rec and "messages" not in rec and "conversations" not in rec:
                raise BadRecord("pre-tokenized", "pre-tokenized input_ids: no chat turns to regenerate")
            msgs = messages_of(rec)
        except BadRecord as e:
            drops.setdefault(e.reason, []).append(lineno)
            messages.setdefault(e.reason, str(e))
            other += 1
            continue
        convs.append(_Conv(lineno, rec, msgs, [i for i, m in enumerate(msgs) if m["role"] == "assistant"]))
    return convs, other


def run_shard(
    job: ShardJob, gen: Generator, renderer: Renderer | None, spec: RegenSpec, progress: Progress | None
) -> None:
    """Regenerate one shard into ``job.part`` (written as ``.tmp``, renamed when complete)."""
    drops: dict[str, list[int]] = {}
    messages: dict[str, str] = {}
    counts = {"records": 0, "written": 0, "turns": 0, "cut_answers": 0, "cut_conversations": 0}
    convs, other = _read_shard(job, drops, messages)
    counts["records"] = len(convs) + sum(len(v) for v in drops.values())
    if progress and other:
        progress.advance(other)
    pending = list(convs)
    while pending:  # round r: the r-th assistant turn of every conversation that has one
        turns: list[Turn] = []
        asked: list[_Conv] = []
        for c in pending:
            history = c.msgs[: c.turns[c.k]]
            ids = None
            max_new = spec.max_new_tokens
            if renderer is not None:
                try:
                    ids = renderer.prompt_ids(history)
                except BadRecord as e:
                    drops.setdefault(e.reason, []).append(c.lineno)
                    messages.setdefault(e.reason, str(e))
                    c.keep = -1
                    continue
                if spec.max_len is not None:
                    room = spec.max_len - len(ids)
                    if room < 1:  # the prompt fills what training keeps: the conversation ends here
                        c.keep = c.turns[c.k]
                        continue
                    max_new = min(max_new, room)
            turns.append(Turn(history, ids, max_new))
            asked.append(c)
        answers = gen.generate(turns) if turns else []
        for c, ans in zip(asked, answers):
            c.msgs[c.turns[c.k]] = {"role": "assistant", "content": ans.text}
            c.k += 1
            counts["turns"] += 1
            counts["cut_answers"] += int(ans.cut)
        still = []
        for c in pending:
            if c.keep is None and c.k < len(c.turns):
                still.append(c)
            elif progress:
                progress.advance(1)
        pending = still
    tmp = fresh_part(job)
    with open(tmp / "out.jsonl", "w") as f:
        for c in convs:
            msgs = c.msgs
            if c.keep == -1:
                continue
            if c.keep is not None:
                if c.k == 0:
                    drops.setdefault("prompt-too-long", []).append(c.lineno)
                    messages.setdefault(
                        "prompt-too-long", f"the first assistant turn's prompt fills max_len ({spec.max_len} tokens)"
                    )
                    continue
                msgs = msgs[: c.keep]
                counts["cut_conversations"] += 1
            rec = {k: v for k, v in c.rec.items() if k not in ("messages", "conversations")}
            rec["messages"] = msgs
            f.write(json.dumps(rec) + "\n")  # ASCII: a lone surrogate from a server still writes
            counts["written"] += 1
    finish_part(tmp, job, counts, drops, messages)
    _die_after(Path(job.part).parent)


def _die_after(parts: Path) -> None:
    """The test hook: a real SIGKILL of this process once DIE_AFTER_ENV shards are done (right after the
    rename, in the thread that wrote the shard)."""
    n = int(os.environ.get(DIE_AFTER_ENV, "0") or 0)
    if n and sum(1 for p in parts.iterdir() if not p.name.endswith(".tmp")) >= n:
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# The run


def check_io(spec: RegenSpec) -> bytes:
    """RegenError (one line) for an input that is missing or empty, or an output already there; said before
    a target is loaded. Returns the input's first bytes."""
    src, out = Path(spec.src), Path(spec.out)
    if not src.is_file() and not src.is_dir():
        raise RegenError(f"regen: --in {src}: no such file")
    if out.exists():
        raise RegenError(f"regen: --out {out} is already there; remove it or choose another file")
    if src.is_dir():
        return b""
    with src.open("rb") as f:
        head = f.read(4096).lstrip()
    if not head:
        raise RegenError(f"regen: --in {src} is empty: no conversations")
    return head


def regen(
    spec: RegenSpec,
    gens: t.Sequence[Generator],
    renderer: Renderer | None,
    *,
    log: t.Callable[[str], None] = print,
    progress_stream: t.TextIO | None = None,
    tty: bool | None = None,
) -> dict[str, t.Any]:
    """Regenerate ``spec.src`` into ``spec.out`` with one worker thread per generator; returns the summary.
    RegenError / ServerError: one line (the finished shards stay for the next run)."""
    t0 = time.monotonic()
    head = check_io(spec)
    src, out = Path(spec.src), Path(spec.out)
    work = Path(str(out) + ".partial")
    try:  # a JSON array, parquet or a datasets folder: to JSON lines first (record k is line k), as prepare-data
        tabular = tabular_kind(src, command=COMMAND)
        lines_src = as_json_lines(src, tabular, head, work, command=COMMAND)
    except CorpusError as e:
        raise RegenError(str(e)) from None
    if not lines_src.stat().st_size:
        raise RegenError(f"regen: --in {src} has no rows: no conversations")
    work.mkdir(parents=True, exist_ok=True)
    sha, nlines, ranges = shard_ranges(lines_src, spec.shard_lines)
    tok = renderer.tokenizer if renderer is not None else None
    plan = {
        "format": FORMAT,
        "source_sha256": sha,
        "shard_lines": spec.shard_lines,
        "generator": gens[0].identity,
        "chat_template_kwargs": spec.kwargs,
        "max_new_tokens": spec.max_new_tokens,
        "max_len": spec.max_len,
        "tokenizer": None if tok is None else {"sha256": tokenizer_hash(tok), "template_sha256": template_hash(tok)},
    }
    parts = start_parts(work, plan, command=COMMAND, log=log)
    jobs = shard_jobs(lines_src, ranges, nlines, parts)
    todo = pending(jobs, command=COMMAND, log=log)
    done = {j.index for j in jobs} - {j.index for j in todo}
    progress = Progress(
        nlines,
        sum(j.lines for j in jobs if j.index in done),
        every=spec.log_every,
        stream=progress_stream or sys.stderr,
        tty=tty,
    )
    queue = list(reversed(todo))
    lock = threading.Lock()

    def worker(gen: Generator) -> None:
        while True:
            with lock:
                if not queue:
                    return
                job = queue.pop()
            run_shard(job, gen, renderer, spec, progress)

    if len(gens) == 1:
        worker(gens[0])
    else:
        with cf.ThreadPoolExecutor(len(gens), thread_name_prefix="regen-target") as pool:
            for fut in [pool.submit(worker, g) for g in gens]:
                fut.result()
    progress.finish()
    summary = _concatenate(jobs, out)
    shutil.rmtree(work)
    if tabular:  # as prepare-data says them
        drops_by_row(summary["drops"])
    summary["seconds"] = time.monotonic() - t0
    summary["done_now"] = progress.done - progress.start_done
    return summary


def _concatenate(jobs: list[ShardJob], out: Path) -> dict[str, t.Any]:
    counts = {"records": 0, "written": 0, "turns": 0, "cut_answers": 0, "cut_conversations": 0}
    drops: dict[str, dict[str, t.Any]] = {}
    tmp = Path(str(out) + ".tmp")
    with open(tmp, "wb") as fh:
        for j in jobs:
            p = Path(j.part)
            merge_part(p, counts, drops)
            with open(p / "out.jsonl", "rb") as f:
                shutil.copyfileobj(f, fh, 1 << 22)
    os.replace(tmp, out)
    counts["dropped"] = sum(d["count"] for d in drops.values())
    return {"counts": counts, "drops": dict(sorted(drops.items()))}


__all__ = [
    "Answer",
    "check_io",
    "DIE_AFTER_ENV",
    "HFGenerator",
    "OpenAIGenerator",
    "Progress",
    "RegenError",
    "RegenSpec",
    "ServerError",
    "Turn",
    "load_hf",
    "regen",
    "run_shard",
]
