"""EngineDouble: a DOUBLE of a vLLM or SGLang server that serves a target with a DFlash drafter.

No GPU engine runs here, so ``dflash bench serve`` is tested against this: a real HTTP server on
127.0.0.1 that answers what the engines answer (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, ``/metrics``). Its metrics are rendered by prometheus_client, the library both
engines expose theirs with, under the engines' own names, help texts and label sets:

- vLLM (vllm/v1/spec_decode/metrics.py ``SpecDecodingProm``): counters ``vllm:spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (one child
  per position, made at start), labels ``model_name`` and ``engine``; plus ``vllm:generation_tokens``.
  Without a drafter (``spec=False``) vLLM makes none of the spec-decode counters.
- SGLang 0.5.23 (python/sglang/srt/observability/metrics_collector.py): the scheduler's gauges
  ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate``, labels ``engine_type, model_name,
  moe_ep_rank, pp_rank, tp_rank``, set every ``log_interval`` decode steps (SGLang's
  ``--decode-log-interval``) to that interval's mean; and the tokenizer's counters
  ``sglang:generation_tokens_total`` (labels ``model_name, engine_type, is_streaming``) and
  ``sglang:spec_verify_calls_total`` (``model_name, engine_type``), incremented when a request finishes by
  its completion tokens and its verify steps (``observe_one_finished_request``). ``counters=False`` is a
  build before those counters (the gauges only). A body with ``"return_spec_tokens_details": true`` is
  answered with ``sglext.spec_tokens_details`` (entrypoints/openai/protocol.py ``SpecTokensDetails``:
  ``spec_accept_length = completion_tokens / spec_verify_ct``, ``spec_correct_drafts_histogram[j]`` = the
  verify steps that accepted j drafts), and ``/server_info`` answers ``version``,
  ``max_running_requests`` (DFLASH's 48 unless given) and ``speculative_num_draft_tokens``.
- vLLM's ``/version`` answers ``{"version": ...}`` and ``/v1/models`` its ModelCard (``root``,
  ``max_model_len``).

Faults a real engine shows that a test needs on demand: ``metrics_drip`` (seconds between the bytes of
/metrics), ``metrics_padding`` (bytes of other series before the spec-decoding ones), ``reset_at`` (the
engine restarts, its counters from 0, when that request number arrives), ``nan_at`` (the drafts counter
becomes NaN then), ``completion_tokens`` (the usage every answer reports).

How the counters move, per request, as in the engines: the prefill step makes the first token (no
draft), then each verify step drafts ``block_size - 1`` tokens and accepts the next value of
``accepted`` (a cycle that restarts with every request), committing accepted + 1 tokens; a request
stops at ``max_tokens`` (the last step's accepted drafts still count, as the engines count them before
cutting at the limit). So over requests of ``1 + k * sum(cycle + 1)`` tokens vLLM's acceptance length
is exactly ``1 + mean(cycle)``.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import typing as t
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import prometheus_client as prom

__all__ = ["EngineDouble"]


class _Server(ThreadingHTTPServer):
    # socketserver's listen backlog is 5: 32 requests at once would wait out SYN retries (1 s), which no
    # engine makes its clients do (uvicorn listens with 2048)
    request_queue_size = 256
    daemon_threads = True


class EngineDouble:
    """``with EngineDouble("vllm") as engine: engine.url ...``; ``engine.requests`` lists the bodies it got."""

    def __init__(
        self,
        flavor: str = "vllm",
        *,
        model: str = "tiny-target",
        block_size: int = 4,
        accepted: t.Sequence[int] = (3, 1, 2, 0),
        spec: bool = True,
        log_interval: int = 40,
        fail_status: int | None = None,
        counters: bool = True,
        version: str | None = None,
        max_running_requests: int = 48,
        metrics_drip: float | None = None,
        metrics_padding: int = 0,
        reset_at: int | None = None,
        nan_at: int | None = None,
        completion_tokens: int | None = None,
        spec_details: bool = True,
        miscount: str | None = None,
    ) -> None:
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"flavor: vllm or sglang, got {flavor!r}")
        if any(not 0 <= a < block_size for a in accepted):
            raise ValueError("accepted: each between 0 and block_size - 1")
        self.flavor, self.model, self.block_size = flavor, model, block_size
        self.accepted, self.spec, self.log_interval = tuple(accepted), spec, log_interval
        self.fail_status = fail_status  # answer every completion with this HTTP status (a failing server)
        self.counters = counters
        self.version = version or ("0.33.0" if flavor == "vllm" else "0.5.23")
        self.max_running_requests = max_running_requests
        self.metrics_drip, self.metrics_padding = metrics_drip, metrics_padding
        self.reset_at, self.nan_at, self.completion_tokens = reset_at, nan_at, completion_tokens
        self.metrics_requests = 0  # GETs of /metrics
        self.spec_details = spec_details  # False: a build that answers no spec_tokens_details
        # vLLM counters that cannot all be true: "accepted" x4 (more than drafted), "positions" x3 (over
        # 100%), "sum" (position 1 never counted: the positions do not sum to the accepted tokens)
        if miscount not in (None, "accepted", "positions", "sum"):
            raise ValueError(f"miscount: accepted, positions or sum, got {miscount!r}")
        self.miscount = miscount
        self.requests: list[dict[str, t.Any]] = []
        self._lock = threading.Lock()
        self._interval: list[int] = []  # SGLang: accepted drafts of the steps since the last log
        self.registry = prom.CollectorRegistry()
        self._metrics()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # ---- the engines' metrics -----------------------------------------------------------

    def _metrics(self) -> None:
        r = self.registry
        if self.flavor == "vllm":
            labels = ["model_name", "engine"]
            values: tuple[str, ...] = (self.model, "0")
            self.generation = prom.Counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
            ).labels(*values)
            if not self.spec:
                return
            self.drafts = prom.Counter(
                "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels, registry=r
            ).labels(*values)
            self.draft_tokens = prom.Counter(
                "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels, registry=r
            ).labels(*values)
            self.accepted_tokens = prom.Counter(
                "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", labels, registry=r
            ).labels(*values)
            per_pos = prom.Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [*labels, "position"],
                registry=r,
            )
            self.per_pos = [per_pos.labels(*values, str(k)) for k in range(self.block_size - 1)]
        else:
            labels = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
            values = (self.model, "unified", "0", "0", "0")
            self.accept_length = prom.Gauge(
                "sglang:spec_accept_length",
                "Mean acceptance length of speculative decoding (accepted drafts + bonus token per forward).",
                labels,
                registry=r,
            ).labels(*values)
            self.accept_rate = prom.Gauge(
                "sglang:spec_accept_rate",
                "Speculative acceptance rate (`accepted drafts / proposed drafts` in batch).",
                labels,
                registry=r,
            ).labels(*values)
            tokenizer = ["model_name", "engine_type"]
            if self.counters:  # children made on a request's end, as the tokenizer manager makes them
                self.sg_generation = prom.Counter(
                    "sglang:generation_tokens_total",
                    "Number of generation tokens processed.",
                    [*tokenizer, "is_streaming"],
                    registry=r,
                )
                self.sg_verify = prom.Counter(
                    "sglang:spec_verify_calls_total",
                    "Number of speculative decoding verification calls.",
                    tokenizer,
                    registry=r,
                )

    def _decode(self, max_tokens: int) -> tuple[int, dict[str, t.Any] | None]:
        """One request's decoding: the counters move step by step; returns the tokens it answers with and
        (SGLang) its spec_tokens_details."""
        with self._lock:
            number = len(self.requests)
            if self.reset_at is not None and number == self.reset_at:  # a restart: every counter from 0
                self.registry = prom.CollectorRegistry()
                self._interval.clear()
                self._metrics()
            made, verify, hist = 1, 0, [0] * self.block_size  # the prefill step's token
            for a in itertools.cycle(self.accepted) if self.spec else itertools.repeat(-1):
                if made >= max_tokens:
                    break
                if a < 0:  # no drafter: one token per step
                    made += 1
                    continue
                made += a + 1
                verify += 1
                hist[a] += 1
                if self.flavor == "vllm":
                    self.drafts.inc()
                    self.draft_tokens.inc(self.block_size - 1)
                    self.accepted_tokens.inc(a * (4 if self.miscount == "accepted" else 1))
                    for k in range(a):
                        if not (self.miscount == "sum" and k == 0):
                            self.per_pos[k].inc(3 if self.miscount == "positions" else 1)
                else:
                    self._interval.append(a)
                    if len(self._interval) >= self.log_interval:  # the scheduler's decode log
                        steps = len(self._interval)
                        self.accept_length.set(sum(x + 1 for x in self._interval) / steps)
                        self.accept_rate.set(sum(self._interval) / (steps * (self.block_size - 1)))
                        self._interval.clear()
            answered = min(made, max_tokens)
            if self.flavor == "vllm":
                self.generation.inc(answered)
                if self.spec and self.nan_at is not None and number >= self.nan_at:
                    self.drafts.inc(float("nan"))
            elif self.counters:
                self.sg_generation.labels(self.model, "unified", "false").inc(answered)
                if verify:
                    self.sg_verify.labels(self.model, "unified").inc(verify)
            if not verify:
                return answered, None
            while hist and not hist[-1]:  # SGLang's histogram grows to the largest count seen
                hist.pop()
            details = {
                "spec_accept_rate": sum(j * n for j, n in enumerate(hist)) / (verify * (self.block_size - 1)),
                "spec_accept_length": answered / verify,
                "spec_cap_length": 0.0,
                "spec_block_accept_length": 0.0,
                "spec_num_correct_drafts": sum(j * n for j, n in enumerate(hist)),
                "spec_num_proposed_drafts": verify * (self.block_size - 1),
                "spec_verify_ct": verify,
                "spec_correct_drafts_histogram": hist,
                "spec_cap_lens_histogram": [],
            }
            return answered, details

    # ---- HTTP ---------------------------------------------------------------------------

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: t.Any) -> None:  # quiet test output
                pass

            def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _metrics(self) -> None:
                engine.metrics_requests += 1
                body = prom.generate_latest(engine.registry)
                pad = b"# HELP vllm:other Other series.\n# TYPE vllm:other gauge\n"
                block = b'vllm:other{model_name="tiny-target",bucket="0.5"} 1.0\n' * 1024
                self.send_response(200)
                self.send_header("Content-Type", prom.CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body) + engine.metrics_padding))
                self.end_headers()
                sent = 0
                while sent < engine.metrics_padding:  # written as it goes: the double holds none of it
                    chunk = pad if sent == 0 else block
                    if len(chunk) > engine.metrics_padding - sent:  # the last one: whole lines still
                        chunk = chunk[: engine.metrics_padding - sent - 1] + b"\n"
                    self.wfile.write(chunk)
                    sent += len(chunk)
                if engine.metrics_drip is None:
                    self.wfile.write(body)
                    return
                for i in range(len(body)):  # a byte at a time: each read is quick, the whole never ends
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()
                    time.sleep(engine.metrics_drip)

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    try:
                        self._metrics()
                    except OSError:  # the client gave up
                        pass
                elif self.path == "/v1/models":
                    card: dict[str, t.Any] = {
                        "id": engine.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": engine.flavor,
                    }
                    if engine.flavor == "vllm":
                        card.update(root=f"/models/{engine.model}", parent=None, max_model_len=4096, permission=[])
                    self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
                elif self.path == "/version" and engine.flavor == "vllm":
                    self._send(200, json.dumps({"version": engine.version}).encode())
                elif self.path == "/server_info" and engine.flavor == "sglang":
                    info = {
                        "model_path": engine.model,
                        "speculative_algorithm": "DFLASH",
                        "speculative_num_draft_tokens": engine.block_size,
                        "max_running_requests": engine.max_running_requests,
                        "version": engine.version,
                        "frontend": "python",
                    }
                    self._send(200, json.dumps(info).encode())
                else:
                    self._send(404, json.dumps({"detail": "Not Found"}).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                engine.requests.append(body)
                chat = self.path == "/v1/chat/completions"
                if not chat and self.path != "/v1/completions":
                    self._send(404, json.dumps({"detail": "Not Found"}).encode())
                    return
                if engine.fail_status is not None:
                    err = {"object": "error", "message": "The model does not exist.", "type": "NotFoundError"}
                    self._send(engine.fail_status, json.dumps({"error": err}).encode())
                    return
                n, details = engine._decode(int(body.get("max_tokens") or 16))
                text = " ".join(["tok"] * n)
                choice: dict[str, t.Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
                else:
                    choice["text"] = text
                prompt_tokens = 7
                answer: dict[str, t.Any] = {
                    "id": f"{'chatcmpl' if chat else 'cmpl'}-double",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": engine.model,
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": n if engine.completion_tokens is None else engine.completion_tokens,
                        "total_tokens": prompt_tokens + n,
                    },
                }
                if (
                    engine.flavor == "sglang"
                    and engine.spec_details
                    and body.get("return_spec_tokens_details")
                    and details
                ):
                    answer["sglext"] = {"spec_tokens_details": details}
                self._send(200, json.dumps(answer).encode())

        return Handler

    def start(self) -> EngineDouble:
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="engine-double", daemon=True
        )
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def metrics_text(self) -> str:
        return prom.generate_latest(self.registry).decode()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> EngineDouble:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
