"""``dflash bench serve``: the drafter measured where it is served, beside ``dflash eval``'s offline tau.

    dflash bench serve --server http://127.0.0.1:8000 --prompts eval.jsonl --concurrency 1,8,32
                       [--eval eval.json | --drafter CKPT [--target PATH]] [--json bench.json]

It sends every prompt to a running OpenAI-compatible server that serves a target with a drafter (vLLM
``--speculative-config``, SGLang ``--speculative-algorithm DFLASH --enable-metrics``), once per
concurrency level with that many requests in flight (greedy: temperature 0), and reports per level:

- the acceptance length from the server's own Prometheus ``/metrics`` (``dflash.serve.engine_metrics``): vLLM's
  counters as deltas over the level, ``1 + accepted / drafts``, and the acceptance by draft position;
  SGLang's counters as deltas, ``generation tokens / verify calls``, with the acceptance by position from
  each answer's ``sglext.spec_tokens_details`` (asked with ``return_spec_tokens_details``); for an SGLang
  build without them, the details alone, else its ``sglang:spec_accept_length`` gauge after the level;
  a per-position cliff (``find_cliff``) flagged beside the offline acceptance; the engine's identity
  (``identify``: its version, SGLang's request cap, the model card);
- output tokens per second (the completions' ``usage.completion_tokens`` over the level's wall time) and
  the end-to-end request latency's p50, p90 and p99;

and beside them the offline tau of ``dflash eval`` on the same prompts: from a ``dflash eval --json``
report (``--eval``; its prompts file's sha256 says whether they are the same prompts), or computed here
(``--drafter``). Both count tokens per target forward (accepted drafts + the target's own token).

Prompts come from a function (``read_prompts(path)`` for ``--prompts FILE``): chat records (OpenAI
``messages`` / ShareGPT ``conversations``: the turns before the first assistant turn, sent to
``/v1/chat/completions``), ``{"prompt": "text"}`` or ``{"input_ids": [...]}`` (sent to ``/v1/completions``);
or ``suite_prompts(specs)`` for ``--suite NAMES``: the published tables' suites (``dflash.eval.suites``), each
conversation's first user turn as a chat request.

Requests go through ``dflash.data.regen.OpenAIGenerator``'s client (its timeouts, retries and one-line
errors). Bad input (a bad --concurrency, no prompts, a server that does not answer or has no
speculative-decoding metrics) is ``ServeBenchError``: one line, before any request; a server that fails
during the run is ``regen.ServerError``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import http.client
import json
import math
import os
import socket
import threading
import time
import typing as t
import urllib.parse
from pathlib import Path

from dflash import inputs
from dflash.data.regen import OpenAIGenerator, RegenError, ServerError
from dflash.errors import BadInput
from dflash.eval import suites
from dflash.serve import engine_metrics

__all__ = [
    "BenchReport",
    "Cliff",
    "Identity",
    "Level",
    "Offline",
    "Prompt",
    "ServeBenchError",
    "bench",
    "find_cliff",
    "offline_from_report",
    "parse_concurrency",
    "percentile",
    "read_prompts",
    "sha256_file",
    "suite_prompts",
]

PREFIX = "bench serve: "


class ServeBenchError(BadInput, ValueError):
    """Bad input to ``bench serve`` (arguments, prompts, a server that is not usable): one line."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: chat turns (``/v1/chat/completions``), or a text or token ids (``/v1/completions``)."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None


# --------------------------------------------------------------------------------------------
# Inputs


def parse_concurrency(text: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32] (each a positive integer, each once, in the order given)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ServeBenchError(
                f"{PREFIX}--concurrency: expected positive integers separated by commas, such as 1,8,32; got {text!r}"
            )
        if int(part) not in out:
            out.append(int(part))
    return out


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """The prompts of a JSONL file or JSON array, as ``dflash eval --prompts`` reads them."""
    from dflash.data.chat import BadRecord
    from dflash.eval.prompts import EvalError, prompt_messages, read_records, token_prompt

    path = Path(path)
    try:  # a regular file: a FIFO would block here
        text = inputs.read_text(path, f"{PREFIX}--prompts")
    except inputs.InputFileError as e:
        raise ServeBenchError(str(e)) from None
    prompts: list[Prompt] = []
    try:
        for where, rec in read_records(text, path):
            if isinstance(rec, dict) and ("messages" in rec or "conversations" in rec):
                try:
                    prompts.append(Prompt(messages=prompt_messages(rec)))
                except BadRecord as e:
                    raise ServeBenchError(f"{PREFIX}{where}: {e}") from None
            elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str) and rec["prompt"]:
                prompts.append(Prompt(text=rec["prompt"]))
            else:
                prompts.append(Prompt(token_ids=token_prompt(rec, where)))
    except EvalError as e:
        raise ServeBenchError(f"{PREFIX}--prompts: {e}") from None
    if not prompts:
        raise ServeBenchError(f"{PREFIX}--prompts: no prompts in {path}")
    return prompts


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# The offline figure


@dataclasses.dataclass(frozen=True)
class Offline:
    """``dflash eval``'s figures on (what should be) the same prompts."""

    tau: float
    position_acceptance: list[float]
    source: str  # the report file, or "computed: <drafter>"
    same_prompts: bool | None  # None: the report does not say which prompts
    max_new_tokens: int | None
    stop_at_eos: bool | None
    chat_template_kwargs: dict[str, t.Any] | None


def suite_prompts(
    specs: t.Sequence[tuple[str, str | None]], *, limit: int | None = None
) -> tuple[list[Prompt], str, str]:
    """``--suite``: the first user turn of each conversation of each suite, in z-lab's wording and selection
    (``dflash.eval.suites.load``), as chat requests; (prompts, their name, the sha256 of the selection).

    A later turn (mt-bench's turn 2) follows the target's own answer to turn 1, which a server gives only
    once turn 1 is answered: requests in flight at once cannot carry it, so only first turns are sent (as
    SpecForge's and z-lab's server benchmarks send them). For one suite the sha256 is the one
    ``dflash eval --suite`` records for it, so a report of that suite is recognised as the same selection."""
    prompts: list[Prompt] = []
    names: list[str] = []
    selections: list[list[list[str]]] = []
    for name, path in specs:
        convs = suites.load(name, path, limit=limit)
        selections.append(convs)
        prompts += [Prompt(messages=[{"role": "user", "content": turns[0]}]) for turns in convs]
        names.append(f"suite {name} ({path or suites.SUITES[name].repo})")
    data = selections[0] if len(selections) == 1 else selections
    return prompts, ", ".join(names), hashlib.sha256(json.dumps(data).encode()).hexdigest()


def offline_from_report(path: str | os.PathLike[str], prompts_sha256: str | None) -> Offline:
    """A ``dflash eval --json`` report (or a ``dflash eval --suite --json`` report of one suite);
    ``same_prompts``: its prompts' sha256 against ``prompts_sha256``, ours."""
    path = Path(path)
    if not path.exists():
        raise ServeBenchError(f"{PREFIX}--eval: {path} does not exist")
    try:  # bounded, finite (a tau of NaN is no figure), a regular file
        report = inputs.read_json(path, f"{PREFIX}--eval")
    except inputs.InputFileError as e:
        raise ServeBenchError(str(e)) from None
    if isinstance(report, dict) and isinstance(report.get("results"), list):  # dflash eval --suite's report
        results = report["results"]
        if len(results) != 1 or not isinstance(results[0], dict):
            raise ServeBenchError(
                f"{PREFIX}--eval: {path} is a report of {len(results)} suites: give one of a single suite"
            )
        report = results[0].get("report")
    return _offline(report, str(path), prompts_sha256)


def _offline(report: t.Any, source: str, prompts_sha256: str | None) -> Offline:
    tau = report.get("tau") if isinstance(report, dict) else None
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        raise ServeBenchError(f"{PREFIX}--eval: {source} is not a report of `dflash eval --json` (no tau)")
    positions = report.get("position_acceptance") or []
    if not isinstance(positions, list) or not all(
        isinstance(x, (int, float)) and not isinstance(x, bool) for x in positions
    ):
        raise ServeBenchError(f"{PREFIX}--eval: {source}: position_acceptance is not a list of numbers")
    proto = report.get("protocol") or {}
    sha = proto.get("prompts_sha256")
    same = None if not sha or prompts_sha256 is None else sha == prompts_sha256
    kwargs = proto.get("chat_template_kwargs")
    return Offline(
        tau=float(report["tau"]),
        position_acceptance=[float(x) for x in report.get("position_acceptance") or []],
        source=source,
        same_prompts=same,
        max_new_tokens=report.get("max_new_tokens"),
        stop_at_eos=proto.get("stop_at_eos"),
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
    )


def offline_computed(
    *,
    drafter: str,
    target: str | None,
    prompts_path: str | None,
    chat: bool,
    template_kwargs: str | None,
    max_new_tokens: int,
    ignore_eos: bool,
    device: str,
    suite: tuple[list[Prompt], str] | None = None,
) -> Offline:
    """``dflash eval`` on the same prompts, here (loads the target and the drafter: slow): the prompts
    file, or ``suite`` (``suite_prompts``' prompts and sha256), rendered with the target's chat template."""
    from dflash.eval.evaluate import evaluate, load_setup  # torch and transformers: only --drafter needs them

    s = load_setup(
        drafter=drafter,
        target=target,
        prompts=prompts_path,
        device=device,
        chat=chat,
        template_kwargs=template_kwargs,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        suite=suite is not None,
    )
    prompts: t.Sequence[t.Sequence[int]] = s.prompts
    protocol = dict(s.prompt_protocol)
    sha = sha256_file(Path(prompts_path)) if prompts_path is not None else None
    if suite is not None:
        assert s.renderer is not None  # load_setup makes one for suites
        prompts = [s.renderer.prompt_ids(p.messages or []) for p in suite[0]]
        sha = suite[1]
        protocol["prompts_sha256"] = sha
    report = evaluate(
        s.target,
        s.drafter,
        prompts,
        max_new_tokens=max_new_tokens,
        drafter_name=s.drafter_name,
        untrained=s.untrained,
        step=s.step,
        target_name=s.target_name,
        prompts_name=s.prompts_name,
        ddtree_budget=None,
        stop_token_ids=s.stop_token_ids,
        protocol=protocol,
    )
    return _offline(report.to_json(), f"computed: dflash eval --drafter {drafter}", sha)


# --------------------------------------------------------------------------------------------
# The server


@dataclasses.dataclass(frozen=True)
class SpecDetails:
    """SGLang's per-request ``sglext.spec_tokens_details`` (entrypoints/openai/protocol.py
    ``SpecTokensDetails``): verify steps, and how many steps accepted j drafts
    (``spec_correct_drafts_histogram[j]``, managers/schedule_batch.py)."""

    verify_ct: int
    histogram: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Completion:
    tokens: int
    seconds: float
    spec: SpecDetails | None = None


MAX_HISTOGRAM = 1024  # draft positions a histogram may name (a block is at most a few dozen)


def _count(value: t.Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def spec_details(out: dict[str, t.Any], where: str) -> SpecDetails | None:
    """The answer's ``sglext.spec_tokens_details`` (None: the server gave none); a value that is not
    SGLang's is a server error (one line), never a figure."""
    ext = out.get("sglext")
    details = ext.get("spec_tokens_details") if isinstance(ext, dict) else None
    if details is None:
        return None
    if isinstance(details, list) and len(details) == 1:  # n > 1 gives a list; we ask for one choice
        details = details[0]
    verify = details.get("spec_verify_ct") if isinstance(details, dict) else None
    hist = details.get("spec_correct_drafts_histogram") if isinstance(details, dict) else None
    if (
        not _count(verify)
        or not isinstance(hist, list)
        or len(hist) > MAX_HISTOGRAM
        or not all(_count(h) for h in hist)
        or (hist and sum(hist) != verify)
    ):
        raise ServerError(
            f"{PREFIX}{where}: sglext.spec_tokens_details is not SGLang's (spec_verify_ct "
            f"{str(verify)[:40]}, spec_correct_drafts_histogram {str(hist)[:80]})"
        )
    return SpecDetails(int(t.cast(int, verify)), tuple(hist))


def _reworded(e: Exception) -> str:
    """regen's client says "regen: ..."; here it is bench serve's line."""
    text = str(e)
    return text if text.startswith(PREFIX) else PREFIX + text.removeprefix("regen: ")


class BenchClient(OpenAIGenerator):
    """regen's OpenAI client (its retries, timeouts and one-line errors), asked for one completion at a
    time with what a benchmark needs back: the completion's token count and its latency."""

    def __init__(
        self,
        server: str,
        *,
        model: str | None,
        kwargs: dict[str, t.Any],
        max_new_tokens: int,
        ignore_eos: bool,
        timeout: float,
        retries: int,
        details: bool = False,
    ) -> None:
        super().__init__(server, model=model, kwargs=kwargs, concurrency=1, timeout=timeout, retries=retries)
        self.max_new_tokens = max_new_tokens
        self.ignore_eos = ignore_eos
        self.details = details  # SGLang: ask each answer for its speculative-decoding details

    def complete(self, prompt: Prompt) -> Completion:
        body: dict[str, t.Any] = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": self.max_new_tokens,
            "stream": False,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and SGLang's extra sampling parameter
        if self.details:
            body["return_spec_tokens_details"] = True  # SGLang's (entrypoints/openai/protocol.py)
        if prompt.messages is not None:
            path = "/chat/completions"
            body["messages"] = prompt.messages
            if self.kwargs:
                body["chat_template_kwargs"] = self.kwargs
        else:
            path = "/completions"
            body["prompt"] = prompt.token_ids if prompt.token_ids is not None else prompt.text
        t0 = time.perf_counter()
        out = self.request(path, body)
        seconds = time.perf_counter() - t0
        usage = out.get("usage")
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise ServerError(f"{PREFIX}{self.base}{path}: the answer has no usage.completion_tokens")
        if not 0 <= tokens <= self.max_new_tokens:
            raise ServerError(
                f"{PREFIX}{self.base}{path}: usage.completion_tokens {str(tokens)[:40]} is outside "
                f"0..{self.max_new_tokens} (the max_tokens asked for)"
            )
        return Completion(tokens, seconds, spec_details(out, f"{self.base}{path}") if self.details else None)


def metrics_url(server: str) -> str:
    """The server's Prometheus endpoint: ``/metrics`` at its root (vLLM and SGLang alike)."""
    base = server.rstrip("/")
    return base.removesuffix("/v1") + "/metrics"


METRICS_LINE_BYTES = 64 << 10  # one exposition line at most; a longer one is dropped unread
METRICS_KEPT_BYTES = 4 << 20  # of the lines used, at most this (an engine's are a few KiB)


class _Get:
    """A GET whose whole exchange ends by ``timeout``: a watchdog shuts the socket then (a per-read timeout
    never ends a server that drips a byte at a time). ``late``: the deadline came."""

    def __init__(self, url: str, timeout: float) -> None:
        u = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        self.conn = cls(u.hostname or "", u.port, timeout=timeout)
        self.late = threading.Event()
        self.watchdog = threading.Timer(timeout, self._deadline)
        self.watchdog.daemon = True
        self.watchdog.start()
        self.path = u.path + (f"?{u.query}" if u.query else "")
        self.sock: socket.socket | None = None

    def _deadline(self) -> None:
        self.late.set()
        sock = self.sock or self.conn.sock
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def response(self) -> http.client.HTTPResponse:
        self.conn.request("GET", self.path)
        # an answer that closes the connection takes the socket off ``conn`` (the response reads it): keep it
        self.sock = self.conn.sock
        if self.late.is_set():
            self._deadline()
        return self.conn.getresponse()

    def close(self) -> None:
        self.watchdog.cancel()
        self.conn.close()


def scrape(url: str, timeout: float) -> str:
    """One GET of /metrics, whole within ``timeout``, streamed: only the lines of the metrics
    ``engine_metrics.read`` uses are kept (a server's /metrics of any size costs their bytes, at most
    ``METRICS_KEPT_BYTES``). ServeBenchError (one line) when it does not answer in time."""
    get = _Get(url, timeout)
    try:
        resp = get.response()
        if resp.status >= 300:
            raise ServeBenchError(
                f"{PREFIX}{url} answered {resp.status} {resp.reason} (SGLang serves /metrics only with "
                "--enable-metrics)"
            )
        kept, size, tail, skip = [], 0, b"", False
        while chunk := resp.read1(1 << 16):
            pieces = (tail + chunk).split(b"\n")
            tail = pieces.pop()
            if skip and pieces:  # the end of a line too long to keep
                pieces[0], skip = b"", False
            if len(tail) > METRICS_LINE_BYTES:
                tail, skip = b"", True
            for line in pieces:
                if line.startswith(engine_metrics.PREFIXES) and engine_metrics.used(line):
                    size += len(line) + 1
                    if size > METRICS_KEPT_BYTES:
                        raise ServerError(
                            f"{PREFIX}{url}: more than {METRICS_KEPT_BYTES >> 20} MiB of speculative-decoding "
                            "samples: not an engine's /metrics"
                        )
                    kept.append(line)
        if not skip and tail.startswith(engine_metrics.PREFIXES) and engine_metrics.used(tail):
            kept.append(tail)  # a last line without its newline
        if get.late.is_set():
            raise TimeoutError
        return b"\n".join(kept).decode("utf-8", "replace")
    except TimeoutError:
        raise ServeBenchError(f"{PREFIX}cannot read {url} within {timeout:g}s") from None
    except (OSError, http.client.HTTPException) as e:
        if get.late.is_set():
            raise ServeBenchError(f"{PREFIX}cannot read {url} within {timeout:g}s") from None
        raise ServeBenchError(f"{PREFIX}cannot reach {url}: {getattr(e, 'reason', None) or e}") from None
    finally:
        get.close()


def fetch_json(url: str, timeout: float, limit: int = 1 << 20) -> dict[str, t.Any] | None:
    """A small JSON object from ``url`` (the engine's /version, /server_info), or None: whole within
    ``timeout``, at most ``limit`` bytes; a server without it, or any fault, is None (it only informs)."""
    get = _Get(url, timeout)
    try:
        resp = get.response()
        if resp.status != 200:
            return None
        raw = resp.read(limit + 1)
        if get.late.is_set() or len(raw) > limit:
            return None
        out = inputs.loads(raw)
        return out if isinstance(out, dict) else None
    except (OSError, http.client.HTTPException, ValueError):  # inputs.JsonProblem is a ValueError
        return None
    finally:
        get.close()


@dataclasses.dataclass(frozen=True)
class Identity:
    """Which engine build serves: its version (vLLM ``/version``; SGLang ``/server_info``'s ``version``),
    SGLang's ``max_running_requests`` and block (``speculative_num_draft_tokens``) there, and the server's
    model card (``/v1/models``: vLLM's has ``root`` and ``max_model_len``)."""

    engine: str
    version: str | None
    max_running_requests: int | None = None
    block_size: int | None = None
    model_card: dict[str, t.Any] | None = None


SGLANG_DFLASH_MAX_RUNNING = 48  # DFLASH's default (srt/arg_groups/speculative_hook.py ``_handle_dflash``)
CARD_KEYS = ("id", "root", "parent", "max_model_len", "owned_by")


def _short(value: t.Any) -> t.Any:
    """A value an engine answered, as the report keeps it: a short string or a finite number, else None."""
    if isinstance(value, str):
        return value[:200]
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def identify(server: str, engine: str, client: OpenAIGenerator, timeout: float) -> Identity:
    """The engine's identity; what a server does not answer is None (it only informs the report)."""
    root = server.rstrip("/").removesuffix("/v1")
    card = None
    try:
        models = client.request("/models", None).get("data")
        mine = [m for m in models or [] if isinstance(m, dict) and m.get("id") == client.model]
        if mine:
            card = {k: _short(mine[0][k]) for k in CARD_KEYS if k in mine[0]}
    except (ServerError, RegenError, AttributeError, TypeError):
        card = None
    if engine == "vllm":
        version = (fetch_json(root + "/version", timeout) or {}).get("version")
        return Identity(engine, _short(version), model_card=card)
    info = fetch_json(root + "/server_info", timeout) or {}
    running, block = _short(info.get("max_running_requests")), _short(info.get("speculative_num_draft_tokens"))
    return Identity(
        engine,
        _short(info.get("version")),
        running if isinstance(running, int) else None,
        block if isinstance(block, int) else None,
        card,
    )


def reading(url: str, timeout: float) -> engine_metrics.Reading:
    """One parsed scrape; a text that is not Prometheus exposition is a failure of the server (one line)."""
    text = scrape(url, timeout)
    try:
        return engine_metrics.read(text)
    except engine_metrics.MetricsError as e:
        raise ServerError(f"{PREFIX}{url}: not Prometheus metrics: {e}") from None


def _settled(url: str, timeout: float, settle: float) -> engine_metrics.Reading:
    """A reading once two in a row agree (the engine records a step's counters as it answers; give the
    last ones a moment): at most 20 tries."""
    last = reading(url, timeout)
    for _ in range(20):
        time.sleep(settle)
        now = reading(url, timeout)
        if now == last:
            return now
        last = now
    return last


# --------------------------------------------------------------------------------------------
# The run


def percentile(values: t.Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


SGLANG_DETAILS = "sglang per-request spec_tokens_details (this build has no sglang:spec_verify_calls_total)"
DETAILS_POSITIONS = "by position from each request's spec_tokens_details"
CLIFF_HIGH = 0.2  # a position accepted at least this often...
CLIFF_ZERO = 0.02  # ...followed by positions all accepted at most this often


def from_details(done: t.Sequence[Completion], block_size: int | None) -> tuple[float, tuple[float, ...], int] | None:
    """SGLang's per-request details over a level: (completion tokens / verify steps, acceptance by
    position, verify steps); None unless every request carried them. Position k's acceptance is the share
    of verify steps that accepted at least k drafts (accepted drafts are a prefix of the block)."""
    specs = [d.spec for d in done]
    if not specs or any(x is None for x in specs):
        return None
    details = [x for x in specs if x is not None]
    verify = sum(x.verify_ct for x in details)
    if verify <= 0:
        return None
    hist = [0] * max((len(x.histogram) for x in details), default=0)
    for x in details:
        for j, n in enumerate(x.histogram):
            hist[j] += n
    positions = (block_size - 1) if block_size and block_size > 1 else max(len(hist) - 1, 0)
    steps = sum(hist) or verify
    per_pos = tuple(sum(hist[k:]) / steps for k in range(1, positions + 1))
    return sum(d.tokens for d in done) / verify, per_pos, verify


def level_acceptance(
    before: engine_metrics.Reading,
    after: engine_metrics.Reading,
    done: t.Sequence[Completion],
    block_size: int | None,
) -> engine_metrics.Acceptance:
    """The level's acceptance: the counters' deltas (vLLM; SGLang's when its build has them), else SGLang's
    per-request details, else its gauge; SGLang's acceptance by position from the details."""
    a = engine_metrics.acceptance(before, after)
    if after.engine != "sglang" or a.why in (engine_metrics.RESET, "a counter of the server is not a finite number"):
        return a
    got = from_details(done, block_size)
    if got is None:
        return a
    length, per_pos, verify = got
    if a.source == engine_metrics.SGLANG_COUNTERS:
        return dataclasses.replace(a, per_position=per_pos, source=f"{a.source}; {DETAILS_POSITIONS}")
    return engine_metrics.Acceptance(length, SGLANG_DETAILS, float(verify), per_position=per_pos)


@dataclasses.dataclass(frozen=True)
class Cliff:
    """Acceptance by position high up to ``position - 1``, near 0 from ``position`` on."""

    position: int  # 1-based: the first position near 0
    before: float
    after: float


def find_cliff(per_position: t.Sequence[float]) -> Cliff | None:
    """The per-position cliff: a position accepted at least CLIFF_HIGH of the time, and every later one at
    most CLIFF_ZERO. A drafter's own acceptance decays over positions; an engine that serves sliding layers
    as full attention (or captures other target layers) cuts it off."""
    p = list(per_position)
    for k in range(1, len(p)):
        if p[k - 1] >= CLIFF_HIGH and max(p[k:]) <= CLIFF_ZERO:
            return Cliff(k + 1, p[k - 1], p[k])
    return None


@dataclasses.dataclass(frozen=True)
class Level:
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    latencies: list[float]
    acceptance: engine_metrics.Acceptance

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else math.nan

    @property
    def cliff(self) -> Cliff | None:
        return find_cliff(self.acceptance.per_position)

    def to_json(self) -> dict[str, t.Any]:
        a = self.acceptance
        return {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "seconds": self.seconds,
            "output_tokens_per_s": self.tokens_per_s,
            "latency_s": {
                "p50": percentile(self.latencies, 50),
                "p90": percentile(self.latencies, 90),
                "p99": percentile(self.latencies, 99),
                "mean": sum(self.latencies) / len(self.latencies),
            },
            "acceptance_length": a.length,
            "acceptance_source": a.source,
            "acceptance_none": a.why if a.length is None else None,
            "drafts": a.drafts,
            "draft_tokens": a.draft_tokens,
            "accepted_tokens": a.accepted,
            "position_acceptance": list(a.per_position),
            "cliff": dataclasses.asdict(self.cliff) if self.cliff else None,
        }


@dataclasses.dataclass(frozen=True)
class BenchReport:
    server: str
    engine: str
    model: str
    prompts: str
    prompts_sha256: str | None
    num_prompts: int
    max_new_tokens: int
    ignore_eos: bool
    chat_template_kwargs: dict[str, t.Any]
    levels: list[Level]
    offline: Offline | None
    identity: Identity | None = None

    @property
    def max_running(self) -> tuple[int, str] | None:
        """SGLang's cap on requests in flight, and where it comes from."""
        if self.engine != "sglang":
            return None
        if self.identity is not None and self.identity.max_running_requests is not None:
            return self.identity.max_running_requests, "/server_info"
        return SGLANG_DFLASH_MAX_RUNNING, "DFLASH's default unless --max-running-requests is given"

    def to_json(self) -> dict[str, t.Any]:
        ident = self.identity
        return {
            "server": self.server,
            "engine": self.engine,
            "engine_version": ident.version if ident else None,
            "model": self.model,
            "model_card": ident.model_card if ident else None,
            "max_running_requests": self.max_running[0] if self.max_running else None,
            "prompts": self.prompts,
            "prompts_sha256": self.prompts_sha256,
            "num_prompts": self.num_prompts,
            "max_new_tokens": self.max_new_tokens,
            "ignore_eos": self.ignore_eos,
            "temperature": 0.0,
            "chat_template_kwargs": self.chat_template_kwargs,
            "levels": [lv.to_json() for lv in self.levels],
            "offline": dataclasses.asdict(self.offline) if self.offline else None,
        }

    def _cliff_line(self, lv: Level, cliff: Cliff) -> str:
        k = cliff.position
        line = (
            f"cliff at concurrency {lv.concurrency}: acceptance by position falls from {cliff.before:.2f} at "
            f"position {k - 1} to {cliff.after:.2f} at position {k} and stays near 0"
        )
        o = self.offline
        if o is None or len(o.position_acceptance) < k:
            return (
                line + ": the signature of sliding layers served as full attention, or of other target layers "
                "captured; compare with dflash eval on the same prompts (--eval or --drafter)"
            )
        offline = o.position_acceptance[k - 1]
        if offline > CLIFF_ZERO * 5:
            return (
                line + f"; offline (dflash eval) {offline:.2f} there: the engine, not the drafter (sliding "
                "layers served as full attention, or other target layers captured)"
            )
        return line + f"; offline (dflash eval) {offline:.2f} there too: the drafter's own"

    def lines(self) -> list[str]:
        engine = {"vllm": "vLLM", "sglang": "SGLang"}.get(self.engine, self.engine)
        version = self.identity.version if self.identity and self.identity.version else "version unknown"
        each = f"up to {self.max_new_tokens} new tokens each" + (" (past EOS)" if self.ignore_eos else "")
        out = [
            f"server:  {self.server} ({engine} {version}, model {self.model})",
            f"prompts: {self.num_prompts} from {self.prompts}, {each}, temperature 0",
            "concurrency  requests  out tokens  seconds  out tok/s  latency p50 / p90 / p99 s  acceptance length",
        ]
        for lv in self.levels:
            a = lv.acceptance
            al = f"{a.length:.2f}" if a.length is not None else f"none ({a.why})" if a.why else "none"
            if a.drafts and a.length is not None:
                al += f" ({int(a.drafts)} {'verify steps' if self.engine == 'sglang' else 'drafts'})"
            out.append(
                f"{lv.concurrency:>11}  {lv.requests:>8}  {lv.output_tokens:>10}  {lv.seconds:>7.2f}  "
                f"{lv.tokens_per_s:>9.1f}  {percentile(lv.latencies, 50):>7.3f} / {percentile(lv.latencies, 90):.3f} / "
                f"{percentile(lv.latencies, 99):.3f}  {al}"
            )
        sources = list(dict.fromkeys(lv.acceptance.source for lv in self.levels))
        if len(sources) == 1:
            out.append(f"acceptance length from the server: {sources[0]}")
        else:
            out += [f"acceptance length at concurrency {lv.concurrency}: {lv.acceptance.source}" for lv in self.levels]
        cap = self.max_running
        for lv in self.levels:
            if cap is not None and lv.concurrency > cap[0]:
                out.append(
                    f"concurrency {lv.concurrency}: above SGLang's max_running_requests {cap[0]} ({cap[1]}): the "
                    f"requests past it queue, so at most {cap[0]} are decoded at once"
                )
        for lv in self.levels:
            if lv.acceptance.per_position:
                out.append(
                    f"acceptance by position (1..B-1), concurrency {lv.concurrency}: "
                    + " ".join(f"{x:.2f}" for x in lv.acceptance.per_position)
                )
        o = self.offline
        if o is not None:
            if o.same_prompts is None:
                same = "prompts it does not name"
            else:
                same = "the same prompts file (sha256)" if o.same_prompts else "NOT the same prompts (sha256 differs)"
            each = f", up to {o.max_new_tokens} new tokens each" if o.max_new_tokens else ""
            out.append(f"offline tau (dflash eval, {o.source}): {o.tau:.2f} on {same}{each}")
            if o.position_acceptance:
                out.append(
                    "offline acceptance by position (1..B-1): " + " ".join(f"{x:.2f}" for x in o.position_acceptance)
                )
        for lv in self.levels:
            if lv.cliff is not None:
                out.append(self._cliff_line(lv, lv.cliff))
        return out


def bench(
    server: str,
    prompts: t.Sequence[Prompt],
    concurrency: t.Sequence[int],
    *,
    prompts_name: str,
    prompts_sha256: str | None = None,
    model: str | None = None,
    max_new_tokens: int = 64,
    ignore_eos: bool = False,
    chat_template_kwargs: dict[str, t.Any] | None = None,
    offline: Offline | None = None,
    warmup: int = 1,
    timeout: float = 600.0,
    retries: int = 2,
    settle: float = 0.2,
    log: t.Callable[[str], None] | None = None,
) -> BenchReport:
    """Every prompt once per concurrency level, ``c`` requests in flight; the server's acceptance per level.

    ``ServeBenchError`` (one line) before any request when the inputs or the server are not usable;
    ``regen.ServerError`` when the server fails during the run."""
    if not prompts:
        raise ServeBenchError(f"{PREFIX}no prompts")
    if not concurrency or any(c < 1 for c in concurrency):
        raise ServeBenchError(f"{PREFIX}--concurrency: expected positive integers, got {list(concurrency)}")
    if not server.startswith(("http://", "https://")):
        raise ServeBenchError(f"{PREFIX}--server {server}: expected an http:// or https:// URL")
    url = metrics_url(server)
    probe = min(timeout, 10.0)
    first = reading(url, probe)
    if first.engine is None:
        raise ServeBenchError(
            f"{PREFIX}{url} has no speculative-decoding metrics ({engine_metrics.VLLM_DRAFTS} or "
            f"{engine_metrics.SGLANG_ACCEPT_LENGTH}): is a drafter served (vLLM --speculative-config, "
            "SGLang --speculative-algorithm DFLASH --enable-metrics)?"
        )
    try:
        client = BenchClient(
            server,
            model=model,
            kwargs=dict(chat_template_kwargs or {}),
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            timeout=timeout,
            retries=retries,
            details=first.engine == "sglang",
        )
    except RegenError as e:
        raise ServeBenchError(_reworded(e)) from None
    except ServerError as e:
        raise ServeBenchError(_reworded(e)) from None
    identity = identify(server, str(first.engine), client, probe)
    levels = []
    try:
        for _ in range(warmup):  # a fresh engine compiles and captures graphs on its first requests
            client.complete(prompts[0])
        for c in concurrency:
            before = _settled(url, probe, settle)
            t0 = time.perf_counter()
            pool = cf.ThreadPoolExecutor(c, thread_name_prefix="bench-request")
            try:
                futures = [pool.submit(client.complete, p) for p in prompts]
                cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
                failed = next((f.exception() for f in futures if f.done() and f.exception() is not None), None)
                if failed is not None:
                    raise failed
                done = [f.result() for f in futures]
            finally:  # a failure: the requests not yet sent are not sent (those in flight end by themselves)
                pool.shutdown(wait=True, cancel_futures=True)
            seconds = time.perf_counter() - t0
            after = _settled(url, probe, settle)
            level = Level(
                c,
                len(done),
                sum(d.tokens for d in done),
                seconds,
                [d.seconds for d in done],
                level_acceptance(before, after, done, identity.block_size),
            )
            levels.append(level)
            if log is not None:
                log(f"{PREFIX}concurrency {c}: {level.requests} requests in {seconds:.1f}s")
    except ServerError as e:
        raise ServerError(_reworded(e)) from None
    finally:
        client.close()
    return BenchReport(
        server=server,
        engine=str(first.engine),
        model=client.model,
        prompts=prompts_name,
        prompts_sha256=prompts_sha256,
        num_prompts=len(prompts),
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        chat_template_kwargs=dict(chat_template_kwargs or {}),
        levels=levels,
        offline=offline,
        identity=identity,
    )
