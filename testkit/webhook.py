"""A webhook receiver on 127.0.0.1 for apprise's ``json://`` URLs: a real HTTP server that keeps every
JSON body POSTed to it. ``hang()`` makes it take requests and answer none until ``release()`` (a service
that hangs); before ``start()`` nothing listens on its port (a service that is down).

``answer(mode)`` makes it misbehave after it kept the message: ``endless`` answers 200 and streams a body
with no end, ``huge`` the same with a Content-Length of a terabyte, ``trickle`` one byte every
``trickle_every`` seconds, for ever. ``streamed`` counts the bytes of those bodies, ``cut`` the answers the
client stopped reading (its end of the connection went), ``streaming`` the ones still being sent."""

from __future__ import annotations

import http.server
import json
import threading
import typing as t

from testkit import free_port


class Webhook:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.messages: list[dict[str, t.Any]] = []
        self.held = 0  # requests taken and not answered (hang mode)
        self._lock = threading.Lock()
        self._open = threading.Event()
        self._open.set()
        self.mode = "ok"
        self.trickle_every = 1.0
        self.streamed = 0
        self.cut = 0
        self.streaming = 0
        self._stopping = threading.Event()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"json://127.0.0.1:{self.port}/hook"

    def start(self) -> Webhook:
        if self._server is not None:
            return self  # `with hook.start():` after a late start
        self._stopping.clear()
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: t.Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not hook._open.is_set():
                    with hook._lock:
                        hook.held += 1
                    hook._open.wait(120)  # bounded: a test that forgot release() still ends
                    with hook._lock:
                        hook.held -= 1
                try:
                    data = json.loads(body)
                except ValueError:
                    data = {"raw": body.decode("utf-8", "replace")}
                with hook._lock:
                    hook.messages.append(data)
                if hook.mode == "ok":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if hook.mode == "huge":
                    self.send_header("Content-Length", str(1 << 40))
                self.end_headers()
                hook._stream(self.wfile)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def answer(self, mode: str, every: float = 1.0) -> None:
        assert mode in ("ok", "endless", "huge", "trickle"), mode
        self.mode, self.trickle_every = mode, every

    def _stream(self, out: t.Any) -> None:
        chunk = b"x" * (1 if self.mode == "trickle" else 1 << 16)
        with self._lock:
            self.streaming += 1
        try:
            while not self._stopping.is_set():
                out.write(chunk)
                out.flush()
                with self._lock:
                    self.streamed += len(chunk)
                if self.mode == "trickle":
                    self._stopping.wait(self.trickle_every)
        except OSError:  # the client hung up: it read what it wanted
            with self._lock:
                self.cut += 1
        finally:
            with self._lock:
                self.streaming -= 1

    def hang(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def titles(self) -> list[str]:
        with self._lock:
            return [str(m.get("title")) for m in self.messages]

    def texts(self) -> str:
        """Every message received, as the JSON text it came as (for "no secret anywhere" checks)."""
        with self._lock:
            return "\n".join(json.dumps(m) for m in self.messages)

    def stop(self) -> None:
        self._stopping.set()
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Webhook:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
