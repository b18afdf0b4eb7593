"""The --group forms of dflashctl's commands: every host at once, one line per host (never cut by
another's), the group's line and exit code (the fan-out and the verdict are in ops/group.py)."""

from __future__ import annotations

import json
import threading
import time
import typing as t

import click

from ops import errors
from ops.exit_codes import ExitCode, exit_code_for_error, exit_code_for_state
from ops.hosts import Host

SAY_LOCK = threading.Lock()  # one host's line is never cut by another's


def say(name: str, text: str, *, err: bool = False) -> None:
    with SAY_LOCK:
        for line in text.splitlines() or [""]:
            click.echo(f"{name}: {line}", err=err)


def close_all(kept: dict[str, t.Any]) -> None:
    """The connections status_of_many kept for --watch."""
    for remote in kept.values():
        remote.close()
    kept.clear()


def on_each(
    hosts: t.Sequence[Host], group: str | None, verb: t.Callable[[Host, t.Any, t.Callable[[str], None]], str]
) -> ExitCode:
    """``verb(host, remote, say)`` on every host of --group at once (a connection each); its result is the
    host's last line. A host's error is that host's line; the exit code is the first failing host's."""
    from ops.group import fan_out
    from ops.remote import connect

    def one(host: Host) -> str:
        remote = connect(host)
        try:
            return verb(host, remote, lambda m: say(host.name, m))
        finally:
            remote.close()

    outcomes = fan_out(list(hosts), one)
    code = ExitCode.OK
    for o in outcomes:
        if o.error is None:
            say(o.host, o.value or "")
        elif isinstance(o.error, errors.OpsError):
            say(o.host, f"error: {o.error}", err=True)
            code = code or exit_code_for_error(o.error)
        else:
            raise o.error
    failed = [o.host for o in outcomes if o.error is not None]
    click.echo(f"group {group}: " + (f"failed on {', '.join(failed)}" if failed else f"done on {len(outcomes)} hosts"))
    return code


def status_of_many(
    hosts: list[Host],
    session: str | None,
    label: str,
    *,
    as_json: bool,
    stamp: bool,
    kept: dict[str, t.Any] | None = None,
) -> ExitCode:
    """One status line per host and the verdict. ``kept``: connections by host name that outlive the call (the
    rounds of --watch share them, as one host's --watch does); a host that is down gets a new one next round."""
    from ops.group import fan_out, verdict
    from ops.probe import Status
    from ops.remote import Remote, connect
    from ops.session import status
    from ops.states import State

    pool: dict[str, Remote] = {} if kept is None else kept

    def one(host: Host) -> Status:
        def connect_once() -> Remote:
            if host.name not in pool:  # each host's thread touches its own key only
                pool[host.name] = connect(host)
            return pool[host.name]

        st = None
        try:
            st = status(host, session, connect_once)
            return st
        finally:
            if kept is None or st is None or st.state in (State.UNREACHABLE, State.CONTAINER_DOWN):
                remote = pool.pop(host.name, None)
                if remote is not None:
                    remote.close()

    outcomes = fan_out(hosts, one)
    for o in outcomes:
        if o.error is not None:
            raise o.error  # status never raises for a host that is down: this is a bug or a bad config
    states = [o.value for o in outcomes if o.value is not None]
    v = verdict(states)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "group": label,
                    "state": v.state,
                    "node": v.node,
                    "why": v.why,
                    "hosts": [st.to_json() for st in states],
                }
            )
        )
    else:
        if stamp:
            click.echo(f"--- {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        width = max(len(h.name) for h in hosts)
        for st in states:
            click.echo(f"{st.host:<{width}}  {st.headline()}")
        click.echo(f"{label}: {v.line()}")
    return exit_code_for_state(v.state)


def start(hosts: t.Sequence[Host], group: str | None, session: str | None, replace: bool) -> ExitCode:
    """Every node at once (ops/group_start.py); on Ctrl-C each host's outcome, and what this start
    started is stopped (a node left alone would wait in a rendezvous that cannot complete)."""
    from ops.group_start import GroupStart
    from ops.remote import connect

    gs = GroupStart(list(hosts), session, replace=replace, connect=connect)
    try:
        nodes = gs.run()
    except KeyboardInterrupt:
        click.echo(f"group {group}: interrupted (Ctrl-C): stopping what this start started", err=True)
        clean = False
        try:
            clean = gs.abort(say)
        except KeyboardInterrupt:
            pass
        left = "nothing this start made is left running" if clean else "see `dflashctl --group status`"
        click.echo(f"group {group}: interrupted; {left}", err=True)
        return ExitCode.ERROR
    code = ExitCode.OK
    for n in nodes:
        if n.error is None:
            out = n.out or {}
            say(
                n.host.name,
                f"started attempt {out.get('attempt')}: runner pid {out.get('pid')}, command pid {out.get('child_pid')}",
            )
        elif isinstance(n.error, errors.OpsError):
            say(n.host.name, f"error: {n.error}", err=True)
            code = code or exit_code_for_error(n.error)
        else:
            raise n.error
    failed = [n.host.name for n in nodes if n.error is not None]
    click.echo(f"group {group}: " + (f"failed on {', '.join(failed)}" if failed else f"done on {len(nodes)} hosts"))
    return code
