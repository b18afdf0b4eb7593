"""The training session on a host, from the operator's side: start, stop, status, tail, attach.

Each action is ONE agent call through the host's ``Remote`` (ssh + ``pct exec`` for a Proxmox host),
so a common `status` costs one connection and one remote command. When the agent cannot run at all
(nothing deployed, no python) `status` and `tail` fall back to plain tmux calls and say so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
import typing as t

from ops import errors, far_call
from ops.far import kernel_log, refusal, tmux
from ops.far.protocol import PROTOCOL, RunResult, tmux_facts
from ops.hosts import Host
from ops.keypath import check_name

if t.TYPE_CHECKING:
    from ops.probe import Status
    from ops.remote import Remote

PROBE_TIMEOUT = 30.0
TAIL_TIMEOUT = 30.0
START_TIMEOUT = 60.0
FALLBACK_LINES = 200


def session_name(host: Host, session: str | None) -> str:
    """``--session`` or the host's; it becomes a tmux target and a folder name, so it is checked."""
    if session is None:
        return host.session
    return check_name(session, "--session")


def request(host: Host, session: str | None = None) -> dict[str, t.Any]:
    """What every agent verb needs to find the run: session, socket and the host's paths; and the protocol
    this dflashctl speaks, which the agent checks before it acts."""
    return {
        "protocol": AGENT_PROTOCOL,
        "session": session_name(host, session),
        "socket": host.tmux_socket,
        "run_dir": host.run_dir,
        "workdir": host.workdir,
        "python": host.python,
    }


# --------------------------------------------------------------------------------------------
# status


def gather(
    host: Host,
    session: str | None,
    connect: t.Callable[[], Remote],
    *,
    heartbeat: t.Mapping[str, t.Any] | None = None,
) -> dict[str, t.Any]:
    """Every fact for ``ops.probe.classify``; never raises because something is down. ``heartbeat``: a
    supervisor's (ops/far/watch.py), written by the agent in the same call."""
    session = session_name(host, session)
    facts: dict[str, t.Any] = {
        "host": host.name,
        "session": session,
        "socket": host.tmux_socket,
        "container_id": host.container,
        "hang_after": host.hang_after,
        "startup_grace": host.startup_grace,
        "checked_at": time.time(),
        "mode": "agent",
    }
    try:
        remote = connect()
        req = request(host, session)
        if heartbeat is not None:
            req["heartbeat"] = dict(heartbeat)
        answer = call(remote, "probe", req, timeout=PROBE_TIMEOUT)
        if not answer.get("ok"):
            raise errors.AgentError(f"agent probe: {answer.get('message')}")
        facts["agent"] = answer
        host_kernel = kernel_log.of_failed(answer.get("attempt")) if host.is_local and host.container else None
        if host_kernel is not None:
            # dflashctl on the Proxmox host: the host's kernel log is where the driver's Xid lines are
            facts["host_kernel"] = host_kernel
    except errors.AgentError as e:
        # an agent from another dflashctl version, or a broken release: tmux can still be asked
        facts["mode"] = "fallback"
        facts["fallback"] = _raw_or_down(facts, remote, host, session, reason=str(e))
    except errors.UnreachableError as e:
        facts["unreachable"] = {"cause": e.cause, "detail": str(e)}
    except errors.ContainerDown as e:
        facts["container_down"] = {"cause": e.cause, "detail": e.detail}
    except errors.CommandTimeout as e:
        facts["agent_timeout"] = f"the agent did not answer within {e.timeout:g}s"
    except AgentUnavailable as e:
        facts["mode"] = "fallback"
        facts["fallback"] = _raw_or_down(facts, remote, host, session, reason=e.reason)
    return facts


def _raw_or_down(
    facts: dict[str, t.Any], remote: Remote, host: Host, session: str, *, reason: str
) -> dict[str, t.Any] | None:
    try:
        return raw_facts(remote, host, session, reason=reason)
    except errors.ContainerDown as e:
        facts["container_down"] = {"cause": e.cause, "detail": e.detail}
    except errors.UnreachableError as e:
        facts["unreachable"] = {"cause": e.cause, "detail": str(e)}
    except errors.CommandTimeout as e:
        facts["agent_timeout"] = f"tmux did not answer within {e.timeout:g}s"
    return None


def status(host: Host, session: str | None, connect: t.Callable[[], Remote]) -> Status:
    return verdict(host, gather(host, session, connect))


def verdict(host: Host, facts: dict[str, t.Any]) -> Status:
    """The facts classified, every text the run could have printed scrubbed of the host's secrets (its
    ``env`` values, its token's): what every form of status shows, as the supervisor's messages do."""
    # here: gather needs none of these modules (ops/cli/run.py loads them meanwhile)
    from ops.probe import classify
    from ops.redaction import Scrubber, scrubbed_status, secret_values

    return scrubbed_status(classify(facts), Scrubber(secret_values([host], os.environ)))


def shown_facts(host: Host, facts: dict[str, t.Any]) -> t.Any:
    """``status --facts``: the facts as read, the host's secrets scrubbed."""
    from ops.redaction import Scrubber, secret_values

    return Scrubber(secret_values([host], os.environ)).tree(facts)


# The global options and status options ``quick_status`` reads (each takes a value); any other word is the CLI's.
_QUICK_GLOBAL: tuple[str, ...] = ("--hosts", "--host")
_QUICK_STATUS: tuple[str, ...] = ("--session",)


def _quick_words(argv: t.Sequence[str]) -> dict[str, t.Any] | None:
    """``[--hosts P] [--host N] status [--json] [--session S]`` read into a dict; None for any other line."""
    words: dict[str, t.Any] = {"--hosts": None, "--host": None, "--session": None, "--json": False}
    allowed, i, seen_status = _QUICK_GLOBAL, 0, False
    while i < len(argv):
        word = argv[i]
        name, eq, value = word.partition("=")
        if not seen_status and word == "status":
            allowed, seen_status = _QUICK_STATUS, True
        elif seen_status and word == "--json" and not words["--json"]:
            words["--json"] = True
        elif name in allowed and words[name] is None:
            if not eq:
                i += 1
                if i == len(argv) or argv[i].startswith("-"):
                    return None
                value = argv[i]
            if not value:
                return None
            words[name] = value
        else:
            return None
        i += 1
    return words if seen_status else None


def quick_status(argv: t.Sequence[str]) -> int | None:
    """``dflashctl [--hosts P] [--host N] status [--json] [--session S]`` without click: the same output and
    exit code as the CLI's status, for a start-up that imports only what status needs (click and the CLI's
    commands were a third of its CPU). None, having printed nothing, for any other command line and for
    anything the CLI words better (a config error): the caller then runs the full CLI."""
    words = _quick_words(argv)
    if words is None:
        return None
    import logging

    from ops import remote as remotes
    from ops.exit_codes import exit_code_for_state
    from ops.hosts import load_inventory

    try:
        host = load_inventory(words["--hosts"]).get(words["--host"])
        session = session_name(host, words["--session"])
    except errors.OpsError:
        return None
    if host.keep_connection > 0 and not host.is_local:
        from ops.transport import keeper

        kept = keeper.ask(host, "status", {"session": session}, timeout=PROBE_TIMEOUT + 30)
        if kept is not None:  # the whole status from the keeper's warm process: no classify to import here
            print(json.dumps(kept["json"]) if words["--json"] else "\n".join(kept["lines"]))
            return int(kept["code"])
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr
    )  # as the CLI's (ops.cli.init_logging): a refused keeper's warning
    opened: list[Remote] = []

    def connect() -> Remote:
        opened.append(remotes.connect(host))
        import_beside("ops.probe")  # classify's modules load while the agent runs, as in the CLI
        return opened[-1]

    try:
        facts = gather(host, session, connect)
        st = verdict(host, facts)
    except errors.OpsError:
        return None  # read-only so far: the full CLI asks again and words the error
    finally:
        for r in opened:
            r.close()
    print(json.dumps(st.to_json()) if words["--json"] else "\n".join(st.lines()))
    return int(exit_code_for_state(st.state))


def kept_status(host: Host, args: t.Mapping[str, t.Any], connection: t.Callable[[], t.Any]) -> dict[str, t.Any]:
    """status in a connection keeper's process (ops/transport/keeper.py ``CALLS``), over its connection:
    what ``quick_status`` prints, for either form, and the exit code."""
    from ops import remote as remotes
    from ops.exit_codes import exit_code_for_state

    # the keeper's connection is the keeper's: wrapped, never closed here
    st = verdict(host, gather(host, args.get("session"), lambda: remotes.wrap(host, connection())))
    return {"json": st.to_json(), "lines": st.lines(), "code": int(exit_code_for_state(st.state))}


def import_beside(name: str) -> threading.Thread:
    """Import module ``name`` in a thread of its own while this one waits on the far end.

    status's one agent call is mostly waiting (sshd, ``pct exec``, the container's python); classify's
    modules (ops.probe, ops.wire: some 30 frozen dataclasses) are start-up CPU, so they load inside
    that wait instead of before it. Started once connected: during the handshake the thread would only take
    the GIL from paramiko's packets. A failed import here fails again, with its own error, where the module
    is used; the thread is a daemon, so an error that ends the command never waits for it."""
    import importlib

    def load() -> None:
        with contextlib.suppress(BaseException):
            importlib.import_module(name)

    th = threading.Thread(target=load, name=f"import {name}", daemon=True)
    th.start()
    return th


def raw_facts(remote: Remote, host: Host, session: str, *, reason: str) -> dict[str, t.Any]:
    """The raw fallback: plain tmux through Remote.run, stderr read by ops.far.tmux's table."""

    def run(argv: list[str]) -> RunResult:
        res = remote.run(argv, timeout=TAIL_TIMEOUT)
        return RunResult(res.exit_code, res.out, res.err, res.timed_out)

    tf = tmux_facts(run, host.tmux_socket, session)  # the agent's own reading of tmux, asked from here
    if tf["exit_code"] not in (0, None) and not tf["stderr"] and not tf["timed_out"]:
        # tmux says why whenever it fails (no server, no session, not installed): a failure without a word
        # is the way in failing (a pct that runs but fails, a wrapper or sudo refusing). Nothing inside was
        # read: blind, never not-started.
        raise errors.UnreachableError(
            host.label,
            f"nothing inside can be read: {reason}; tmux, asked the same way, exited {tf['exit_code']} without a "
            "word (a pct, wrapper or sudo that fails silently?)",
        )
    capture = None
    if tf["exit_code"] == 0:
        cap = remote.run(tmux.capture_argv(host.tmux_socket, session, FALLBACK_LINES), timeout=TAIL_TIMEOUT)
        capture = {
            "exit_code": cap.exit_code,
            "stderr": cap.err.strip(),
            "lines": tmux.last_lines(cap.out.split("\n"), FALLBACK_LINES) if cap.exit_code == 0 else [],
        }
    return {"reason": reason, "tmux": tf, "pane_capture": capture}


# --------------------------------------------------------------------------------------------
# start / stop


def operator_start(replace: bool = False) -> dict[str, t.Any]:
    """run.json's ``started_by`` for a start by hand: who and where (``dflashctl history`` shows it)."""
    import getpass  # here: start's alone (status and tail never ask who you are)

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's bare uid)
        user = str(os.getuid())
    return {
        "by": "operator",
        "user": user,
        "machine": socket.gethostname(),
        "why": "dflashctl start --replace" if replace else "dflashctl start",
    }


def start(
    remote: Remote,
    session: str | None = None,
    *,
    replace: bool = False,
    start_id: str | None = None,
    started_by: t.Mapping[str, t.Any] | None = None,
    env: t.Mapping[str, str] | None = None,
) -> dict[str, t.Any]:
    """A new attempt; ``started_by`` (default: the operator, ``operator_start``) goes into its run.json.
    ``env``: set for this attempt on top of the host's ``env`` (the supervisor's DFLASH_EXCLUDED_GPUS).
    ``start_id``: names this start, so that ``stop(start_id=...)`` stops what it started and nothing
    else (or, reaching the host first, makes it refuse): ``dflashctl --group start`` and its Ctrl-C."""
    host = remote.host
    req = request(host, session)
    req.update(
        command=list(host.command),
        env={**host.env, **(env or {})},
        replace=replace,
        started_by=dict(started_by) if started_by is not None else operator_start(replace),
    )
    if start_id is not None:
        req["start_id"] = start_id
    answer = call_deployed(remote, "start", req, timeout=START_TIMEOUT)
    if not answer.get("ok"):
        kind, message = answer.get("error"), answer.get("message")
        if kind == refusal.NOT_DEPLOYED:
            raise errors.NotDeployed(f"{host.label}: {message}")
        if kind == refusal.RUN_ACTIVE:
            raise errors.RunActive(f"{host.label}: {message}")
        if kind == refusal.CANCELLED:
            raise errors.StartCancelled(f"{host.label}: {message}")
        raise errors.AgentError(f"{host.label}: start: {message}")
    return answer


def stop(
    remote: Remote, session: str | None = None, *, grace: float = 60.0, start_id: str | None = None
) -> dict[str, t.Any]:
    """Stop the session's run; with ``start_id``, only the run that start made (when it has not run yet,
    it never will: the answer says ``cancelled``)."""
    host = remote.host
    req = request(host, session)
    req["grace"] = grace
    if start_id is not None:
        req["start_id"] = start_id
    try:
        # C-c, grace, TERM, grace, KILL: the call may take two graces and a bit.
        answer = call(remote, "stop", req, timeout=2 * grace + 30)
    except AgentUnavailable as e:
        raise errors.AgentError(f"{host.label}: {e.reason}") from None
    if not answer.get("ok"):
        raise errors.AgentError(f"{host.label}: stop: {answer.get('message')}")
    return answer


# --------------------------------------------------------------------------------------------
# tail


class TailChunk(t.NamedTuple):
    source: str
    reason: str | None
    lines: list[str]
    log: str | None
    offset: int | None


def tail(
    remote: Remote, session: str | None = None, *, lines: int = 30, source: str = "auto", follow: bool = False
) -> TailChunk:
    """The last ``lines`` lines and where they came from. ``follow``: the caller goes on with
    ``follow()``, so ``auto`` prefers the log (one stream, no line lost or shown twice)."""
    host = remote.host
    req = request(host, session)
    req.update(lines=lines, source=source, follow=follow)
    try:
        a = call(remote, "tail", req, timeout=TAIL_TIMEOUT)
    except AgentUnavailable as e:
        return _raw_tail(remote, host, req["session"], lines, source, reason=e.reason)
    if not a.get("ok"):
        raise errors.OpsError(f"{host.label}: {a.get('message')}")
    return TailChunk(a["source"], a.get("reason"), a["lines"], a.get("log"), a.get("offset"))


def _raw_tail(remote: Remote, host: Host, session: str, lines: int, source: str, *, reason: str) -> TailChunk:
    if source == "log":
        raise errors.OpsError(f"{host.label}: cannot read the log: {reason}")
    res = remote.run(tmux.capture_argv(host.tmux_socket, session, lines), timeout=TAIL_TIMEOUT)
    if res.exit_code != 0:
        v = tmux.classify(res.err)
        raise errors.OpsError(f"{host.label}: fallback mode ({reason}): no pane to show: {v.text}")
    return TailChunk(
        "pane",
        f"fallback mode ({reason}): showing the pane of session '{session}'",
        tmux.last_lines(res.out.split("\n"), lines),
        None,
        None,
    )


def follow(
    remote: Remote,
    first: TailChunk,
    session: str | None = None,
    *,
    interval: float = 1.0,
    emit: t.Callable[[str], None],
    note: t.Callable[[str], None],
    rounds: int | None = None,
) -> None:
    """`tail -f`: poll the log by offset through the agent (never a long-lived channel). Returns
    when ``rounds`` polls are done (None: until interrupted)."""
    host = remote.host
    log, offset = first.log, first.offset
    if log is None or offset is None:
        raise errors.OpsError(f"{host.label}: no log to follow (source {first.source})")
    done = 0
    while rounds is None or done < rounds:
        time.sleep(interval)
        done += 1
        req = request(host, session)
        req.update(offset=offset, log=log)
        a = call(remote, "tail", req, timeout=TAIL_TIMEOUT)
        if not a.get("ok"):
            note(f"follow: {a.get('message')}")
            continue
        for line in a["lines"]:
            emit(line)
        offset = a["offset"]
        cur = a.get("current_log")
        if cur and cur != log and a.get("offset") == a.get("size"):
            note(f"a new attempt started: following {cur}")
            log, offset = cur, 0


# --------------------------------------------------------------------------------------------
# read (`dflashctl plot`: the run's records and metrics.jsonl, from given offsets)

READ_TIMEOUT = 60.0


def read(
    remote: Remote,
    session: str | None,
    attempts: t.Mapping[str, t.Mapping[str, t.Any]],
    *,
    tail: bool | str = "crashed",
    cap: int | None = None,
) -> dict[str, t.Any]:
    """One ``read`` call: ``attempts`` = {"<n>": {"offset", "run", "tail"}} of what the caller has;
    ``tail``: the log tails wanted of the other attempts (``ops.far.agent.read``)."""
    host = remote.host
    req = request(host, session)
    req.update(attempts={k: dict(v) for k, v in attempts.items()}, tail=tail)
    if cap is not None:
        req["cap"] = cap  # bytes per call (the agent's READ_CAP at most)
    return ask(remote, "read", req, timeout=READ_TIMEOUT, lacking="cannot read metrics")


def call_deployed(remote: Remote, verb: str, req: t.Mapping[str, t.Any], *, timeout: float) -> dict[str, t.Any]:
    """One agent call whose failure to run is an error: NotDeployed (with the fix) or AgentError, one line."""
    try:
        return call(remote, verb, dict(req), timeout=timeout)
    except AgentUnavailable as e:
        if e.not_deployed:
            raise errors.NotDeployed(f"{remote.host.label}: {e.reason}: run `dflashctl deploy` first") from None
        raise errors.AgentError(f"{remote.host.label}: {e.reason}") from None


def ask(remote: Remote, verb: str, req: t.Mapping[str, t.Any], *, timeout: float, lacking: str) -> dict[str, t.Any]:
    """``call_deployed`` for a verb newer agents have: an older one's `usage` answer says to redeploy
    (``lacking``: what it cannot do, "cannot read metrics"); any other refusal is one line naming the verb."""
    a = call_deployed(remote, verb, req, timeout=timeout)
    if not a.get("ok"):
        if a.get("error") == refusal.USAGE:  # an agent older than this verb
            raise errors.AgentError(f"{remote.host.label}: the deployed agent {lacking}: run `dflashctl deploy`")
        raise errors.OpsError(f"{remote.host.label}: {verb}: {a.get('message')}")
    return a


# --------------------------------------------------------------------------------------------
# The agent protocol, operator side (the agent itself is ops/far/agent.py, run in the container)


class AgentUnavailable(Exception):
    """The agent could not run at all (no python, nothing deployed, a release without this dflashctl's
    agent): ``reason`` says why."""

    def __init__(self, reason: str, *, not_deployed: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.not_deployed = not_deployed


# The protocol this dflashctl speaks: the number its own far side answers with (ops/far/protocol.py), so
# a release deployed by this dflashctl always agrees; another number means another dflashctl deployed it.
AGENT_PROTOCOL = PROTOCOL

# A constant program; the release path and the verb travel as argv items, never inside the code. Where it
# finds the agent is part of the protocol: a release without ops/far/agent.py is another dflashctl's.
BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); from ops.far.agent import main; sys.exit(main())"


def agent_argv(workdir: str, python: str, verb: str) -> list[str]:
    """``<python> -I -S -c BOOT <workdir>/current <verb> --json``: the agent of the deployed release only.

    -I: no PYTHON* variables (pct exec keeps the ssh session's environment) and, unlike ``-m``, no
    current directory on sys.path (a checkout or any ``ops/`` folder there would shadow the release).
    -S: no site-packages: the agent is stdlib only, so it starts faster (no .pth files, no editable
    finders) and behaves the same whatever is installed. The runner and training get the full interpreter."""
    return [python, "-I", "-S", "-c", BOOT, os.path.join(workdir, "current"), verb, "--json"]


def call(remote: Remote, verb: str, req: t.Mapping[str, t.Any], *, timeout: float = 60.0) -> dict[str, t.Any]:
    """Run one agent verb through ``remote.run`` (the request as JSON on stdin) and return its answer.

    Raises ``AgentUnavailable`` when the agent cannot run (the caller may fall back to raw tmux),
    ``CommandTimeout`` when it did not answer, ``AgentError`` for an answer that is not ours;
    transport errors (unreachable, container down) pass through untouched."""
    host = remote.host
    argv = agent_argv(host.workdir, host.python, verb)
    reply = far_call.call(remote, argv, stdin=json.dumps(dict(req)).encode(), timeout=timeout)
    res = reply.result
    if res.timed_out:
        raise errors.CommandTimeout(argv, timeout)
    err = res.err.strip()
    last = err.splitlines()[-1] if err else ""
    if far_call.cannot_exec(res):
        raise AgentUnavailable(f"cannot run {host.python}: {last or f'exit {res.exit_code}'}")
    current = os.path.join(host.workdir, "current")
    missing = re.search(r"No module named '?(ops(?:\.[\w.]+)?)'?$", last)
    if missing and missing.group(1) == "ops":
        raise AgentUnavailable(f"nothing is deployed at {current}", not_deployed=True)
    if missing:
        # Another dflashctl's layout, e.g. a release from before the agent moved (ops/agent.py, no ops/far/agent.py).
        raise AgentUnavailable(
            f"the release at {current} does not have this dflashctl's agent (no module {missing.group(1)}): "
            "run `dflashctl deploy`"
        )
    answer = reply.answer
    if answer is None:
        if res.exit_code != 0:
            raise AgentUnavailable(f"the agent failed: {last or f'exit {res.exit_code}'}")
        raise errors.AgentError(f"agent {verb}: answer is not JSON: {res.out[:200]!r}")
    if answer.get("protocol", AGENT_PROTOCOL) != AGENT_PROTOCOL:
        raise errors.AgentError(
            f"the deployed agent speaks protocol {answer.get('protocol')}, this dflashctl "
            f"{AGENT_PROTOCOL}: run `dflashctl deploy`"
        )
    return answer
