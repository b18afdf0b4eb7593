"""EngineDouble: a DOUBLE of a vLLM or SGLang server that serves a target with a DFlash drafter.

No GPU engine runs here, so ``dflash bench serve`` is tested against this: a real HTTP server on
127.0.0.1 that answers what the engines answer (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, ``/metrics``). Its metrics are rendered by prometheus_client, the library both
engines expose theirs with, under the engines' own names, help texts and label sets:

- vLLM (vllm/v1/spec_decode/metrics.py ``SpecDecodingProm``): counters ``vllm:spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens`` and ``..._num_accepted_tokens_per_pos`` (one child
  per position, made at start), labels ``model_name`` and ``engine``; plus ``vllm:generation_tokens``.
  Without a drafter (``spec=False``) vLLM makes none of the spec-decode counters.
- SGLang (python/sglang/srt/metrics/collector.py ``SchedulerMetricsCollector``): gauges
  ``sglang:spec_accept_length`` and ``sglang:spec_accept_rate``, labels ``engine_type, model_name,
  moe_ep_rank, pp_rank, tp_rank``, set every ``log_interval`` decode steps (SGLang's
  ``--decode-log-interval``) to that interval's mean; plus ``sglang:generation_tokens_total``.

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
    ) -> None:
        if flavor not in ("vllm", "sglang"):
            raise ValueError(f"flavor: vllm or sglang, got {flavor!r}")
        if any(not 0 <= a < block_size for a in accepted):
            raise ValueError("accepted: each between 0 and block_size - 1")
        self.flavor, self.model, self.block_size = flavor, model, block_size
        self.accepted, self.spec, self.log_interval = tuple(accepted), spec, log_interval
        self.fail_status = fail_status  # answer every completion with this HTTP status (a failing server)
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
            self.generation = prom.Counter(
                "sglang:generation_tokens", "Number of generation tokens processed.", labels, registry=r
            ).labels(*values)
            self.accept_length = prom.Gauge(
                "sglang:spec_accept_length",
                "The average acceptance length of speculative decoding.",
                labels,
                registry=r,
            ).labels(*values)
            self.accept_rate = prom.Gauge(
                "sglang:spec_accept_rate",
                "The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).",
                labels,
                registry=r,
            ).labels(*values)

    def _decode(self, max_tokens: int) -> int:
        """One request's decoding: the counters move step by step; returns the tokens it answers with."""
        with self._lock:
            made = 1  # the prefill step's token
            for a in itertools.cycle(self.accepted) if self.spec else itertools.repeat(-1):
                if made >= max_tokens:
                    break
                if a < 0:  # no drafter: one token per step
                    made += 1
                    continue
                made += a + 1
                if self.flavor == "vllm":
                    self.drafts.inc()
                    self.draft_tokens.inc(self.block_size - 1)
                    self.accepted_tokens.inc(a)
                    for k in range(a):
                        self.per_pos[k].inc()
                else:
                    self._interval.append(a)
                    if len(self._interval) >= self.log_interval:  # the scheduler's decode log
                        steps = len(self._interval)
                        self.accept_length.set(sum(x + 1 for x in self._interval) / steps)
                        self.accept_rate.set(sum(self._interval) / (steps * (self.block_size - 1)))
                        self._interval.clear()
            answered = min(made, max_tokens)
            self.generation.inc(answered)
            return answered

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

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, prom.generate_latest(engine.registry), prom.CONTENT_TYPE_LATEST)
                elif self.path == "/v1/models":
                    card = {
                        "id": engine.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": engine.flavor,
                    }
                    self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
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
                n = engine._decode(int(body.get("max_tokens") or 16))
                text = " ".join(["tok"] * n)
                choice: dict[str, t.Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
                else:
                    choice["text"] = text
                prompt_tokens = 7
                answer = {
                    "id": f"{'chatcmpl' if chat else 'cmpl'}-double",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": engine.model,
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": n,
                        "total_tokens": prompt_tokens + n,
                    },
                }
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
