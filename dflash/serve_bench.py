"""``dflash bench serve``: the drafter measured where it is served, beside ``dflash eval``'s offline tau.

    dflash bench serve --server http://127.0.0.1:8000 --prompts eval.jsonl --concurrency 1,8,32
                       [--eval eval.json | --drafter CKPT [--target PATH]] [--json bench.json]

It sends every prompt to a running OpenAI-compatible server that serves a target with a drafter (vLLM
``--speculative-config``, SGLang ``--speculative-algorithm DFLASH --enable-metrics``), once per
concurrency level with that many requests in flight (greedy: temperature 0), and reports per level:

- the acceptance length from the server's own Prometheus ``/metrics`` (``dflash.engine_metrics``): vLLM's
  counters as deltas over the level, ``1 + accepted / drafts``, and the acceptance by draft position;
  SGLang's ``sglang:spec_accept_length`` gauge as it stands after the level (its last logged interval);
- output tokens per second (the completions' ``usage.completion_tokens`` over the level's wall time) and
  the end-to-end request latency's p50, p90 and p99;

and beside them the offline tau of ``dflash eval`` on the same prompts: from a ``dflash eval --json``
report (``--eval``; its prompts file's sha256 says whether they are the same prompts), or computed here
(``--drafter``). Both count tokens per target forward (accepted drafts + the target's own token).

Prompts come from a function (``read_prompts(path)`` for ``--prompts FILE``): chat records (OpenAI
``messages`` / ShareGPT ``conversations``: the turns before the first assistant turn, sent to
``/v1/chat/completions``), ``{"prompt": "text"}`` or ``{"input_ids": [...]}`` (sent to ``/v1/completions``).

Requests go through ``dflash.regen.OpenAIGenerator``'s client (its timeouts, retries and one-line
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
import time
import typing as t
import urllib.error
import urllib.request
from pathlib import Path

from dflash import engine_metrics
from dflash.errors import BadInput
from dflash.regen import OpenAIGenerator, RegenError, ServerError

__all__ = [
    "BenchReport",
    "Level",
    "Offline",
    "Prompt",
    "ServeBenchError",
    "bench",
    "offline_from_report",
    "parse_concurrency",
    "percentile",
    "read_prompts",
    "sha256_file",
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
    from dflash.chat import BadRecord
    from dflash.evaluate import EvalError, prompt_messages, read_records, token_prompt

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ServeBenchError(f"{PREFIX}--prompts: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ServeBenchError(f"{PREFIX}--prompts: {path} is not UTF-8 text") from None
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


def offline_from_report(path: str | os.PathLike[str], prompts_path: str | os.PathLike[str] | None) -> Offline:
    """A ``dflash eval --json`` report; ``same_prompts``: its prompts file's sha256 against ours."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ServeBenchError(f"{PREFIX}--eval: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ServeBenchError(f"{PREFIX}--eval: {path} is not JSON ({e})") from None
    return _offline(report, str(path), prompts_path)


def _offline(report: t.Any, source: str, prompts_path: str | os.PathLike[str] | None) -> Offline:
    if not isinstance(report, dict) or not isinstance(report.get("tau"), (int, float)):
        raise ServeBenchError(f"{PREFIX}--eval: {source} is not a report of `dflash eval --json` (no tau)")
    proto = report.get("protocol") or {}
    sha = proto.get("prompts_sha256")
    same = None if not sha or prompts_path is None else sha == sha256_file(Path(prompts_path))
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
    prompts_path: str,
    chat: bool,
    template_kwargs: str | None,
    max_new_tokens: int,
    ignore_eos: bool,
    device: str,
) -> Offline:
    """``dflash eval`` on the same prompts file, here (loads the target and the drafter: slow)."""
    from dflash.evaluate import evaluate, load_setup

    s = load_setup(
        drafter=drafter,
        target=target,
        prompts=prompts_path,
        device=device,
        chat=chat,
        template_kwargs=template_kwargs,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
    )
    report = evaluate(
        s.target,
        s.drafter,
        s.prompts,
        max_new_tokens=max_new_tokens,
        drafter_name=s.drafter_name,
        untrained=s.untrained,
        step=s.step,
        target_name=s.target_name,
        prompts_name=s.prompts_name,
        ddtree_budget=None,
        stop_token_ids=s.stop_token_ids,
        protocol=s.prompt_protocol,
    )
    return _offline(report.to_json(), f"computed: dflash eval --drafter {drafter}", prompts_path)


# --------------------------------------------------------------------------------------------
# The server


@dataclasses.dataclass(frozen=True)
class Completion:
    tokens: int
    seconds: float


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
    ) -> None:
        super().__init__(server, model=model, kwargs=kwargs, concurrency=1, timeout=timeout, retries=retries)
        self.max_new_tokens = max_new_tokens
        self.ignore_eos = ignore_eos

    def complete(self, prompt: Prompt) -> Completion:
        body: dict[str, t.Any] = {
            "model": self.model,
            "temperature": 0,
            "max_tokens": self.max_new_tokens,
            "stream": False,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and SGLang's extra sampling parameter
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
        tokens = (out.get("usage") or {}).get("completion_tokens")
        if isinstance(tokens, bool) or not isinstance(tokens, int):
            raise ServerError(f"{PREFIX}{self.base}{path}: the answer has no usage.completion_tokens")
        return Completion(tokens, seconds)


def metrics_url(server: str) -> str:
    """The server's Prometheus endpoint: ``/metrics`` at its root (vLLM and SGLang alike)."""
    base = server.rstrip("/")
    return base.removesuffix("/v1") + "/metrics"


def scrape(url: str, timeout: float) -> str:
    """One GET of /metrics; ServeBenchError (one line) when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return t.cast(bytes, resp.read()).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise ServeBenchError(
            f"{PREFIX}{url} answered {e.code} {e.reason} (SGLang serves /metrics only with --enable-metrics)"
        ) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as e:
        raise ServeBenchError(f"{PREFIX}cannot reach {url}: {getattr(e, 'reason', None) or e}") from None


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
            "drafts": a.drafts,
            "draft_tokens": a.draft_tokens,
            "accepted_tokens": a.accepted,
            "position_acceptance": list(a.per_position),
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

    def to_json(self) -> dict[str, t.Any]:
        return {
            "server": self.server,
            "engine": self.engine,
            "model": self.model,
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

    def lines(self) -> list[str]:
        engine = {"vllm": "vLLM", "sglang": "SGLang"}.get(self.engine, self.engine)
        each = f"up to {self.max_new_tokens} new tokens each" + (" (past EOS)" if self.ignore_eos else "")
        out = [
            f"server:  {self.server} ({engine}, model {self.model})",
            f"prompts: {self.num_prompts} from {self.prompts}, {each}, temperature 0",
            "concurrency  requests  out tokens  seconds  out tok/s  latency p50 / p90 / p99 s  acceptance length",
        ]
        for lv in self.levels:
            a = lv.acceptance
            al = f"{a.length:.2f}" if a.length is not None else "none"
            if a.drafts:
                al += f" ({int(a.drafts)} drafts)"
            out.append(
                f"{lv.concurrency:>11}  {lv.requests:>8}  {lv.output_tokens:>10}  {lv.seconds:>7.2f}  "
                f"{lv.tokens_per_s:>9.1f}  {percentile(lv.latencies, 50):>7.3f} / {percentile(lv.latencies, 90):.3f} / "
                f"{percentile(lv.latencies, 99):.3f}  {al}"
            )
        source = self.levels[0].acceptance.source if self.levels else ""
        out.append(f"acceptance length from the server's /metrics: {source}")
        first = next((lv for lv in self.levels if lv.acceptance.per_position), None)
        if first is not None:
            out.append(
                f"acceptance by position (1..B-1), concurrency {first.concurrency}: "
                + " ".join(f"{x:.2f}" for x in first.acceptance.per_position)
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
        )
    except RegenError as e:
        raise ServeBenchError(_reworded(e)) from None
    except ServerError as e:
        raise ServeBenchError(_reworded(e)) from None
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
                engine_metrics.acceptance(before, after),
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
    )
