"""Supervision: restart-on-crash (here, on the operator's machine) and `supervise` (the same supervisor
installed on the Proxmox host, which never sleeps). Thin: the policy and the loop are in ops/supervise/,
the host side in ops/supervise/install.py. Both take the same policy options, declared once here."""

from __future__ import annotations

import json
import os
import time
import typing as t
from pathlib import Path

import click

from ops import errors
from ops.cli.options import Seconds, session_option
from ops.exit_codes import ExitCode, exit_code_for_state
from ops.states import State

if t.TYPE_CHECKING:
    from ops.cli import App


# restart-on-crash's policy, on restart-on-crash itself and on `supervise install` (which forwards it to the
# supervisor on the host): one declaration, so both take the same options with the same defaults.
POLICY_OPTIONS: tuple[t.Callable[[t.Any], t.Any], ...] = (
    click.option(
        "--interval",
        type=Seconds(0, min_open=True),
        default=30.0,
        show_default=True,
        metavar="S",
        help="Seconds between probes.",
    ),
    click.option(
        "--backoff",
        type=Seconds(0),
        default=10.0,
        show_default=True,
        metavar="S",
        help="First wait before a restart; doubles (with jitter) per restart.",
    ),
    click.option(
        "--max-backoff",
        type=Seconds(0),
        default=900.0,
        show_default=True,
        metavar="S",
        help="Longest wait before a restart.",
    ),
    click.option(
        "--min-uptime",
        type=Seconds(0),
        default=600.0,
        show_default=True,
        metavar="S",
        help="A run that lives this long resets the backoff; a repeat crash sooner is a crash loop.",
    ),
    click.option(
        "--max-restarts",
        type=click.IntRange(min=0),
        default=5,
        show_default=True,
        metavar="N",
        help="Give up after more than N restarts within --window.",
    ),
    click.option(
        "--window",
        type=Seconds(0, min_open=True),
        default=3600.0,
        show_default=True,
        metavar="S",
        help="The time window of --max-restarts.",
    ),
    click.option(
        "--restart-stalled",
        is_flag=True,
        help="Also restart a stalled run (stop it first, stack saved if py-spy is there).",
    ),
    click.option(
        "--start-container", is_flag=True, help="Start a stopped container (pct or the PVE API), then restart the run."
    ),
    click.option(
        "--retry-oom", is_flag=True, help="Also restart after a CUDA out-of-memory crash (it usually repeats)."
    ),
    click.option(
        "--on-diverged",
        type=click.Choice(["give-up", "resume-from-last-finite"]),
        default="give-up",
        show_default=True,
        help="A run that diverged (NaN/inf): give up (exit 12), or resume once from its last finite checkpoint "
        "(the same data replays).",
    ),
    click.option(
        "--on-gpu-fault",
        type=click.Choice(["give-up", "exclude"]),
        default="give-up",
        show_default=True,
        help="A GPU that failed in hardware (Xid): give up (exit 13), or restart without it and any GPU the "
        "gpu-health check fails (DFLASH_EXCLUDED_GPUS; a second fault on it gives up). `dflashctl gpus` lists them.",
    ),
)


def policy_options(f: t.Any) -> t.Any:
    for option in reversed(POLICY_OPTIONS):
        f = option(f)
    return f


@click.command("restart-on-crash")
@session_option
@policy_options
@click.option("--once", is_flag=True, help="One probe and at most one restart (for cron and systemd timers).")
@click.option(
    "--on-event",
    metavar="CMD",
    help="Run CMD for each incident: its JSON on stdin, DFLASHCTL_STATE/CAUSE/HOST/SESSION/ACTION set.",
)
@click.option(
    "--notify",
    "notify_urls",
    metavar="URL",
    multiple=True,
    help="Send each incident (and the supervisor's start and stop) to this apprise URL: slack://, ntfy://, "
    "json://host:port, mailto://...; repeatable. Needs the notify extra: pip install 'dflash[notify]'.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="Incidents, lock and memory (default $XDG_STATE_HOME/dflashctl or ~/.local/state/dflashctl).",
)
@click.pass_obj
def restart_on_crash_cmd(
    app: App,
    session: str | None,
    interval: float,
    backoff: float,
    max_backoff: float,
    min_uptime: float,
    max_restarts: int,
    window: float,
    once: bool,
    restart_stalled: bool,
    start_container: bool,
    retry_oom: bool,
    on_diverged: str,
    on_gpu_fault: str,
    on_event: str | None,
    notify_urls: tuple[str, ...],
    state_dir: str | None,
) -> ExitCode:
    """Watch the run and restart it after a crash (backoff, crash-loop guard, incident files).

    Exit 0 when the run succeeded, or with --once when it is left running (or was restarted); with
    --once a run left alone exits with its `status` code; 11 when it gave up on a crash loop, 12 when it
    gave up on a run that diverged, 13 on a GPU that failed in hardware. Ctrl-C
    or SIGTERM stop the supervisor, never the run (exit 0).
    """
    from ops import supervise

    opts = supervise.Options(
        interval=interval,
        backoff=backoff,
        max_backoff=max_backoff,
        min_uptime=min_uptime,
        max_restarts=max_restarts,
        window=window,
        once=once,
        restart_stalled=restart_stalled,
        start_container=start_container,
        retry_oom=retry_oom,
        on_diverged=on_diverged,
        on_gpu_fault=on_gpu_fault,
    )
    if app.group_name is not None and on_gpu_fault == "exclude":
        raise errors.ConfigError("--on-gpu-fault", "exclude is for one host's run, not a --group's")
    hook = supervise.parse_hook(on_event)
    watched = app.members() if app.group_name is not None else [app.host]
    notifier = None
    if notify_urls:
        from ops.notify import notifier_for

        # every host's env values and API tokens: a message carries log lines, which could hold any of them
        notifier = notifier_for(notify_urls, [*watched, *app.inventory.hosts.values()], os.environ, click.echo)
    sup: supervise.Supervisor
    if app.group_name is not None:
        from ops.supervise.group import GroupSupervisor

        sup = GroupSupervisor(
            app.inventory.group(app.group_name),
            watched,
            session,
            opts,
            state_dir=Path(state_dir).expanduser() if state_dir else None,
            on_event=hook,
            emit=click.echo,
            hide_env=app.inventory.secret_env,
            notifier=notifier,
        )
    else:
        sup = supervise.Supervisor(
            app.host,
            session,
            opts,
            state_dir=Path(state_dir).expanduser() if state_dir else None,
            on_event=hook,
            emit=click.echo,
            hide_env=app.inventory.secret_env,
            notifier=notifier,
        )
    outcome = sup.run()  # CrashLoop (11), GpuFaultGiveUp (13) and SupervisorLocked (1) are raised
    if outcome.kind != "once" or outcome.state in (None, "restarted", State.RUNNING, State.SUCCEEDED):
        return ExitCode.OK
    return exit_code_for_state(outcome.state)


INCLUDE_OPTION = click.option(
    "--include",
    "include",
    multiple=True,
    metavar="BUS",
    help="Put this GPU back (a PCI bus id: 0000:b3:00.0, or b3:00) after it was reset; repeatable.",
)


@click.command("gpus")
@session_option
@INCLUDE_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the excluded set as one JSON object.")
@click.option("--state-dir", type=click.Path(file_okay=False), metavar="DIR", help="restart-on-crash's --state-dir.")
@click.pass_obj
def gpus_cmd(app: App, session: str | None, include: tuple[str, ...], as_json: bool, state_dir: str | None) -> ExitCode:
    """The GPUs restart-on-crash --on-gpu-fault exclude leaves out of the run (DFLASH_EXCLUDED_GPUS), and
    --include to put one back. This machine's supervisor; the one installed on the host: `supervise gpus`."""
    from ops.probe import iso
    from ops.session import session_name
    from ops.state_dir import default_state_dir
    from ops.supervise.exclusions import Exclusions, answer, answer_lines
    from ops.supervise.state import slug

    name = session_name(app.host, session)
    root = Path(state_dir).expanduser() if state_dir else default_state_dir()
    store = Exclusions(root / "supervise" / f"{slug(app.host.name)}.{slug(name)}", app.host.name, name)
    try:
        doc = answer(store, include, iso(time.time()))
    except ValueError as e:
        raise errors.ConfigError("--include", str(e)) from None
    except OSError as e:
        raise errors.OpsError(f"cannot write {store.path}: {e.strerror or e}") from None
    click.echo(json.dumps(doc) if as_json else "\n".join(answer_lines(f"{app.host.name}/{name}", doc)))
    return ExitCode.OK


# --- supervise: the supervisor on the Proxmox host; the work is in ops/supervise/install.py ---


@click.group("supervise")
def supervise_group() -> None:
    """Put restart-on-crash on the Proxmox host that runs the container (it never sleeps), and look at it.

    install, status, stop, logs, uninstall: each acts on the host of --host over its ssh connection.
    """


@supervise_group.command("install")
@session_option
@policy_options
@click.option(
    "--notify",
    "notify",
    multiple=True,
    metavar="URL",
    help="Where incidents are announced (repeatable; kept in a 0600 file on the host, never on a command line).",
)
@click.pass_obj
def supervise_install_cmd(app: App, /, session: str | None, notify: tuple[str, ...], **policy: t.Any) -> ExitCode:
    """Install (or update) the supervisor of the run on the host and start it: a systemd unit where
    systemd is PID 1, else a tmux session there. Installing again replaces it with the new options."""
    from ops import supervise, wire
    from ops.session import session_name
    from ops.supervise import install

    out = wire.parse_supervisor_installed(
        install.install(app.host, session, supervise.Options(**policy), notify=notify, echo=click.echo)
    )
    click.echo("\n".join(install.installed_lines(app.host.name, session_name(app.host, session), out)))
    for note in out.notes:
        click.echo(f"note: {note}", err=True)
    return ExitCode.OK


@supervise_group.command("status")
@session_option
@click.option("--json", "as_json", is_flag=True, help="Print what the host says as one JSON object.")
@click.option("-n", "--incidents", type=click.IntRange(min=0), default=5, show_default=True, help="Incidents shown.")
@click.pass_obj
def supervise_status_cmd(app: App, session: str | None, as_json: bool, incidents: int) -> ExitCode:
    """Is the supervisor running, since when, its last probe, its last action, its incidents.

    Exit 0 when it runs, 8 when it is installed but not running, 7 when none is installed."""
    from ops import wire
    from ops.session import session_name
    from ops.supervise import install

    try:
        out = install.call(app.host, "status", session, incidents=incidents)
    except errors.NotInstalled as e:
        out = {"installed": False, "message": str(e)}
    st = wire.parse_supervisor_status(out)
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo("\n".join(install.status_lines(app.host.name, session_name(app.host, session), st)))
    if not st.installed:
        return ExitCode.NOT_STARTED
    return ExitCode.OK if st.running else ExitCode.STOPPED


@supervise_group.command("stop")
@session_option
@click.pass_obj
def supervise_stop_cmd(app: App, session: str | None) -> ExitCode:
    """Stop the supervisor on the host (the run goes on, unwatched). systemd starts it again at the next
    boot; `supervise install` starts it now, `supervise uninstall` removes it."""
    from ops import wire
    from ops.session import session_name
    from ops.supervise import install

    out = wire.parse_supervisor_stopped(install.call(app.host, "stop", session))
    name = f"{app.host.name}/{session_name(app.host, session)}"
    if out.was_running and not out.stopped:
        click.echo(f"the supervisor of {name} (pid {out.pid}) did not stop", err=True)
        return ExitCode.ERROR
    how = f"stopped the supervisor of {name} ({out.mode}, pid {out.pid})"
    click.echo(f"{how if out.was_running else f'the supervisor of {name} was not running'}; the run is left as it is")
    return ExitCode.OK


@supervise_group.command("logs")
@session_option
@click.option("-n", "--lines", type=click.IntRange(min=1), default=50, show_default=True, help="How many lines.")
@click.pass_obj
def supervise_logs_cmd(app: App, session: str | None, lines: int) -> ExitCode:
    """The supervisor's own log (what it saw and did), last lines; the run's log is `dflashctl tail`."""
    from ops.supervise import install

    out = install.call(app.host, "logs", session, lines=lines)
    click.echo(f"[{out.get('log')}]", err=True)
    for line in out.get("lines") or []:
        click.echo(line)
    return ExitCode.OK


@supervise_group.command("gpus")
@session_option
@INCLUDE_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the excluded set as one JSON object.")
@click.pass_obj
def supervise_gpus_cmd(app: App, session: str | None, include: tuple[str, ...], as_json: bool) -> ExitCode:
    """The GPUs the installed supervisor leaves out of the run (--on-gpu-fault exclude), and --include to put
    one back after a reset (the next attempt it starts runs on it again)."""
    from ops.session import session_name
    from ops.supervise import install
    from ops.supervise.exclusions import answer_lines

    out = install.call(app.host, "gpus", session, include=list(include))
    doc = {k: out.get(k) for k in ("excluded", "included", "not_excluded", "path", "problem")}
    click.echo(
        json.dumps(doc)
        if as_json
        else "\n".join(answer_lines(f"{app.host.name}/{session_name(app.host, session)}", doc))
    )
    return ExitCode.OK


@supervise_group.command("uninstall")
@session_option
@click.pass_obj
def supervise_uninstall_cmd(app: App, session: str | None) -> ExitCode:
    """Stop the supervisor and remove it from the host (its unit, its entry, its secrets); its incidents
    and log stay. The run is left as it is."""
    from ops import wire
    from ops.session import session_name
    from ops.supervise import install

    out = wire.parse_supervisor_stopped(install.call(app.host, "uninstall", session))
    click.echo("\n".join(install.uninstalled_lines(app.host.name, session_name(app.host, session), out)))
    return ExitCode.OK
