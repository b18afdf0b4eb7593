"""The run's commands: start, stop, status, tail, attach. Thin: the work is in ops/session.py (ops/probe.py
classifies); the --group forms are in ops/cli/groups.py.

Each command imports the modules of ours it uses inside its function: `dflashctl status` does not load
deploy, doctor, plot or supervise, and loads ops.probe beside the agent call (tests/ops/test_status_imports.py).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
import typing as t

import click

from ops.cli import groups
from ops.cli.options import Seconds, session_option
from ops.exit_codes import ExitCode, exit_code_for_state
from ops.hosts import Host
from ops.states import State

if t.TYPE_CHECKING:
    from ops.cli import App


@click.command("start")
@session_option
@click.option("--replace", is_flag=True, help="Stop a live run of this session first, then start a new attempt.")
@click.pass_obj
def start_cmd(app: App, session: str | None, replace: bool) -> ExitCode:
    """Start the host's command in a persistent tmux session (a new attempt dir each time)."""
    from ops import session as run

    if app.group_name is not None:
        return groups.start(app.members(), app.group_name, session, replace)
    out = run.start(app.remote(), session, replace=replace)
    name = session or app.host.session
    if out.get("replaced"):
        r = out["replaced"]
        click.echo(f"replaced attempt {r.get('attempt')} ({r.get('how')}, {r.get('seconds')}s)")
    click.echo(
        f"started attempt {out['attempt']} of session '{name}' on {app.host.label}: "
        f"runner pid {out.get('pid')}, command pid {out.get('child_pid')}"
    )
    click.echo(f"  release: {out.get('release')}")
    click.echo(f"  log:     {out.get('log')}")
    if out.get("exit"):
        e = out["exit"]
        click.echo(
            f"  note: the command already ended ({'signal ' + str(e['signal']) if e.get('signal') else 'exit ' + str(e.get('exit_code'))}); "
            "see `dflashctl status`",
            err=True,
        )
    if out.get("warning"):
        click.echo(f"  warning: {out['warning']}", err=True)
    return ExitCode.OK


@click.command("stop")
@session_option
@click.option(
    "--grace",
    type=Seconds(0),
    default=60.0,
    show_default=True,
    metavar="S",
    help="Seconds to wait after Ctrl-C (and again after SIGTERM) before escalating.",
)
@click.pass_obj
def stop_cmd(app: App, session: str | None, grace: float) -> ExitCode:
    """Stop the run on purpose: Ctrl-C, wait, SIGTERM, wait, SIGKILL. `status` then says `stopped`."""
    from ops import session as run

    if app.group_name is not None:

        def one(host: Host, remote: t.Any, say: t.Callable[[str], None]) -> str:
            out = run.stop(remote, session, grace=grace)
            if not out.get("stopped"):
                return f"nothing stopped: {out.get('reason')}"
            return f"stopped attempt {out.get('attempt')} by {out.get('how')} after {out.get('seconds')}s" + _killed(
                out
            )

        return groups.on_each(app.members(), app.group_name, one)
    out = run.stop(app.remote(), session, grace=grace)
    if not out.get("stopped") and out.get("reason"):
        click.echo(f"nothing stopped: {out['reason']}")
        return ExitCode.OK
    e = out.get("exit") or {}
    how = f"signal {e['signal']}" if e.get("signal") else f"exit {e.get('exit_code')}" if e else "no exit record"
    click.echo(
        f"stopped attempt {out.get('attempt')} by {out.get('how')} after {out.get('seconds')}s ({how})" + _killed(out)
    )
    return ExitCode.OK if out.get("ended") else ExitCode.ERROR


def _killed(out: t.Mapping[str, t.Any]) -> str:
    """``; killed pid 12 (python train.py)``: the processes a stop had to SIGKILL (exit.json names them)."""
    from ops.probe import members_text

    killed = (out.get("exit") or {}).get("killed") or out.get("killed") or []
    return f"; killed {members_text(killed)} (still running after TERM)" if killed else ""


@click.command("status")
@session_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object (docs/design.md section 6).")
@click.option("--watch", type=Seconds(0.5), metavar="S", help="Repeat every S seconds until Ctrl-C.")
@click.option(
    "--facts", "show_facts", is_flag=True, help="Print the raw facts the state is computed from (for bug reports)."
)
@click.option("--all", "every_host", is_flag=True, help="Every host of the inventory at once, one line each.")
@click.pass_obj
def status_cmd(
    app: App, session: str | None, as_json: bool, watch: float | None, show_facts: bool, every_host: bool
) -> ExitCode:
    """One state, its cause and the evidence. Exit code = the state's code (0 running, 3 stalled, ...).

    With --group or --all: one line per host, then the verdict (running only when every host runs, else the
    worst state, naming the host and why); the exit code is the verdict's."""
    from ops import session as run

    app.end_at_once()
    if every_host or app.group_name is not None:
        if every_host and (app.group_name is not None or app.host_name is not None):
            raise click.UsageError("--all looks at every host: no --host or --group with it")
        if show_facts:
            raise click.UsageError("--facts is for one host: use --host")
        hosts = list(app.inventory.hosts.values()) if every_host else app.members()
        label = "all" if every_host else f"group {app.group_name}"
        kept: dict[str, t.Any] = {}  # one connection per host across the rounds of --watch
        try:
            while True:
                code = groups.status_of_many(
                    hosts, session, label, as_json=as_json, stamp=bool(watch), kept=kept if watch else None
                )
                if not watch:
                    return code
                time.sleep(watch)
        except KeyboardInterrupt:
            return ExitCode.OK
        finally:
            groups.close_all(kept)
    host = app.host
    loading: list[t.Any] = []

    def connect() -> t.Any:
        remote = app.remote()
        if not loading and "ops.probe" not in sys.modules:
            loading.append(run.import_beside("ops.probe"))  # classify's modules load while the agent runs
        return remote

    code = ExitCode.OK
    try:
        while True:
            facts = run.gather(host, session, connect)
            st = run.verdict(host, facts)  # the import lock waits for import_beside's thread
            if show_facts:
                click.echo(json.dumps(run.shown_facts(host, facts), indent=1, sort_keys=True))
                return exit_code_for_state(st.state)
            if st.state in (State.UNREACHABLE, State.CONTAINER_DOWN):
                app.close()  # reconnect on the next round
            code = exit_code_for_state(st.state)
            if as_json:
                click.echo(json.dumps(st.to_json()))
            else:
                if watch:
                    click.echo(f"--- {st.checked_at}")
                click.echo("\n".join(st.lines()))
            if not watch:
                return code
            time.sleep(watch)
    except KeyboardInterrupt:
        return code


@click.command("tail")
@session_option
@click.option("-n", "--lines", type=click.IntRange(min=1), default=30, show_default=True, help="How many lines.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new log lines until Ctrl-C.")
@click.option(
    "--source",
    type=click.Choice(["auto", "pane", "log"]),
    default="auto",
    show_default=True,
    help="auto: the live pane when the session is alive, else the durable log.",
)
@click.option(
    "--interval", type=Seconds(0.1), default=1.0, show_default=True, metavar="S", help="Polling interval of --follow."
)
@click.pass_obj
def tail_cmd(app: App, session: str | None, lines: int, follow: bool, source: str, interval: float) -> ExitCode:
    """The last lines of the run (the source used, and why, go to stderr)."""
    from ops import session as run

    if app.group_name is not None:
        if follow:
            raise click.UsageError("tail --follow is for one host: use --host (or tmux attach)")

        def one(host: Host, remote: t.Any, say: t.Callable[[str], None]) -> str:
            chunk = run.tail(remote, session, lines=lines, source=source)
            return "\n".join([f"[{chunk.source}] {chunk.reason}", *chunk.lines])  # printed host by host

        return groups.on_each(app.members(), app.group_name, one)
    remote = app.remote()
    chunk = run.tail(remote, session, lines=lines, source=source, follow=follow)
    click.echo(f"[{chunk.source}] {chunk.reason}", err=True)
    for line in chunk.lines:
        click.echo(line)
    if follow:
        try:
            run.follow(
                remote,
                chunk,
                session,
                interval=interval,
                emit=click.echo,
                note=lambda m: click.echo(f"[log] {m}", err=True),
            )
        except KeyboardInterrupt:
            pass
    return ExitCode.OK


@click.command("attach")
@session_option
@click.option("--exec", "do_exec", is_flag=True, help="Run the command (needs a terminal) instead of printing it.")
@click.pass_obj
def attach_cmd(app: App, session: str | None, do_exec: bool) -> ExitCode:
    """Print (or run) the command that attaches a terminal to the run's tmux pane."""
    from ops.attach import attach_argv

    argv = attach_argv(app.host, session)
    if not do_exec:
        click.echo(shlex.join(argv))
        return ExitCode.OK
    # Interactive: it needs this terminal, so it replaces dflashctl instead of going through a Transport.
    os.execvp(argv[0], argv)
