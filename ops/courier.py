"""The process that delivers one --notify URL's messages: apprise runs there, never in the supervisor.

A webhook can answer forever, trickle a byte now and then, or send gigabytes; a plugin can hang in DNS
or SMTP. None of that may reach the supervisor (its memory is the training host's, its exit must not
wait), so each URL gets a worker process of its own, started with the supervisor's python:

- the worker reads an HTTP answer's body ``ANSWER_CAP`` bytes at most, for ``BODY_WAIT`` seconds at
  most, then closes the connection (requests' adapter is wrapped there, in that process only: the
  supervisor's own requests, the Proxmox API's, are untouched);
- a delivery that has not answered within ``DEADLINE`` seconds is ended by killing the worker (its pid,
  a session of its own), and the next message starts a fresh one; the worker also ends itself
  (SIGALRM) if it outlives that, so an orphan cannot linger;
- its memory is capped (RLIMIT_DATA), whatever a plugin does.

The URL (it holds the service's token) and the messages travel on the worker's stdin as JSON lines,
never on a command line. Stdlib only: the supervisor on the Proxmox host loads this module.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import typing as t

from ops.redaction import Scrubber, url_secrets

ANSWER_CAP = 4096  # bytes of an HTTP answer's body the worker reads; the rest is never read
BODY_WAIT = 5.0  # seconds the worker reads a body for (a trickle ends there)
DEADLINE = 30.0  # seconds one delivery may take, connection to answer: then the worker is killed
START_WAIT = 60.0  # seconds a new worker may take to import apprise and take the URL
WORKER_MEMORY = 1 << 30  # bytes of data (heap, mmaps) a worker may hold
LINE_CAP = 64 << 10  # bytes of one answer line from the worker
ERROR_CHARS = 300

# The worker's program: the folder that holds ops/ travels as an argv item, never inside the code.
BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from ops.courier import worker; sys.exit(worker())"


def _ops_parent() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Courier:
    """One URL's worker process, seen from the supervisor: ``notify`` delivers one message (True when
    the service took it), bounded by ``deadline``; ``close`` ends the worker at once."""

    def __init__(self, url: str, *, deadline: float = DEADLINE, python: str | None = None) -> None:
        self.url = url
        self.deadline = deadline
        self.python = python or sys.executable
        self.error = ""  # why the last delivery failed (the worker's or apprise's words)
        self._proc: subprocess.Popen[bytes] | None = None
        self._greeted: subprocess.Popen[bytes] | None = None  # the worker whose hello was read
        self._buf = b""
        self._lock = threading.Lock()
        self._closed = False
        self._spawn()

    # ---------------------------------------------------------------- the worker

    def _spawn(self) -> subprocess.Popen[bytes] | None:
        with self._lock:
            if self._closed:
                return None
            if self._proc is not None and self._proc.poll() is None:
                return self._proc
            self._buf = b""
            proc = subprocess.Popen(
                [self.python, "-I", "-c", BOOT, _ops_parent()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # the terminal's Ctrl-C is the supervisor's; close() ends the worker
                close_fds=True,
            )
            self._proc = proc
        # the worker imports what this process imports (a user site, PYTHONPATH): -I drops those on its own
        path = [p for p in sys.path if p and os.path.isabs(p)]
        if not self._send(proc, {"url": self.url, "path": path}):
            return None
        return proc

    def _send(self, proc: subprocess.Popen[bytes], obj: t.Mapping[str, t.Any]) -> bool:
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(obj).encode() + b"\n")
            proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def _answer(self, proc: subprocess.Popen[bytes], wait: float) -> dict[str, t.Any] | None:
        """The worker's next answer line within ``wait`` seconds; None when it gave none (killed then)."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        end = time.monotonic() + wait
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = end - time.monotonic()
                if left <= 0 or len(self._buf) > LINE_CAP or not sel.select(left):
                    self._end(proc)
                    return None
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    self._end(proc)
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            data = json.loads(line)
        except ValueError:
            data = None
        return data if isinstance(data, dict) else None

    def _end(self, proc: subprocess.Popen[bytes]) -> None:
        """Kill the worker (by the pid we started) and reap it."""
        try:
            proc.kill()
        except OSError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        with self._lock:
            if self._proc is proc:
                self._proc = None

    # ---------------------------------------------------------------- the Service protocol

    def notify(self, body: str, title: str = "", notify_type: t.Any = "info") -> bool:
        proc = self._spawn()
        if proc is None:
            self.error = "the delivery process is closed" if self._closed else "the delivery process did not start"
            return False
        if proc is not self._greeted:  # a new worker: its first answer says whether it took the URL
            hello = self._answer(proc, START_WAIT)
            if hello is None or not hello.get("ok"):
                self.error = str((hello or {}).get("error") or "the delivery process did not start")[:ERROR_CHARS]
                self._end(proc)
                return False
            self._greeted = proc
        if not self._send(proc, {"title": title, "body": body, "type": str(notify_type)}):
            self.error = "the delivery process ended"
            self._end(proc)
            return False
        got = self._answer(proc, self.deadline)
        if got is None:
            self.error = "closed" if self._closed else f"no answer within {self.deadline:g}s (the delivery was ended)"
            return False
        self.error = str(got.get("error") or "")[:ERROR_CHARS]
        return bool(got.get("ok"))

    def close(self) -> None:
        """End the worker now, whatever it is doing (a delivery in flight returns False). Only the kill
        here: the thread that waits on the worker sees its end of the pipe close and tidies up itself."""
        with self._lock:
            self._closed = True
            proc = self._proc
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None


# --------------------------------------------------------------------------------------------
# The worker's side (`python -I -c BOOT <folder of ops>`)


def _cap_memory() -> None:
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = WORKER_MEMORY if hard == resource.RLIM_INFINITY else min(WORKER_MEMORY, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    except (ValueError, OSError):
        pass


def _bounded_body(r: t.Any) -> bytes:
    """At most ANSWER_CAP bytes of a streamed answer's body, read for BODY_WAIT seconds at most."""
    data = b""
    end = time.monotonic() + BODY_WAIT
    raw = r.raw
    read = getattr(raw, "read1", None) or getattr(getattr(raw, "_fp", None), "read1", None)
    try:
        while len(data) < ANSWER_CAP and time.monotonic() < end:
            chunk = read(ANSWER_CAP - len(data)) if read is not None else raw.read(256)
            if not chunk:
                break
            data += chunk
    except Exception:  # a reset or a timeout mid-body: what came is the answer
        pass
    return data[:ANSWER_CAP]


def _bound_requests() -> None:
    """Every answer through requests (apprise's HTTP plugins) is streamed, and only its first bytes read."""
    try:
        import requests.adapters
    except ImportError:
        return
    original = requests.adapters.HTTPAdapter.send

    def send(self: t.Any, request: t.Any, **kw: t.Any) -> t.Any:
        kw["stream"] = True
        r = original(self, request, **kw)
        r._content = _bounded_body(r)
        r._content_consumed = True
        try:
            r.raw.close()  # the rest of the answer is never read: the connection goes
        except Exception:
            pass
        return r

    requests.adapters.HTTPAdapter.send = send  # type: ignore[method-assign,assignment]


class _Words(logging.Handler):
    """apprise's last warning: why a delivery failed, for the supervisor's log. Scrubbed of the URL's
    secrets BEFORE it is cut (a token straddling the cut must not leave its head)."""

    def __init__(self, scrub: t.Callable[[str], str]) -> None:
        super().__init__(logging.WARNING)
        self.scrub = scrub
        self.last = ""

    def said(self, text: str) -> None:
        self.last = self.scrub(text)[:ERROR_CHARS]

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.said(record.getMessage())
        except Exception:
            self.said(str(record.msg))


def _say(obj: t.Mapping[str, t.Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker() -> int:
    """One URL's deliveries: a JSON line ``{"url"}`` first, then one ``{"title","body","type"}`` per
    message; one answer line each. Ends at EOF, or killed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor ends it; its terminal's Ctrl-C does not
    _cap_memory()
    first = sys.stdin.readline()
    try:
        hello = json.loads(first)
        url = hello["url"]
        sys.path[1:1] = [p for p in hello.get("path") or [] if isinstance(p, str) and p not in sys.path]
        import apprise
    except (ValueError, KeyError, TypeError, AttributeError):
        _say({"ok": False, "error": "bad request"})
        return 2
    except ImportError:
        _say({"ok": False, "error": f"{sys.executable} cannot import apprise"})
        return 1
    _bound_requests()
    words = _Words(Scrubber(url_secrets(url)))
    logging.getLogger("apprise").addHandler(words)
    service = apprise.Apprise()
    if not service.add(url):
        _say({"ok": False, "error": "apprise does not understand this URL"})
        return 1
    _say({"ok": True})
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            title, body, kind = str(msg["title"]), str(msg["body"]), str(msg["type"])
        except (ValueError, KeyError, TypeError):
            _say({"ok": False, "error": "bad message"})
            continue
        words.last = ""
        signal.alarm(int(DEADLINE) + 5)  # orphaned or not, a stuck delivery ends this process
        try:
            ok = bool(service.notify(body=body, title=title, notify_type=kind))
        except Exception as e:  # a plugin's bug: this message fails, the next may get through
            ok = False
            words.said(f"apprise raised {type(e).__name__}: {e}")
        signal.alarm(0)
        _say({"ok": ok, "error": "" if ok else words.last or "apprise said the delivery failed"})
    return 0
