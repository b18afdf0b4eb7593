"""A serving engine's speculative-decoding figures, read from its Prometheus ``/metrics`` text.

vLLM (vllm/v1/spec_decode/metrics.py ``SpecDecodingProm``): counters ``vllm:spec_decode_num_drafts``,
``vllm:spec_decode_num_draft_tokens``, ``vllm:spec_decode_num_accepted_tokens`` and
``vllm:spec_decode_num_accepted_tokens_per_pos{position="k"}``, labelled ``engine`` and ``model_name``,
which prometheus_client exposes as ``NAME_total`` (plus a ``NAME_created`` gauge, ignored here). They
exist only when the server runs a drafter (``--speculative-config``). Over an interval the acceptance
length is ``1 + d(accepted) / d(drafts)`` (that class's docstring: "conventionally including bonus
tokens"): tokens per target forward, the convention of ``dflash eval``'s tau. One engine's counters are
summed over its label sets (data-parallel engines, served model names).

SGLang (python/sglang/srt/metrics/collector.py ``SchedulerMetricsCollector``): gauges
``sglang:spec_accept_length`` ("The average acceptance length of speculative decoding.") and
``sglang:spec_accept_rate``, labelled ``engine_type, model_name, moe_ep_rank, pp_rank, tp_rank`` (and
``dp_rank``). The scheduler sets them at each decode log interval (``--decode-log-interval``, 40 decode
steps by default) to that interval's mean, and ``/metrics`` answers only with ``--enable-metrics``. There
are no counters, so SGLang's figure is the last logged interval's (averaged over ranks here), not a delta.
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


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def read(text: str) -> Reading:
    """The speculative-decoding figures of a /metrics text (vLLM's counters or SGLang's gauges)."""
    samples = parse(text)
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    if VLLM_DRAFTS in by_name and VLLM_ACCEPTED in by_name:
        positions: dict[int, float] = {}
        for s in by_name.get(VLLM_PER_POSITION, []):
            try:
                k = int(s.labels.get("position", ""))
            except ValueError:
                continue
            positions[k] = positions.get(k, 0.0) + s.value
        return Reading(
            "vllm",
            drafts=sum(s.value for s in by_name[VLLM_DRAFTS]),
            draft_tokens=sum(s.value for s in by_name.get(VLLM_DRAFT_TOKENS, [])),
            accepted=sum(s.value for s in by_name[VLLM_ACCEPTED]),
            per_position=tuple(positions.get(k, 0.0) for k in range(max(positions, default=-1) + 1)),
        )
    if SGLANG_ACCEPT_LENGTH in by_name:
        return Reading(
            "sglang",
            accept_length=_mean([s.value for s in by_name[SGLANG_ACCEPT_LENGTH]]),
            accept_rate=_mean([s.value for s in by_name.get(SGLANG_ACCEPT_RATE, [])]),
        )
    return Reading(None)


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """Acceptance between two readings. ``length`` None: the server did not speculate in between."""

    length: float | None
    source: str  # how it was measured, said in the report
    drafts: float | None = None
    draft_tokens: float | None = None
    accepted: float | None = None
    per_position: tuple[float, ...] = ()  # share of drafts whose draft k+1 was accepted (vLLM)


def acceptance(before: Reading, after: Reading) -> Acceptance:
    """vLLM: ``1 + d(accepted) / d(drafts)`` and per-position rates from the counters' deltas; SGLang: the
    gauge after (its last logged interval; 0 means it has not speculated)."""
    if after.engine == "vllm":
        drafts = after.drafts - before.drafts
        accepted = after.accepted - before.accepted
        if drafts <= 0:
            return Acceptance(None, "vllm counters: no drafts", 0.0, 0.0, 0.0)
        n = max(len(before.per_position), len(after.per_position))
        pad = (0.0,) * n
        per_pos = tuple(
            (a - b) / drafts for a, b in zip((after.per_position + pad)[:n], (before.per_position + pad)[:n])
        )
        return Acceptance(
            1.0 + accepted / drafts,
            "vllm counters",
            drafts,
            after.draft_tokens - before.draft_tokens,
            accepted,
            per_pos,
        )
    if after.engine == "sglang":
        length = after.accept_length if after.accept_length else None
        return Acceptance(length, "sglang gauge (last log interval)")
    return Acceptance(None, "no speculative-decoding metrics")
