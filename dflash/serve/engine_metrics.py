"""A serving engine's speculative-decoding figures, read from its Prometheus ``/metrics`` text.

vLLM (vllm/v1/spec_decode/metrics.py ``SpecDecodingProm``): counters ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos{position="k"}``, labelled ``engine`` and ``model_name``,
which prometheus_client exposes as ``NAME_total`` (plus a ``NAME_created`` gauge, ignored here). They
exist only when the server runs a drafter (``--speculative-config``). Over an interval the acceptance
length is ``1 + d(accepted) / d(drafts)`` (that class's docstring: "conventionally including bonus
tokens"): tokens per target forward, the convention of ``dflash eval``'s tau. One engine's counters are
summed over its label sets (data-parallel engines, served model names).

SGLang 0.5.23 (python/sglang/srt/observability/metrics_collector.py): the counters
``sglang:generation_tokens_total`` ("Number of generation tokens processed.", labels ``model_name,
engine_type`` + ``is_streaming``) and ``sglang:spec_verify_calls_total`` ("Number of speculative decoding
verification calls."), both incremented once per FINISHED request (``observe_one_finished_request``: the
request's completion tokens and its ``spec_verify_ct``). Over an interval the acceptance length is
``d(generation tokens) / d(verify calls)``: SGLang's own per-request ``spec_accept_length``
(``completion_tokens / spec_verify_ct``, managers/tokenizer_manager.py), which counts the prefill's token
too (1 / verify calls above vLLM's convention per request). Builds without those counters have only the
gauges ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate`` (the scheduler sets them at each
decode log interval, ``--decode-log-interval``, 40 decode steps by default, to that interval's mean):
their figure is the last logged interval's (averaged over ranks here), not a delta, and is used only then.
``/metrics`` answers only with ``--enable-metrics``.

A counter that went down between two readings was reset (an engine restart, two replicas behind one
address), and a counter that is not a finite number is no count: either gives no acceptance for the
interval, said in words, never a negative or NaN figure. So do counts that cannot all be true (more
tokens accepted than drafted, a position accepted more often than there were drafts, positions that do not
sum to the accepted tokens): ``none (inconsistent counters: ...)``, never an acceptance of 13 from 4-token
drafts.
"""

from __future__ import annotations

import dataclasses
import math

from dflash.errors import DflashError

__all__ = [
    "Acceptance",
    "MetricsError",
    "Reading",
    "Sample",
    "acceptance",
    "parse",
    "read",
]

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"
SGLANG_VERIFY_CALLS = "sglang:spec_verify_calls_total"
SGLANG_GENERATION_TOKENS = "sglang:generation_tokens_total"

# The only samples read: a scrape keeps these lines and drops the rest as it streams (an engine's /metrics
# holds hundreds of other series; a server's answer of any size costs no more memory than these).
USED = (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, VLLM_PER_POSITION) + (
    SGLANG_ACCEPT_LENGTH,
    SGLANG_ACCEPT_RATE,
    SGLANG_VERIFY_CALLS,
    SGLANG_GENERATION_TOKENS,
)


# prometheus_client's ``NAME_created`` beside a counter: the time it (re)started. A different one between
# two readings is a reset even where the counts went up again (a restart, then more requests than before).
CREATED = tuple(n.removesuffix("_total") + "_created" for n in USED if n.endswith("_total"))


PREFIXES = (b"vllm:spec_decode_", b"sglang:spec_", b"sglang:generation_tokens_")  # a quick first sieve


def used(line: bytes) -> bool:
    """Whether an exposition line is a sample of a metric ``read`` uses."""
    for name in USED + CREATED:
        if line.startswith(name.encode()) and line[len(name) : len(name) + 1] in (b"{", b" ", b"\t"):
            return True
    return False


class MetricsError(DflashError, ValueError):
    """Text that is not the Prometheus exposition format: one line naming the line."""


@dataclasses.dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _labels(text: str, lineno: int) -> tuple[dict[str, str], int]:
    """Parse ``{k="v",...}`` at the start of ``text``; returns the labels and where they end."""
    out: dict[str, str] = {}
    i = 1
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i < len(text) and text[i] == "}":
            return out, i + 1
        eq = text.find("=", i)
        if eq < 0 or eq + 1 >= len(text) or text[eq + 1] != '"':
            raise MetricsError(f"line {lineno}: a label without a quoted value")
        key = text[i:eq].strip()
        j, value = eq + 2, []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\" and j + 1 < len(text):
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(text[j + 1], "\\" + text[j + 1]))
                j += 2
            else:
                value.append(text[j])
                j += 1
        if j >= len(text):
            raise MetricsError(f"line {lineno}: an unterminated label value")
        out[key] = "".join(value)
        i = j + 1


def parse(text: str) -> list[Sample]:
    """Every sample of an exposition text (comments and blank lines skipped; timestamps dropped)."""
    samples = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            labels, end = _labels(line[brace:], lineno)
            rest = line[brace + end :].split()
        else:
            name, *rest = line.split()
            labels = {}
        if not rest:
            raise MetricsError(f"line {lineno}: {name} has no value")
        try:
            value = float(rest[0])  # Go's +Inf, -Inf and NaN spellings are float()'s too
        except ValueError:
            raise MetricsError(f"line {lineno}: {name}: {rest[0]!r} is not a number") from None
        samples.append(Sample(name, labels, value))
    return samples


@dataclasses.dataclass(frozen=True)
class Reading:
    """One scrape's spec-decoding figures. ``engine``: "vllm", "sglang", or None (neither engine's)."""

    engine: str | None
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()
    accept_length: float | None = None  # SGLang's gauge
    accept_rate: float | None = None
    verify_calls: float | None = None  # SGLang's counters (None: a build without them)
    generation_tokens: float | None = None
    created: tuple[tuple[str, float], ...] = ()  # each counter's start time, by name and labels


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def read(text: str) -> Reading:
    """The speculative-decoding figures of a /metrics text (vLLM's counters, SGLang's counters and gauges)."""
    samples = parse(text)
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    created = tuple(
        sorted((f"{s.name}{sorted(s.labels.items())}", s.value) for name in CREATED for s in by_name.get(name, []))
    )
    reading = _read(by_name)
    return dataclasses.replace(reading, created=created) if reading.engine else reading


def _read(by_name: dict[str, list[Sample]]) -> Reading:
    if VLLM_DRAFTS in by_name and VLLM_ACCEPTED in by_name:
        positions: dict[int, float] = {}
        for s in by_name.get(VLLM_PER_POSITION, []):
            try:
                k = int(s.labels.get("position", ""))
            except ValueError:
                continue
            if 0 <= k < 4096:  # a draft position, not a label that would make a list of any length
                positions[k] = positions.get(k, 0.0) + s.value
        return Reading(
            "vllm",
            drafts=sum(s.value for s in by_name[VLLM_DRAFTS]),
            draft_tokens=sum(s.value for s in by_name.get(VLLM_DRAFT_TOKENS, [])),
            accepted=sum(s.value for s in by_name[VLLM_ACCEPTED]),
            per_position=tuple(positions.get(k, 0.0) for k in range(max(positions, default=-1) + 1)),
        )
    if SGLANG_ACCEPT_LENGTH in by_name or SGLANG_VERIFY_CALLS in by_name:
        counters = SGLANG_VERIFY_CALLS in by_name and SGLANG_GENERATION_TOKENS in by_name
        return Reading(
            "sglang",
            accept_length=_mean([s.value for s in by_name.get(SGLANG_ACCEPT_LENGTH, [])]),
            accept_rate=_mean([s.value for s in by_name.get(SGLANG_ACCEPT_RATE, [])]),
            verify_calls=sum(s.value for s in by_name[SGLANG_VERIFY_CALLS]) if counters else None,
            generation_tokens=sum(s.value for s in by_name[SGLANG_GENERATION_TOKENS]) if counters else None,
        )
    return Reading(None)


RESET = "the server's counters reset during the level"
SGLANG_COUNTERS = "sglang counters (generation tokens / verify calls)"
SGLANG_GAUGE = "sglang gauge (last log interval; this build has no sglang:spec_verify_calls_total)"


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Acceptance between two readings. ``length`` None: no figure, ``why`` says why (no speculation in
    between, a counter reset, a counter that is not a number)."""

    length: float | None
    source: str  # how it was measured, said in the report
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    per_position: tuple[float, ...] = ()  # share of drafts whose draft k+1 was accepted
    why: str | None = None


def _counts(before: Reading, after: Reading) -> list[tuple[float, float]]:
    if after.engine == "vllm":
        n = max(len(before.per_position), len(after.per_position))
        pad = (0.0,) * n
        pairs = [(before.drafts, after.drafts), (before.accepted, after.accepted)]
        pairs.append((before.draft_tokens, after.draft_tokens))
        return pairs + list(zip((before.per_position + pad)[:n], (after.per_position + pad)[:n]))
    return [(before.verify_calls or 0.0, after.verify_calls or 0.0)] + [
        (before.generation_tokens or 0.0, after.generation_tokens or 0.0)
    ]


INCONSISTENT = "inconsistent counters"


def inconsistent(drafts: float, draft_tokens: float, accepted: float, positions: list[float]) -> str | None:
    """Why a vLLM interval's counts cannot all be true (None: they can): no more tokens accepted than
    drafted, each position accepted in at most every draft, and the positions summing to the accepted."""
    if draft_tokens > 0 and accepted > draft_tokens:
        return f"{accepted:g} tokens accepted of {draft_tokens:g} drafted"
    for k, c in enumerate(positions):
        if not 0 <= c <= drafts:
            return f"position {k + 1} accepted {c:g} times in {drafts:g} drafts ({100 * c / drafts:.0f}%)"
    if positions and abs(sum(positions) - accepted) > 0.5:  # whole counts: a float's error is far below it
        return f"the positions sum to {sum(positions):g} accepted tokens, the total says {accepted:g}"
    return None


def acceptance(before: Reading, after: Reading) -> Acceptance:
    """vLLM: ``1 + d(accepted) / d(drafts)`` and per-position rates from the counters' deltas; SGLang:
    ``d(generation tokens) / d(verify calls)`` from its counters, else its gauge after (its last logged
    interval; 0 means it has not speculated). A counter that went down or is not finite: no figure."""
    if after.engine == "sglang" and before.verify_calls is not None and after.verify_calls is None:
        return Acceptance(None, SGLANG_COUNTERS, why=RESET)  # restarted: no request has ended since
    counters = after.engine == "vllm" or (after.engine == "sglang" and after.verify_calls is not None)
    source = "vllm counters" if after.engine == "vllm" else SGLANG_COUNTERS
    if counters:
        pairs = _counts(before, after)
        if not all(math.isfinite(v) for pair in pairs for v in pair):
            return Acceptance(None, source, why="a counter of the server is not a finite number")
        started = dict(before.created)
        if any(b > a for b, a in pairs) or any(k in started and started[k] != v for k, v in after.created):
            return Acceptance(None, source, why=RESET)
    if after.engine == "vllm":
        drafts = after.drafts - before.drafts
        accepted = after.accepted - before.accepted
        if drafts <= 0:
            return Acceptance(None, source, 0.0, 0.0, 0.0, why="no drafts")
        n = max(len(before.per_position), len(after.per_position))
        pad = (0.0,) * n
        counts = [a - b for a, b in zip((after.per_position + pad)[:n], (before.per_position + pad)[:n])]
        draft_tokens = after.draft_tokens - before.draft_tokens
        wrong = inconsistent(drafts, draft_tokens, accepted, counts)
        if wrong:
            return Acceptance(None, source, drafts, draft_tokens, accepted, why=f"{INCONSISTENT}: {wrong}")
        per_pos = tuple(c / drafts for c in counts)
        return Acceptance(
            1.0 + accepted / drafts,
            source,
            drafts,
            after.draft_tokens - before.draft_tokens,
            accepted,
            per_pos,
        )
    if after.engine == "sglang" and counters:
        calls = (after.verify_calls or 0.0) - (before.verify_calls or 0.0)
        tokens = (after.generation_tokens or 0.0) - (before.generation_tokens or 0.0)
        if calls <= 0:
            return Acceptance(None, source, 0.0, why="no verify calls")
        return Acceptance(tokens / calls, source, calls)
    if after.engine == "sglang":
        length = after.accept_length if after.accept_length and math.isfinite(after.accept_length) else None
        return Acceptance(length, SGLANG_GAUGE, why=None if length else "the gauge is 0: no speculation logged")
    return Acceptance(None, "no speculative-decoding metrics", why="no speculative-decoding metrics")
