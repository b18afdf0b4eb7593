"""``dflash regen``: the target rewrites every assistant turn of a chat corpus (temperature 0).

The DFlash and SpecForge recipes train on answers the target itself wrote, with the serving chat template
and thinking setting. ``regen`` reads what ``prepare-data`` reads (OpenAI ``messages``, ShareGPT
``conversations``; JSONL, a JSON array, parquet or a ``datasets`` ``save_to_disk`` folder) and writes JSONL in OpenAI ``messages`` form: the same records,
each assistant turn replaced by the target's greedy answer. Turn k is generated with the regenerated turns
before it as history (what the target would have seen had it answered every turn itself).

Agentic turns: a record's ``tools`` are in every prompt (the hf backend renders them with the template, the
openai backend sends ``tools`` and ``tool_choice: auto``), so the target writes its own tool calls (the
server's parsed ``tool_calls``, or the ``<tool_call>`` blocks of the text, split off as a hermes tool
parser does). Tool results are the environment's: kept from the record. A regenerated turn whose calls
(names and arguments) are not the record's, while the record goes on after it, ends the conversation
there: the regenerated turn is kept (the target's own answer to a context serving showed) and what
followed is not (those results answer other calls, or no call); counted (``changed_calls``).

Backends (each a ``Generator``):

- ``hf`` (``dflash.data.regen_hf``): the run's target loaded with transformers on its devices (one replica per distinct device of
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

Resumable by shard, like ``prepare-data`` (the corpus pass of ``dflash.data.corpus``): the input is cut into shards of ``shard_lines`` lines; shard s
is written to ``NEW.partial/parts/part-s.tmp/`` and renamed to ``part-s`` when complete, so a killed run
again skips the shards done (``plan.json``: same input, model, template, kwargs and lengths). The parts are
then concatenated into ``NEW.tmp`` and renamed to ``NEW``.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import typing as t
import urllib.parse
from pathlib import Path

from dflash import inputs, outputs
from dflash.data.chat import (
    ROLES,
    BadRecord,
    Renderer,
    messages_of,
    parse_record,
    split_tool_calls,
    template_hash,
    tokenizer_hash,
    tool_calls_of,
    tools_of,
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
from dflash.errors import DflashError, Failed, InputError

FORMAT = "dflash-regen/1"
# what a shard counts: records read and written, turns regenerated (and of them answers cut at the token
# limit and turns that call tools), conversations cut before a prompt that fills max_len or after a
# regenerated turn whose tool calls are not the record's
COUNTS = ("records", "written", "turns", "cut_answers", "cut_conversations", "tool_call_turns", "changed_calls")
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

    history: list[dict[str, t.Any]]
    prompt_ids: list[int] | None
    max_new: int
    tools: list[dict[str, t.Any]] | None = None  # the record's: in the prompt, so the target may call them


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    text: str
    cut: bool  # stopped by the token limit, not by EOS
    tool_calls: list[dict[str, t.Any]] | None = None  # the server's parsed calls (the hf text holds its own)


class Generator(t.Protocol):
    identity: dict[str, t.Any]  # what decides the answers besides the prompt (the resume plan keeps it)

    def generate(self, turns: list[Turn]) -> t.Sequence[Answer | Dropped]:
        """One answer per turn, or why there is none (the conversation is then dropped)."""
        ...

    def close(self) -> None:
        """Stop: what is in flight ends now with ``Aborted`` (Ctrl-C must not wait for it)."""
        ...


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
# Backend openai: an OpenAI-compatible server


RETRY_STATUS = {408, 429}  # and every 5xx
# a 4xx about this request's content (vLLM's "maximum context length is N tokens", a field out of range): that
# record is dropped (``server-refused``) and the run goes on; any other 4xx (401, 403, 404) stops it
REFUSED_STATUS = {400, 413, 422}
REFUSALS_TO_STOP = 8  # refused with none answered yet: the server refuses everything (e.g. --model)
MAX_RESPONSE_BYTES = 32 << 20  # an answer larger than this is a server's fault (an endless body)
BAD_ANSWER_TRIES = 2  # an answer that is not text is asked for once more, then dropped (``bad-answer``)


def _server_message(body: bytes) -> str:
    """The server's own words from an error body (OpenAI: error.message; FastAPI: detail)."""
    try:
        data = inputs.loads(body)
    except inputs.JsonProblem:
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


class Refused(ServerError):
    """The server refused this request for its content (``REFUSED_STATUS``): the record is dropped."""

    def __init__(self, message: str, words: str) -> None:
        super().__init__(message)
        self.words = words  # "400 Bad Request: <the server's message>"


class BadAnswer(ServerError):
    """An answer that is not usable text (not the OpenAI shape, a tool call, a lone surrogate)."""


class Aborted(DflashError):
    """A generator closed (Ctrl-C, another failure) while a request or a batch was in flight."""

    traceback = False


@dataclasses.dataclass(frozen=True, slots=True)
class Dropped:
    """No answer for this turn: the conversation is dropped with ``reason`` (a drop reason) and ``message``."""

    reason: str
    message: str


class _Requests:
    """N daemon threads running submitted calls: a request in flight never holds the process at exit
    (Ctrl-C: ``dflash: aborted`` and out, not a wait for the server)."""

    def __init__(self, n: int, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[cf.Future[t.Any], t.Callable[[], t.Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        self._started = False
        self._lock = threading.Lock()

    def submit(self, fn: t.Callable[[], t.Any]) -> cf.Future[t.Any]:
        with self._lock:
            if not self._started:
                self._started = True
                for th in self._threads:
                    th.start()
        fut: cf.Future[t.Any] = cf.Future()
        self._q.put((fut, fn))
        return fut

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller reads it from the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        for _ in self._threads:
            self._q.put(None)


class OpenAIGenerator:
    """Chat completions against ``server`` with ``concurrency`` requests in flight (stdlib http.client +
    daemon threads). ``timeout`` bounds a whole request (connect, send, the answer to its last byte), and an
    answer is at most ``max_response_bytes``: a server that drips or never ends is a timeout, retried."""

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
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        base = server.rstrip("/")
        if not base.startswith(("http://", "https://")):
            raise RegenError(f"regen: --server {server}: expected an http:// or https:// URL")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.kwargs = dict(kwargs)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_response_bytes = max_response_bytes
        self._abort = threading.Event()
        self._live: set[http.client.HTTPConnection] = set()  # connections in flight: close() shuts them
        self._lock = threading.Lock()
        self.answered = 0  # requests answered with text, and refused or answered with no text (the stop rule)
        self.failed = 0
        self._first_failure = ""
        self._pool = _Requests(concurrency, "regen-request")
        self.model = model or self._only_model()
        self.identity = {"backend": "openai", "server": self.base, "model": self.model}

    def close(self) -> None:
        """Stop: requests not sent are not sent, those in flight end now (their sockets are shut)."""
        self._abort.set()
        with self._lock:
            live = list(self._live)
        for conn in live:
            _shut(conn)
        self._pool.shutdown()

    def _http(self, method: str, url: str, data: bytes | None) -> tuple[int, str, bytes]:
        """(status, reason, body) of one HTTP exchange, whole within ``timeout`` seconds: a watchdog shuts
        the socket at the deadline (a per-read timeout never ends a slow drip)."""
        u = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        conn = cls(u.hostname or "", u.port, timeout=self.timeout)
        late = threading.Event()
        sent: list[socket.socket] = []  # an answer that closes the connection takes the socket off ``conn``

        def deadline() -> None:
            late.set()
            _shut(conn, *sent)

        watchdog = threading.Timer(self.timeout, deadline)
        watchdog.daemon = True
        with self._lock:
            self._live.add(conn)
        watchdog.start()
        try:
            if self._abort.is_set():
                raise Aborted("regen: stopped")
            path = u.path + (f"?{u.query}" if u.query else "")
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            if conn.sock is not None:
                sent.append(conn.sock)
            if late.is_set():
                _shut(conn, *sent)
            resp = conn.getresponse()
            chunks, size = [], 0
            while chunk := resp.read1(1 << 16):
                size += len(chunk)
                if size > self.max_response_bytes:
                    raise _Retry(f"an answer larger than {self.max_response_bytes >> 20} MiB")
                chunks.append(chunk)
            if late.is_set():  # the socket was shut while the answer was read: what came is not all of it
                raise OSError("shut")
            return resp.status, resp.reason, b"".join(chunks)
        except (OSError, http.client.HTTPException) as e:
            if self._abort.is_set():
                raise Aborted("regen: stopped") from None
            if late.is_set():
                raise _Retry(f"no complete answer within {self.timeout:g} s (--timeout)") from None
            raise _Retry(str(getattr(e, "reason", None) or e) or type(e).__name__) from None
        finally:
            watchdog.cancel()
            with self._lock:
                self._live.discard(conn)
            conn.close()

    def request(self, path: str, body: dict[str, t.Any] | None) -> dict[str, t.Any]:
        """One call with the retries: the answer's JSON object. ``Refused`` for a 4xx about the request's
        content, ``BadAnswer`` for an answer that is not text, ServerError (one line) for any other 4xx or
        when the retries are spent (either stops every request in flight)."""
        url = self.base + path
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:  # backoff; another request's failure ends the wait
                self._abort.wait(min(self.backoff * 2 ** (attempt - 1), 30.0))
            if self._abort.is_set():
                raise _Stopped("regen: stopped (another request failed)")
            try:
                status, reason, raw = self._http("GET" if body is None else "POST", url, data)
            except _Retry as e:
                last = str(e)
                continue
            except Aborted:
                raise _Stopped("regen: stopped") from None
            if status >= 500 or status in RETRY_STATUS:
                last = f"{status} {reason}: {_server_message(raw)}"
                continue
            if status >= 300:
                words = f"{status} {reason}: {_server_message(raw)}"
                if status in REFUSED_STATUS and body is not None:
                    raise Refused(f"regen: {url} answered {words}", words)
                self._abort.set()
                raise ServerError(f"regen: {url} answered {words}")
            try:
                out = inputs.loads(raw)
            except inputs.JsonProblem as e:
                if e.reason == "bad-text":  # valid JSON, but its text is not text: not a transport fault
                    raise BadAnswer(f"regen: {url}: {e}") from None
                last = f"not JSON: {raw[:120]!r}"
                continue
            if not isinstance(out, dict):
                last = f"not a JSON object: {raw[:120]!r}"
                continue
            return out
        self._abort.set()
        raise ServerError(f"regen: {url}: {last} (gave up after {self.retries + 1} tries)")

    def _only_model(self) -> str:
        out = self.request("/models", None)
        data = out.get("data")
        if not isinstance(data, list):
            raise RegenError(
                f"regen: {self.base}/models: unexpected answer {json.dumps(out)[:200]} (no list of models): "
                "name the model with --model"
            )
        ids = [m.get("id") for m in data if isinstance(m, dict)]
        if len(ids) != 1 or not isinstance(ids[0], str):
            raise RegenError(
                f"regen: {self.base}/models lists {len(ids)} models ({', '.join(map(str, ids[:5]))}): "
                "name one with --model"
            )
        return ids[0]

    def _one(self, turn: Turn) -> Answer | Dropped:
        body: dict[str, t.Any] = {
            "model": self.model,
            "messages": wire_messages(turn.history),
            "temperature": 0,
            "max_tokens": turn.max_new,
            "stream": False,
        }
        if turn.tools:  # the server's tool parser splits the calls off (vLLM: --enable-auto-tool-choice)
            body["tools"] = turn.tools
            body["tool_choice"] = "auto"
        if self.kwargs:
            body["chat_template_kwargs"] = self.kwargs
        problem = ""
        for _ in range(BAD_ANSWER_TRIES):
            try:
                out = self.request("/chat/completions", body)
            except Refused as e:
                self._failed(str(e))
                return Dropped("server-refused", f"the server refused it: {e.words}")
            except BadAnswer as e:
                problem = str(e).split(": ", 2)[-1]
                continue
            answer = answer_of(out, tools=bool(turn.tools))
            if isinstance(answer, Answer):
                with self._lock:
                    self.answered += 1
                return answer
            problem = answer
        self._failed(f"regen: {self.base}/chat/completions: the answer is not text: {problem}")
        return Dropped("bad-answer", f"the server's answer is not text: {problem}")

    def _failed(self, message: str) -> None:
        """A request refused or answered with no text: REFUSALS_TO_STOP of them before any answer stop the
        run (the server refuses everything), else the record is dropped."""
        with self._lock:
            self.failed += 1
            self._first_failure = self._first_failure or message
            if self.answered or self.failed < REFUSALS_TO_STOP:
                return
        self._abort.set()
        raise ServerError(f"{self._first_failure} (the first {self.failed} requests failed, none was answered)")

    def generate(self, turns: list[Turn]) -> list[Answer | Dropped]:
        futures = [self._pool.submit(functools.partial(self._one, tn)) for tn in turns]
        try:
            cf.wait(futures, return_when=cf.FIRST_EXCEPTION)
        finally:
            for f in futures:
                f.cancel()
        errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
        if errors:  # the request that failed, not one that stopped because of it
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
        out = [f.result() for f in futures]
        with self._lock:
            refused_all = not self.answered and out and all(isinstance(a, Dropped) for a in out)
        if refused_all:  # every request so far had no answer: the server refuses everything
            self._abort.set()
            raise ServerError(f"{self._first_failure} (all {len(out)} requests failed, none was answered)")
        return out


class _Retry(Failed):
    """A try that failed the way a retry may mend (a timeout, a reset, an endless answer); ``request`` catches
    it (under the error root all the same: exit 1, one line)."""


def _shut(conn: http.client.HTTPConnection, *socks: socket.socket) -> None:
    """End a connection another thread may be reading: shutdown wakes a blocked recv, close alone does not.
    ``socks``: its socket as it was once the request went out (a response that closes the connection holds
    it then, and ``conn.sock`` is None)."""
    for sock in {s for s in (conn.sock, *socks) if s is not None}:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def wire_messages(history: list[dict[str, t.Any]]) -> list[dict[str, t.Any]]:
    """The history as the OpenAI API takes it: tool calls' arguments as JSON text (the records hold them
    parsed, as templates read them; the server parses them back before rendering)."""
    out = []
    for m in history:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def answer_of(out: dict[str, t.Any], *, tools: bool = False) -> Answer | str:
    """The answer in a chat completion, or why there is none usable: ``content`` a string, a list of text
    parts (joined), or null beside a reasoning text or (``tools``: the request offered tools) tool calls;
    another part or shape, or a tool call nobody offered, is no answer. A ``reasoning_content`` the server
    split off is put back in front, as Qwen3's template renders it."""
    try:
        choice = out["choices"][0]
        msg = choice["message"]
        content = msg.get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        return f"not a chat completion: {json.dumps(out)[:200]}"
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    reasoning = reasoning if isinstance(reasoning, str) else ""
    calls = None
    if msg.get("tool_calls") and tools:
        try:
            calls = tool_calls_of(msg["tool_calls"], "tool_calls")
        except BadRecord as e:
            return f"a tool call that is not one: {e}"
    if isinstance(content, list):
        kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
        if not kinds <= {"text"} or not all(isinstance(p.get("text"), str) for p in content):
            return f"content parts that are not text ({', '.join(sorted(map(str, kinds)))})"
        content = "".join(p["text"] for p in content)
    elif content is None:
        if not calls and (msg.get("tool_calls") or not reasoning):
            return "no text content" + (" (a tool call)" if msg.get("tool_calls") else "")
        content = ""
    elif not isinstance(content, str):
        return f"content is a {type(content).__name__}, not text"
    if msg.get("tool_calls") and not calls:
        return "a tool call"
    if reasoning:  # a reasoning parser split it off: put it back
        content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    return Answer(content, cut=choice.get("finish_reason") == "length", tool_calls=calls)


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
    msgs: list[dict[str, t.Any]]
    turns: list[int]  # indices of the assistant messages
    tools: list[dict[str, t.Any]] | None = None
    k: int = 0  # turns done
    keep: int | None = None  # messages kept when cut before a turn that does not fit, or after a changed call
    changed_call: bool = False  # cut after a regenerated turn whose tool calls are not the record's


def _calls(m: t.Mapping[str, t.Any]) -> list[tuple[str, t.Any]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]


def _regenerated(old: dict[str, t.Any], ans: Answer, tools: list[dict[str, t.Any]] | None) -> dict[str, t.Any]:
    """The assistant message an answer makes: its tool calls the server's, or (the request offered tools)
    the ``<tool_call>`` blocks of its text, as a hermes tool parser splits them off; a call that is the
    record's keeps the record's id (its tool turn names it)."""
    text, calls = ans.text, ans.tool_calls
    if calls is None and tools and (split := split_tool_calls(text)) is not None:
        text, calls = split
    new: dict[str, t.Any] = {"role": "assistant", "content": text}
    if calls:
        ids = {
            (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)): c.get("id")
            for c in old.get("tool_calls") or ()
        }
        for c in calls:
            rid = ids.get((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)))
            if rid is not None:
                c["id"] = rid
        new["tool_calls"] = calls
    return new


def _read_shard(
    job: ShardJob, drops: dict[str, list[int]], messages: dict[str, str], renderer: Renderer | None
) -> tuple[list[_Conv], int]:
    """The shard's usable conversations, and how many of its lines were not (blank, dropped); a record with
    tools the local template ignores is ``template-no-tools`` (as prepare-data drops it)."""
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
            tools = tools_of(rec)
            if renderer is not None:
                renderer.check_tools(msgs, tools)
        except BadRecord as e:
            drops.setdefault(e.reason, []).append(lineno)
            messages.setdefault(e.reason, str(e))
            other += 1
            continue
        convs.append(_Conv(lineno, rec, msgs, [i for i, m in enumerate(msgs) if m["role"] == "assistant"], tools))
    return convs, other


def run_shard(
    job: ShardJob, gen: Generator, renderer: Renderer | None, spec: RegenSpec, progress: Progress | None
) -> None:
    """Regenerate one shard into ``job.part`` (written as ``.tmp``, renamed when complete)."""
    drops: dict[str, list[int]] = {}
    messages: dict[str, str] = {}
    counts = dict.fromkeys(COUNTS, 0)
    convs, other = _read_shard(job, drops, messages, renderer)
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
                    ids = renderer.prompt_ids(history, c.tools)
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
            turns.append(Turn(history, ids, max_new, c.tools))
            asked.append(c)
        answers = gen.generate(turns) if turns else []
        for c, ans in zip(asked, answers):
            if isinstance(ans, Dropped):  # the server refused it, or never answered with text
                drops.setdefault(ans.reason, []).append(c.lineno)
                messages.setdefault(ans.reason, ans.message)
                c.keep = -1
                continue
            at = c.turns[c.k]
            old, new = c.msgs[at], _regenerated(c.msgs[at], ans, c.tools)
            c.msgs[at] = new
            c.k += 1
            counts["turns"] += 1
            counts["cut_answers"] += int(ans.cut)
            counts["tool_call_turns"] += int(bool(new.get("tool_calls")))
            if _calls(new) != _calls(old) and at + 1 < len(c.msgs):
                # what follows answered the record's calls (or its text), not these: the conversation ends here
                c.keep, c.changed_call = at + 1, True
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
                counts["changed_calls" if c.changed_call else "cut_conversations"] += 1
            rec = {k: v for k, v in c.rec.items() if k not in ("messages", "conversations", *_consumed(c.rec))}
            rec["messages"] = msgs
            f.write(json.dumps(rec) + "\n")  # ASCII (every text was checked: inputs.loads)
            counts["written"] += 1
    finish_part(tmp, job, counts, drops, messages)
    _die_after(Path(job.part).parent)


def _consumed(rec: t.Mapping[str, t.Any]) -> tuple[str, ...]:
    """The fields ``messages_of`` made turns of besides the turns (GSM8K's question and answer, Dolphin-R1's
    answer and reasoning): the written ``messages`` hold them now, and a cut conversation must not get them
    back as its last turn."""
    turns = rec.get("messages", rec.get("conversations"))
    if not isinstance(turns, list):
        return ("question", "answer")
    last = turns[-1] if turns else None
    ends_answered = isinstance(last, dict) and ROLES.get(str(last.get("role", last.get("from")))) == "assistant"
    return () if ends_answered else ("answer", "reasoning")


def _die_after(parts: Path) -> None:
    """The test hook: a real SIGKILL of this process once DIE_AFTER_ENV shards are done (right after the
    rename, in the thread that wrote the shard)."""
    n = int(os.environ.get(DIE_AFTER_ENV, "0") or 0)
    if n and sum(1 for p in parts.iterdir() if not p.name.endswith(".tmp")) >= n:
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------------------------
# The run


def check_io(spec: RegenSpec) -> bytes:
    """RegenError / outputs.OutputError (one line) for an input that is missing or empty, or an output that
    is there already or cannot be written (``outputs.check_out``); said before a target is loaded. Returns
    the input's first bytes."""
    src, out = Path(spec.src), Path(spec.out)
    if not src.is_file() and not src.is_dir():
        raise RegenError(f"regen: --in {src}: {'not a regular file' if src.exists() else 'no such file'}")
    outputs.check_out(out, what=f"{COMMAND}: --out", kind="file", sources=[src], may_exist=False)
    if src.is_dir():
        return b""
    head = inputs.head(src)
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
    RegenError / ServerError: one line (the finished shards stay for the next run); outputs.OutputBusy:
    another regen writes the same output; outputs.WriteFailed: a write failed (a full disk)."""
    t0 = time.monotonic()
    check_io(spec)
    work = Path(str(spec.out) + ".partial")
    with outputs.OutputLock(spec.out, command=COMMAND):
        head = check_io(spec)  # again, holding the lock: a run that just finished wrote OUT
        with outputs.writing(command=COMMAND, where=work, kept=f"the finished shards are kept in {work}"):
            summary = _regen(spec, gens, renderer, head, work, log=log, progress_stream=progress_stream, tty=tty)
    summary["seconds"] = time.monotonic() - t0
    return summary


def _regen(
    spec: RegenSpec,
    gens: t.Sequence[Generator],
    renderer: Renderer | None,
    head: bytes,
    work: Path,
    *,
    log: t.Callable[[str], None],
    progress_stream: t.TextIO | None,
    tty: bool | None,
) -> dict[str, t.Any]:
    src, out = Path(spec.src), Path(spec.out)
    try:  # a JSON array, parquet or a datasets folder: to JSON lines first (record k is line k), as prepare-data
        tabular = tabular_kind(src, command=COMMAND)
        lines_src = as_json_lines(src, tabular, head, work, command=COMMAND, log=log)
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
    left = list(reversed(todo))
    lock = threading.Lock()
    stop = threading.Event()

    def worker(gen: Generator) -> None:
        while not stop.is_set():
            with lock:
                if not left:
                    return
                job = left.pop()
            run_shard(job, gen, renderer, spec, progress)

    if len(gens) == 1:
        worker(gens[0])
    else:
        pool = cf.ThreadPoolExecutor(len(gens), thread_name_prefix="regen-target")
        try:
            for fut in [pool.submit(worker, g) for g in gens]:
                fut.result()
        except BaseException:  # Ctrl-C or a failure: the other targets stop at their next step, unwaited
            stop.set()
            for g in gens:
                g.close()
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    progress.finish()
    summary = _concatenate(jobs, out)
    shutil.rmtree(work)
    if tabular:  # as prepare-data says them
        drops_by_row(summary["drops"])
    summary["done_now"] = progress.done - progress.start_done
    return summary


def _concatenate(jobs: list[ShardJob], out: Path) -> dict[str, t.Any]:
    counts = dict.fromkeys(COUNTS, 0)
    drops: dict[str, dict[str, t.Any]] = {}
    tmp = Path(str(out) + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            for j in jobs:
                p = Path(j.part)
                merge_part(p, counts, drops)
                with open(p / "out.jsonl", "rb") as f:
                    shutil.copyfileobj(f, fh, 1 << 22)
        os.replace(tmp, out)
    except BaseException:  # a full disk: no half output left beside the parts, which are kept
        tmp.unlink(missing_ok=True)
        raise
    counts["dropped"] = sum(d["count"] for d in drops.values())
    return {"counts": counts, "drops": dict(sorted(drops.items()))}


__all__ = [
    "Aborted",
    "Answer",
    "BadAnswer",
    "Dropped",
    "Refused",
    "answer_of",
    "check_io",
    "DIE_AFTER_ENV",
    "OpenAIGenerator",
    "Progress",
    "RegenError",
    "RegenSpec",
    "ServerError",
    "Turn",
    "regen",
    "run_shard",
]
