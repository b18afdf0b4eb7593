"""--notify: restart-on-crash's messages through apprise (Slack, Discord, ntfy, Telegram, e-mail, json://...).

The supervisor never waits on a notification: ``Notifier.send`` puts the message on a bounded queue per
URL and returns at once; a thread per URL delivers it, retrying with backoff, so a service that is down
or hangs delays only its own messages, never a probe. A full queue drops the message: counted, and said
on the supervisor's output. apprise itself runs in a worker process per URL (ops/courier.py): an answer
is read a few KiB at most, a delivery has a whole deadline, and the supervisor's exit ends the workers
instead of waiting on them. Every message is scrubbed of what it must never carry before it is queued:
each value of the hosts' ``env``, the Proxmox API token's value (``token_value_env``) and the --notify
URLs themselves (they hold the services' tokens); a log tail could print any of them.

One message per incident (``message_for``: crashed / lost / stalled with the cause and evidence,
restarted, restart failed, gave up on a crash loop, succeeded, container down / started, stopped,
unreachable / reachable again), and one when the supervisor starts and stops, each with the host,
session, attempt, last step and the last lines of the log.

apprise is an optional extra (``pip install 'dflash[notify]'``): imported only when --notify is given.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
import typing as t
import urllib.parse

from ops import errors
from ops.courier import Courier
from ops.hosts import Host
from ops.redaction import HOST_SCHEMES, Scrubber, url_secrets
from ops.redaction import MIN_SECRET as MIN_SECRET  # re-exported: the notifier's words
from ops.redaction import REDACTED as REDACTED
from ops.redaction import secret_values as secret_values
from ops.states import Action, State

logger = logging.getLogger(__name__)

NOTIFY_HINT = "needs the apprise package: pip install 'dflash[notify]'"
QUEUE_SIZE = 64  # messages waiting per URL; more are dropped (counted), the supervisor never blocks
TRIES = 6  # deliveries tried per message and URL: 1 + 5 retries
FIRST_RETRY = 1.0  # seconds before the first retry, doubled per retry up to MAX_RETRY
MAX_RETRY = 60.0
FLUSH = 2.0  # seconds the supervisor's exit waits for the messages still queued (its last words); then it ends them
TAIL_LINES = 10  # log lines in a message
EVIDENCE_LINES = 5


# --------------------------------------------------------------------------------------------
# Secrets


def notifier_for(
    urls: t.Sequence[str], hosts: t.Iterable[Host], environ: t.Mapping[str, str], say: t.Callable[[str], None]
) -> Notifier:
    """The Notifier of a supervisor watching ``hosts`` (restart-on-crash's and the Proxmox host's alike):
    every secret of those hosts is scrubbed from its messages, in every form (ops/redaction.py)."""
    return Notifier(urls, secrets=secret_values(hosts, environ), say=say)


class _ScrubFilter(logging.Filter):
    """apprise logs its failures (with URLs, hosts, answers): scrubbed like our messages."""

    def __init__(self, scrub: Scrubber) -> None:
        super().__init__()
        self.scrub = scrub

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self.scrub(record.getMessage()), ()
        return True


def label(url: str, index: int) -> str:
    """How messages about a URL name it without its token: ``--notify #1 (json://127.0.0.1:8080)``,
    ``--notify #2 (slack://...)``."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else "?"
    where = "..."
    if scheme in HOST_SCHEMES:
        try:
            parts = urllib.parse.urlsplit(url)
            host = parts.hostname or "..."
            where = f"{host}:{parts.port}" if parts.port else host
        except ValueError:
            where = "..."
    return f"--notify #{index} ({scheme}://{where})"


# --------------------------------------------------------------------------------------------
# Messages


@dataclasses.dataclass(frozen=True)
class Message:
    kind: str  # crashed, restarted, gave-up, succeeded, container-down, supervisor-started, ...
    title: str
    body: str
    level: str = "info"  # apprise's notify types: info, success, warning, failure


def _what(inc: t.Mapping[str, t.Any]) -> str:
    """``crashed (cuda-oom), attempt 3``."""
    what = str(inc.get("state"))
    if inc.get("cause"):
        what += f" ({inc['cause']})"
    if inc.get("attempt") is not None:
        what += f", attempt {inc['attempt']}"
    return what


def kind_of(inc: t.Mapping[str, t.Any]) -> tuple[str, str]:
    """(kind, apprise level) of an incident, from its state, action and outcome."""
    state, action, outcome = inc.get("state"), inc.get("action"), inc.get("outcome")
    if state == State.UNREACHABLE:
        return ("reachable", "success") if outcome == "recovered" else ("unreachable", "warning")
    if action == Action.GIVE_UP:
        return "gave-up", "failure"
    if action == Action.DONE:
        return "succeeded", "success"
    if action == Action.START_CONTAINER:
        if outcome == "done":
            return "container-started", "info"
        if outcome == "failed":
            return "container-start-failed", "failure"
        if outcome in ("cancelled", "superseded"):
            return "container-start-cancelled", "info"
        return "container-down", "warning"
    if action in (Action.RESTART, Action.STOP_THEN_RESTART):
        if outcome == "done":
            return "restarted", "success"
        if outcome == "failed":
            return "restart-failed", "failure"
        if outcome in ("cancelled", "superseded"):
            return "restart-cancelled", "info"
    if state == State.CONTAINER_DOWN:
        return "container-down", "warning"
    if state == State.STOPPED:
        return "stopped", "info"
    if state in (State.CRASHED, State.LOST):
        return str(state), "failure"
    return str(state), "warning"


def _headline(kind: str, inc: t.Mapping[str, t.Any]) -> str:
    what = _what(inc)
    if kind == "restarted":
        left_out = f"; {inc['excluded']}" if inc.get("excluded") else ""
        return f"restarted: attempt {inc.get('next_attempt')} started after {what}{left_out}"
    if kind == "container-started":
        return "container started; re-probing"
    if kind in ("restart-failed", "container-start-failed"):
        return f"{inc.get('action')} failed ({what}): {inc.get('error')}"
    if kind in ("restart-cancelled", "container-start-cancelled"):
        return f"{inc.get('action')} cancelled ({what})"
    if kind == "gave-up":
        return f"gave up: {inc.get('reason')}"
    if kind == "succeeded":
        return f"succeeded ({what})"
    if kind == "reachable":
        return f"reachable again after {inc.get('outage_seconds')}s"
    return f"{what}: {inc.get('reason')}"


def message_for(inc: t.Mapping[str, t.Any]) -> Message:
    """The message of one incident (the incident's keys: ``ops.supervise.state.incident_for``)."""
    kind, level = kind_of(inc)
    title = f"dflash {inc.get('host')}/{inc.get('session')}: {_headline(kind, inc)}"
    lines = [f"host {inc.get('host')}, session {inc.get('session')}, attempt {inc.get('attempt')}"]
    lines.append(_what(inc) + (f": {inc['detail']}" if inc.get("detail") else ""))
    if inc.get("exit_code") is not None or inc.get("signal") is not None:
        lines.append(
            ", ".join(
                x
                for x in (
                    f"exit {inc['exit_code']}" if inc.get("exit_code") is not None else "",
                    f"signal {inc['signal']}" if inc.get("signal") is not None else "",
                )
                if x
            )
        )
    prog = inc.get("progress") or {}
    if prog.get("step") is not None:
        extra = ", ".join(
            x
            for x in (
                f"loss {prog['loss']:g}" if isinstance(prog.get("loss"), (int, float)) else "",
                f"at {prog['at']}" if prog.get("at") else "",
            )
            if x
        )
        lines.append(f"last step {prog['step']}" + (f" ({extra})" if extra else ""))
    else:
        lines.append("last step: none seen")
    lines.append(f"action: {inc.get('action')}: {inc.get('reason')}")
    if inc.get("outcome") not in (None, "pending", "noted"):
        res = f"outcome: {inc['outcome']}"
        if inc.get("next_attempt") is not None:
            res += f", attempt {inc['next_attempt']} started"
        if inc.get("error"):
            res += f": {inc['error']}"
        lines.append(res)
    if inc.get("excluded"):
        lines.append(f"gpus: {inc['excluded']}")
    lines.extend(f"  {x}" for x in inc.get("gpu_health") or ())
    evidence = list(inc.get("evidence") or [])
    if evidence:
        lines.append("evidence:")
        lines.extend(f"  - {e}" for e in evidence[:EVIDENCE_LINES])
    tail = list(inc.get("log_tail") or [])[-TAIL_LINES:]
    if tail:
        lines.append(f"last {len(tail)} lines of {inc.get('log') or 'the log'}:")
        lines.extend(f"  {x}" for x in tail)
    lines.append(f"-- restart-on-crash pid {inc.get('supervisor_pid')} on {socket.gethostname()}, {inc.get('time')}")
    return Message(kind, title, "\n".join(lines), level)


def supervisor_message(event: str, host: str, session: str, text: str) -> Message:
    """``supervisor-started`` / ``supervisor-stopped``: where it runs, and the run's state in ``text``."""
    where = f"{socket.gethostname()} (pid {os.getpid()})"
    title = f"dflash {host}/{session}: supervisor {event} on {where}"
    body = f"host {host}, session {session}\nrestart-on-crash {event} on {where}\n{text}"
    return Message(f"supervisor-{event}", title, body, "warning" if event == "stopped" else "info")


def flag_message(flag: str, host: str, session: str, text: str, attempt: int | None) -> Message:
    """``low-disk`` / ``sync-failed``: the run goes on, the operator should act (once per episode)."""
    title = f"dflash {host}/{session}: {text}"
    body = f"host {host}, session {session}, attempt {attempt}\n{text}\nthe run goes on; `dflashctl status` shows it"
    return Message(flag, title, body, "warning")


def training_message(event: str, host: str, session: str, attempt: int | None, text: str) -> Message:
    """What the run's own log warned about (``loss-spike``): the run goes on, nothing was done."""
    title = f"dflash {host}/{session}: {text}"
    body = f"host {host}, session {session}, attempt {attempt}\n{event}: {text}\nthe run goes on (a warning only)"
    return Message(event, title, body, "warning")


# --------------------------------------------------------------------------------------------
# Delivery


class Service(t.Protocol):
    def notify(self, body: str, title: str = ..., notify_type: t.Any = ...) -> t.Any: ...


def check_url(url: str, index: int) -> None:
    """apprise is there and understands ``url``: refused now in one line, not found out at the first incident."""
    try:
        import apprise  # optional extra: only --notify needs it
    except ImportError:
        raise errors.ConfigError("--notify", NOTIFY_HINT) from None
    if not apprise.Apprise().add(url):
        raise errors.ConfigError(
            label(url, index), "apprise does not understand this URL (https://appriseit.com/services/ lists them)"
        )


def _couriers(urls: t.Sequence[str]) -> list[Service]:
    for i, u in enumerate(urls, 1):  # every URL checked before any worker starts
        check_url(u, i)
    return [Courier(u) for u in urls]


class _Target:
    """One URL: its queue (bounded) and the thread that delivers from it."""

    def __init__(self, name: str, service: Service, limit: int) -> None:
        self.name = name
        self.service = service
        self.limit = limit
        self.items: collections.deque[Message] = collections.deque()
        self.cond = threading.Condition()
        self.closing = False
        self.abort = threading.Event()  # the flush deadline passed: no more retries
        self.thread: threading.Thread | None = None

    def put(self, msg: Message) -> bool:
        with self.cond:
            if len(self.items) >= self.limit:
                return False
            self.items.append(msg)
            self.cond.notify()
            return True

    def take(self) -> Message | None:
        with self.cond:
            while not self.items and not self.closing:
                self.cond.wait()
            return self.items.popleft() if self.items else None

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def left(self) -> int:
        with self.cond:
            n = len(self.items)
            self.items.clear()
            return n


class Notifier:
    """Messages to every --notify URL, from a thread per URL; ``send`` never blocks.

    ``sent``, ``failed`` (given up after ``tries``) and ``dropped`` (queue full, or still queued when
    ``close`` gave up waiting) count messages per URL."""

    def __init__(
        self,
        urls: t.Sequence[str],
        *,
        secrets: t.Iterable[str] = (),
        say: t.Callable[[str], None] | None = None,
        queue_size: int = QUEUE_SIZE,
        tries: int = TRIES,
        first_retry: float = FIRST_RETRY,
        max_retry: float = MAX_RETRY,
        services: t.Sequence[Service] | None = None,
    ) -> None:
        self.scrub = Scrubber([*secrets, *(x for u in urls for x in url_secrets(u))])
        self._say = say or (lambda text: logger.warning("%s", text))
        self.tries, self.first_retry, self.max_retry = max(1, tries), first_retry, max_retry
        self.sent = self.failed = self.dropped = 0
        self._lock = threading.Lock()
        self._filter = _ScrubFilter(self.scrub)
        logging.getLogger("apprise").addFilter(self._filter)
        made = list(services) if services is not None else _couriers(urls)
        self.targets = [_Target(label(u, i), s, queue_size) for i, (u, s) in enumerate(zip(urls, made), 1)]
        for tg in self.targets:
            tg.thread = threading.Thread(target=self._work, args=(tg,), name=f"notify {tg.name}", daemon=True)
            tg.thread.start()

    def say(self, text: str) -> None:
        self._say(self.scrub(f"notify: {text}"))

    def _count(self, what: str) -> int:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)
            return int(getattr(self, what))

    # ---------------------------------------------------------------- the caller's side

    def send(self, msg: Message) -> None:
        """Queue ``msg`` (scrubbed) for every URL; a full queue drops it, counted and said."""
        msg = dataclasses.replace(msg, title=self.scrub(msg.title), body=self.scrub(msg.body))
        for tg in self.targets:
            if not tg.put(msg):
                n = self._count("dropped")
                self.say(f"{tg.name}: {tg.limit} messages wait already: dropped {msg.title!r} ({n} dropped so far)")

    def incident(self, inc: t.Mapping[str, t.Any]) -> None:
        self.send(message_for(inc))

    def supervisor(self, event: str, host: str, session: str, text: str) -> None:
        self.send(supervisor_message(event, host, session, text))

    def training(self, event: str, host: str, session: str, attempt: int | None, text: str) -> None:
        self.send(training_message(event, host, session, attempt, text))

    def close(self, timeout: float = FLUSH) -> None:
        """Deliver what is queued within ``timeout`` seconds (retries included), then give up: what is
        left is counted as dropped and said."""
        deadline = time.monotonic() + timeout
        for tg in self.targets:
            tg.close()
        for tg in self.targets:
            if tg.thread is not None:
                tg.thread.join(max(0.0, deadline - time.monotonic()))
        for tg in self.targets:
            tg.abort.set()
            left = tg.left()
            busy = tg.thread is not None and tg.thread.is_alive()
            end = getattr(tg.service, "close", None)
            if callable(end):
                end()  # a delivery still in flight is ended with its worker: the exit never waits on it
            if left or busy:
                with self._lock:
                    self.dropped += left
                self.say(
                    f"{tg.name}: not delivered within {timeout:g}s of the supervisor's end: "
                    f"{left} queued message(s) dropped" + (", one in flight ended" if busy else "")
                )
        logging.getLogger("apprise").removeFilter(self._filter)

    # ---------------------------------------------------------------- the thread's side

    def _deliver(self, tg: _Target, msg: Message) -> bool:
        try:
            ok = bool(tg.service.notify(body=msg.body, title=msg.title, notify_type=msg.level))
        except Exception as e:  # a plugin's bug must not kill the thread (the next message may get through)
            logger.info("%s: apprise raised %s", tg.name, self.scrub(f"{type(e).__name__}: {e}"))
            return False
        why = getattr(tg.service, "error", "")
        if not ok and why:
            logger.info("%s: %s", tg.name, self.scrub(str(why)))
        return ok

    def _work(self, tg: _Target) -> None:
        while (msg := tg.take()) is not None:
            delay = self.first_retry
            for n in range(1, self.tries + 1):
                if self._deliver(tg, msg):
                    self._count("sent")
                    if n > 1:
                        self.say(f"{tg.name}: delivered {msg.title!r} on try {n}")
                    break
                if getattr(tg.service, "closed", False):
                    self._count("dropped")  # ended by close(), which said so already
                    break
                if n == self.tries or tg.abort.is_set():
                    k = self._count("failed")
                    self.say(f"{tg.name}: gave up on {msg.title!r} after {n} tries ({k} failed so far)")
                    break
                if n == 1:
                    self.say(
                        f"{tg.name}: {msg.title!r} not delivered; retrying with backoff (up to {self.tries} tries)"
                    )
                else:
                    logger.info("%s: try %d of %r failed; next in %.1fs", tg.name, n, msg.title, delay)
                if tg.abort.wait(delay):
                    continue  # the flush deadline passed: one last try, then give up
                delay = min(self.max_retry, delay * 2)
