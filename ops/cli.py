"""dflashctl: deploy, start, watch and restart DFlash training on a remote GPU box (or this machine).

Exit codes are mapped in one place, ``ops.exit_codes`` (``ExitCode``, ``STATE_EXIT``, ``ERROR_EXIT``;
re-exported here). Commands raise ``OpsError`` subclasses or return a state; ``main`` turns either into
one message and one code. The --group forms are in ``ops.group_commands``.
"""

from __future__ import annotations

import logging
import math
import sys
import typing as t

import click

from ops import errors, group_commands
from ops.exit_codes import ExitCode, end_process, exit_code_for_error, exit_code_for_state
from ops.hosts import Host, Inventory, load_inventory
from ops.states import State

logger = logging.getLogger("ops")

# Each command imports what it uses inside its function: `dflashctl status` does not load deploy, doctor,
# plot or supervise (importing all of them doubles the start-up, 0.23 s -> 0.47 s here).


class App:
    """What every command shares within one CLI call: the inventory, the host, one connection."""

    def __init__(
        self, hosts_path: str | None, host_name: str | None, verbosity: int, group_name: str | None = None
    ) -> None:
        self.hosts_path = hosts_path
        self.host_name = host_name
        self.group_name = group_name
        self.verbosity = verbosity
        self._inventory: Inventory | None = None
        self._remote: t.Any = None

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            self._inventory = load_inventory(self.hosts_path)
        return self._inventory

    @property
    def host(self) -> Host:
        if self.group_name is not None:
            raise errors.ConfigError("--group", "this command acts on one host: use --host")
        return self.inventory.get(self.host_name)

    def members(self) -> list[Host]:
        """The hosts of ``--group``, each with the group's node command (torchrun around its own) and env."""
        import dataclasses

        assert self.group_name is not None
        g = self.inventory.group(self.group_name)
        hosts = self.inventory.hosts
        return [
            dataclasses.replace(hosts[n], command=g.node_command(hosts[n]), env=g.node_env(hosts[n])) for n in g.hosts
        ]

    def remote(self) -> t.Any:
        """The host's ``Remote`` (transport + container), connected once per CLI call."""
        if self._remote is None:
            from ops.remote import connect

            self._remote = connect(self.host)
        return self._remote

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None


pass_app = click.make_pass_decorator(App)

MAX_SECONDS = 365 * 24 * 3600.0  # one year: longer than any wait we mean; time.sleep overflows near 1e300


class Seconds(click.ParamType[float]):
    """A finite number of seconds in ``[minimum, MAX_SECONDS]`` (``> minimum`` with ``min_open``).

    The one type of every duration option: click's FloatRange lets NaN and inf through (NaN
    compares false with every bound), and then waits end at once (``stop --grace nan`` sent
    Ctrl-C, TERM and KILL within 0.02 s) or never, or time.sleep raises OverflowError.
    """

    name = "seconds"

    def __init__(self, minimum: float = 0.0, *, min_open: bool = False) -> None:
        self.minimum = minimum
        self.min_open = min_open

    def convert(self, value: t.Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            seconds = float(value)
        else:
            try:
                seconds = float(str(value))
            except ValueError:
                self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        if seconds < self.minimum or (self.min_open and seconds == self.minimum):
            self.fail(f"{value} is not {'>' if self.min_open else '>='} {self.minimum:g}", param, ctx)
        if seconds > MAX_SECONDS:
            self.fail(f"{value} is more than one year ({MAX_SECONDS:.0f} seconds)", param, ctx)
        return seconds


def _check_session(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--session follows hosts.toml's rule for `session`, checked here once, before anything runs."""
    from ops.keypath import check_name

    return None if value is None else check_name(value, "--session")


def init_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--hosts",
    "hosts_path",
    metavar="PATH",
    help="hosts.toml to use (else $DFLASHCTL_HOSTS, ./hosts.toml, ~/.config/dflashctl/hosts.toml).",
)
@click.option("--host", "host_name", metavar="NAME", help="Host from hosts.toml (default: its `default`).")
@click.option(
    "--group",
    "group_name",
    metavar="NAME",
    help="Every host of [groups.NAME] at once: deploy, start, stop, status, tail, restart-on-crash.",
)
@click.option("-v", "--verbose", count=True, help="More logging (-vv for every command run).")
@click.pass_context
def cli(
    ctx: click.Context, hosts_path: str | None, host_name: str | None, group_name: str | None, verbose: int
) -> None:
    """Run and watch DFlash drafter training on a remote GPU box, or on this machine."""
    init_logging(verbose)
    if host_name is not None and group_name is not None:
        raise click.UsageError("--host and --group exclude each other")
    app = App(hosts_path, host_name, verbose, group_name)
    ctx.obj = app
    ctx.call_on_close(app.close)


@cli.command("hosts")
@pass_app
def hosts_cmd(app: App) -> None:
    """List the hosts of the inventory (and check it)."""
    inv = app.inventory
    click.echo(f"inventory: {inv.source}")
    for name, h in inv.hosts.items():
        mark = "*" if name == inv.default else " "
        where = "this machine" if h.is_local else f"{h.user + '@' if h.user else ''}{h.address}:{h.port or 22}"
        ct = f", ct {h.container}" if h.container is not None else ""
        click.echo(f"{mark} {name:<12} {h.transport:<5} {where}{ct}  session={h.session}  workdir={h.workdir}")


# --- doctor, trust-host: the work is in ops/doctor.py and ops/transport/ (host_keys, ssh) -


@cli.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as one JSON object.")
@pass_app
def doctor_cmd(app: App, as_json: bool) -> ExitCode:
    """Check each host (or only --host): reachable, host key, login, container, tmux, python, disk, GPUs.

    Exit 0 when everything passes, else the exit code of the most basic failure.
    """
    from ops import doctor

    hosts = [app.host] if app.host_name else list(app.inventory.hosts.values())
    reports = []
    for host in hosts:
        report = doctor.diagnose(host)
        reports.append(report)
        if not as_json:
            click.echo(report.render())
    if as_json:
        click.echo(doctor.reports_json(reports))
    failure = next((r.first_failure for r in reports if r.first_failure), None)
    if failure is None:
        return ExitCode.OK
    return exit_code_for_error(failure.error) if failure.error is not None else ExitCode.ERROR


@cli.command("trust-host")
@click.option("--yes", is_flag=True, help="Record the key without asking.")
@click.option(
    "--replace", is_flag=True, help="Accept a CHANGED key: drop the old entries for this host, record the new one."
)
@pass_app
def trust_host_cmd(app: App, yes: bool, replace: bool) -> ExitCode:
    """Show the host's SSH key fingerprint and record it in known_hosts once you confirm."""
    from ops.transport import record_host_key, scan_host_key

    host = app.host
    if host.is_local:
        raise errors.ConfigError(f"hosts.{host.name}.transport", "a local host has no SSH host key to trust")
    scan = scan_host_key(host)
    name = scan.target.known_name
    click.echo(f"{name} offers {scan.key_type} {scan.fingerprint}")
    if scan.note:
        click.echo(f"note: {scan.note}", err=True)
    if scan.verdict == "revoked":
        from ops.transport import revoked_error

        raise revoked_error(scan.target, scan.key, scan.revoked_at)
    if scan.verdict == "known":
        click.echo(
            f"already trusted (in {', '.join(sorted({f for f, _, fp in scan.recorded if fp == scan.fingerprint}))})"
        )
        return ExitCode.OK
    if scan.verdict == "changed":
        click.echo(f"WARNING: HOST KEY CHANGED for {name}. Known until now:", err=True)
        for f, kind, fp in scan.recorded:
            click.echo(f"  {kind} {fp}  ({f})", err=True)
        click.echo(
            f"The server now offers {scan.key_type} {scan.fingerprint}. This can be an attack (or a reinstalled host).",
            err=True,
        )
        if not replace:
            raise errors.HostKeyRejected(
                host.name,
                f"host key for {name} changed; nothing recorded. If the change is expected, run again with --replace",
                fingerprint=scan.fingerprint,
                changed=True,
                expected=scan.recorded[0][2],
                key_type=scan.key_type,
            )
    if not yes and not click.confirm(f"Trust this key and record it in {scan.file}?", default=False):
        click.echo("Not recorded.", err=True)
        return ExitCode.ERROR
    path = record_host_key(scan, replace=scan.verdict == "changed")
    click.echo(f"recorded {scan.key_type} {scan.fingerprint} for {name} in {path}")
    if scan.verdict == "changed" and scan.patterns:
        # A pattern line covers other hosts too: we never edit it; the exact entry now wins for this host.
        click.echo(f"note: left as they are (they match other hosts too): {', '.join(scan.patterns)}", err=True)
    return ExitCode.OK


@cli.command("deploy")
@click.option("--dry-run", is_flag=True, help="List the files that would be added/changed/removed; upload nothing.")
@click.option("--rollback", is_flag=True, help="Switch current back to the previous release.")
@click.option("--force", is_flag=True, help="Deploy even while a run is live (it keeps its old modules).")
@click.option("--install", is_flag=True, help="pip-install the modules the host's python lacks.")
@click.option("--source", metavar="DIR", help="Checkout to deploy (default: the one dflashctl runs from).")
@pass_app
def deploy_cmd(app: App, dry_run: bool, rollback: bool, force: bool, install: bool, source: str | None) -> ExitCode:
    """Put this project's code on the host: a new release, then current -> it (atomic)."""
    from ops import deploy

    if rollback and (install or source):
        raise click.UsageError("--rollback takes no --install or --source")
    if app.group_name is not None:

        def one(host: Host, remote: t.Any, say: t.Callable[[str], None]) -> str:
            if rollback:
                return str(deploy.rollback(remote, host, force=force, dry_run=dry_run, echo=say).summary)
            return str(
                deploy.deploy(
                    remote, host, source=source, dry_run=dry_run, force=force, install=install, echo=say
                ).summary
            )

        return group_commands.on_each(app.members(), app.group_name, one)
    if rollback:
        outcome = deploy.rollback(app.remote(), app.host, force=force, dry_run=dry_run, echo=click.echo)
    else:
        outcome = deploy.deploy(
            app.remote(), app.host, source=source, dry_run=dry_run, force=force, install=install, echo=click.echo
        )
    click.echo(outcome.summary)
    return ExitCode.OK


# --- start, stop, status, tail, attach: thin; the work is in ops/session.py -----------

_session_option = click.option(
    "--session",
    metavar="NAME",
    callback=_check_session,
    expose_value=True,
    help="tmux session / run name (default: the host's `session`).",
)


@cli.command("start")
@_session_option
@click.option("--replace", is_flag=True, help="Stop a live run of this session first, then start a new attempt.")
@pass_app
def start_cmd(app: App, session: str | None, replace: bool) -> ExitCode:
    """Start the host's command in a persistent tmux session (a new attempt dir each time)."""
    from ops import session as run

    if app.group_name is not None:
        return group_commands.start(app.members(), app.group_name, session, replace)
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


@cli.command("stop")
@_session_option
@click.option(
    "--grace",
    type=Seconds(0),
    default=60.0,
    show_default=True,
    metavar="S",
    help="Seconds to wait after Ctrl-C (and again after SIGTERM) before escalating.",
)
@pass_app
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

        return group_commands.on_each(app.members(), app.group_name, one)
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


@cli.command("status")
@_session_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object (docs/design.md section 6).")
@click.option("--watch", type=Seconds(0.5), metavar="S", help="Repeat every S seconds until Ctrl-C.")
@click.option(
    "--facts", "show_facts", is_flag=True, help="Print the raw facts the state is computed from (for bug reports)."
)
@click.option("--all", "every_host", is_flag=True, help="Every host of the inventory at once, one line each.")
@pass_app
def status_cmd(
    app: App, session: str | None, as_json: bool, watch: float | None, show_facts: bool, every_host: bool
) -> ExitCode:
    """One state, its cause and the evidence. Exit code = the state's code (0 running, 3 stalled, ...).

    With --group or --all: one line per host, then the verdict (running only when every host runs, else the
    worst state, naming the host and why); the exit code is the verdict's."""
    import json
    import time

    from ops import session as run

    global _exit_at_once
    _exit_at_once = True
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
                code = group_commands.status_of_many(
                    hosts, session, label, as_json=as_json, stamp=bool(watch), kept=kept if watch else None
                )
                if not watch:
                    return code
                time.sleep(watch)
        except KeyboardInterrupt:
            return ExitCode.OK
        finally:
            group_commands.close_all(kept)
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
            from ops import probe  # the import lock waits for import_beside's thread

            st = probe.classify(facts)
            if show_facts:
                click.echo(json.dumps(facts, indent=1, sort_keys=True))
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


@cli.command("tail")
@_session_option
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
@pass_app
def tail_cmd(app: App, session: str | None, lines: int, follow: bool, source: str, interval: float) -> ExitCode:
    """The last lines of the run (the source used, and why, go to stderr)."""
    from ops import session as run

    if app.group_name is not None:
        if follow:
            raise click.UsageError("tail --follow is for one host: use --host (or tmux attach)")

        def one(host: Host, remote: t.Any, say: t.Callable[[str], None]) -> str:
            chunk = run.tail(remote, session, lines=lines, source=source)
            return "\n".join([f"[{chunk.source}] {chunk.reason}", *chunk.lines])  # printed host by host

        return group_commands.on_each(app.members(), app.group_name, one)
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


@cli.command("attach")
@_session_option
@click.option("--exec", "do_exec", is_flag=True, help="Run the command (needs a terminal) instead of printing it.")
@pass_app
def attach_cmd(app: App, session: str | None, do_exec: bool) -> ExitCode:
    """Print (or run) the command that attaches a terminal to the run's tmux pane."""
    import os
    import shlex

    from ops.attach import attach_argv

    argv = attach_argv(app.host, session)
    if not do_exec:
        click.echo(shlex.join(argv))
        return ExitCode.OK
    # Interactive: it needs this terminal, so it replaces dflashctl instead of going through a Transport.
    os.execvp(argv[0], argv)


# --- restart-on-crash: thin; the policy and the loop are in ops/supervise/ -------------


# restart-on-crash's policy, on restart-on-crash itself and on `supervise install` (which forwards it to the
# supervisor on the host): one declaration, so both take the same options with the same defaults.
_POLICY_OPTIONS: tuple[t.Callable[[t.Any], t.Any], ...] = (
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
)


def _policy_options(f: t.Any) -> t.Any:
    for option in reversed(_POLICY_OPTIONS):
        f = option(f)
    return f


@cli.command("restart-on-crash")
@_session_option
@_policy_options
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
@pass_app
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
    on_event: str | None,
    notify_urls: tuple[str, ...],
    state_dir: str | None,
) -> ExitCode:
    """Watch the run and restart it after a crash (backoff, crash-loop guard, incident files).

    Exit 0 when the run succeeded, or with --once when it is left running (or was restarted); with
    --once a run left alone exits with its `status` code; 11 when it gave up on a crash loop, 12 when it
    gave up on a run that diverged. Ctrl-C
    or SIGTERM stop the supervisor, never the run (exit 0).
    """
    from pathlib import Path

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
    )
    hook = supervise.parse_hook(on_event)
    watched = app.members() if app.group_name is not None else [app.host]
    notifier = None
    if notify_urls:
        import os

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


# --- history: the records and the table are in ops/history.py ---------------------------


@cli.command("history")
@_session_option
@click.option("--json", "as_json", is_flag=True, help="Print the history as one JSON object.")
@click.option("-n", "--last", type=click.IntRange(min=1), default=None, metavar="N", help="Only the last N attempts.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="restart-on-crash's state dir, whose incidents are shown between the attempts (default: its default).",
)
@pass_app
def history_cmd(app: App, session: str | None, as_json: bool, last: int | None, state_dir: str | None) -> ExitCode:
    """Every attempt of the session, oldest first: when, how long, how it ended (state, cause, exit code or
    signal), the step it reached, the checkpoint it resumed from, who started it and why, and the
    supervisor's incidents between them. With --group: a row per node."""
    import json
    from pathlib import Path

    from ops import history, supervise
    from ops.remote import connect

    if app.group_name is not None:
        hosts, name = app.members(), f"group {app.group_name}"
    else:
        hosts, name = [app.host], app.host.name
    state = Path(state_dir).expanduser() if state_dir else supervise.default_state_dir()
    h = history.history(hosts, name, session, connect, state_dir=state, last=last)
    if as_json:
        click.echo(json.dumps(h.to_json()))
    else:
        click.echo("\n".join(h.lines()))
    return ExitCode.ERROR if h.errors else ExitCode.OK


@cli.command("pull")
@_session_option
@click.option("--latest", "pick", flag_value="latest", default=True, help="The newest checkpoint (the default).")
@click.option("--best", "pick", flag_value="best", help="The checkpoint `best` points to (highest held-out tau).")
@click.option("--step", type=click.IntRange(min=0), default=None, metavar="N", help="The checkpoint step-N.")
@click.option(
    "--export",
    "export",
    metavar="PATH",
    default=None,
    help="A `dflash export` folder on the box instead (absolute, or relative to <run_dir>/<session>).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was pulled as one JSON object (no progress line).")
@click.argument("dest", type=click.Path(file_okay=False))
@pass_app
def pull_cmd(
    app: App, session: str | None, pick: str, step: int | None, export: str | None, as_json: bool, dest: str
) -> ExitCode:
    """Copy a checkpoint (default: the latest) from the box into DEST, each file checked by its sha256;
    a pull that was cut goes on where it stopped. DEST may hold only this checkpoint's files."""
    import json
    from pathlib import Path

    from ops import pull
    from ops.session import session_name

    given = [o for o, on in (("--best", pick == "best"), ("--step", step is not None), ("--export", export)) if on]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)}: choose one")
    chosen: pull.Pick = {"step": step} if step is not None else pick
    name = session_name(app.host, session)
    bar = None if as_json or not sys.stderr.isatty() else pull.ProgressLine(sys.stderr)
    r = pull.pull(
        app.remote(),
        session,
        Path(dest).expanduser(),
        pick=chosen,
        export=export,
        progress=bar.update if bar else None,
        on_source=bar.start if bar else None,
    )
    if bar:
        bar.end()
    if as_json:
        click.echo(json.dumps(r.to_json(app.host.name, name)))
    else:
        click.echo("\n".join(r.lines(app.host.name)))
    return ExitCode.OK


# --- supervise: the supervisor on the Proxmox host; the work is in ops/supervise/install.py ---


@cli.group("supervise")
def supervise_group() -> None:
    """Put restart-on-crash on the Proxmox host that runs the container (it never sleeps), and look at it.

    install, status, stop, logs, uninstall: each acts on the host of --host over its ssh connection.
    """


@supervise_group.command("install")
@_session_option
@_policy_options
@click.option(
    "--notify",
    "notify",
    multiple=True,
    metavar="URL",
    help="Where incidents are announced (repeatable; kept in a 0600 file on the host, never on a command line).",
)
@pass_app
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
@_session_option
@click.option("--json", "as_json", is_flag=True, help="Print what the host says as one JSON object.")
@click.option("-n", "--incidents", type=click.IntRange(min=0), default=5, show_default=True, help="Incidents shown.")
@pass_app
def supervise_status_cmd(app: App, session: str | None, as_json: bool, incidents: int) -> ExitCode:
    """Is the supervisor running, since when, its last probe, its last action, its incidents.

    Exit 0 when it runs, 8 when it is installed but not running, 7 when none is installed."""
    import json

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
@_session_option
@pass_app
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
@_session_option
@click.option("-n", "--lines", type=click.IntRange(min=1), default=50, show_default=True, help="How many lines.")
@pass_app
def supervise_logs_cmd(app: App, session: str | None, lines: int) -> ExitCode:
    """The supervisor's own log (what it saw and did), last lines; the run's log is `dflashctl tail`."""
    from ops.supervise import install

    out = install.call(app.host, "logs", session, lines=lines)
    click.echo(f"[{out.get('log')}]", err=True)
    for line in out.get("lines") or []:
        click.echo(line)
    return ExitCode.OK


@supervise_group.command("uninstall")
@_session_option
@pass_app
def supervise_uninstall_cmd(app: App, session: str | None) -> ExitCode:
    """Stop the supervisor and remove it from the host (its unit, its entry, its secrets); its incidents
    and log stay. The run is left as it is."""
    from ops import wire
    from ops.session import session_name
    from ops.supervise import install

    out = wire.parse_supervisor_stopped(install.call(app.host, "uninstall", session))
    click.echo("\n".join(install.uninstalled_lines(app.host.name, session_name(app.host, session), out)))
    return ExitCode.OK


# --- plot: fetch + cache + draw are in ops/plot.py --------------------------------------


@cli.command("plot")
@_session_option
@click.option("--out", default=None, metavar="FILE", help="FILE.png, .svg or .html (default: <session>-dashboard.png).")
@click.option("--since", type=click.IntRange(min=0), default=None, metavar="STEP", help="Only steps >= STEP.")
@click.option("--time", "use_time", is_flag=True, help="Wall time on x (since the first attempt started), not steps.")
@click.option(
    "--csv",
    "csv_path",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="Also write every point drawn: attempt, step, time, series, value.",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="Where fetched metrics are kept (default: restart-on-crash's, <state>/plot-cache).",
)
@pass_app
def plot_cmd(
    app: App,
    session: str | None,
    out: str | None,
    since: int | None,
    use_time: bool,
    csv_path: str | None,
    state_dir: str | None,
) -> ExitCode:
    """Draw the run's dashboard from the metrics.jsonl of every attempt (fetched incrementally)."""
    from pathlib import Path

    from ops import plot, supervise
    from ops.session import session_name

    name = session_name(app.host, session)
    out = out or f"{name}-dashboard.png"
    plot.check_out(out)
    plot.require_matplotlib()  # a missing extra is said before anything connects
    state = Path(state_dir).expanduser() if state_dir else supervise.private_dir(supervise.default_state_dir())
    r = plot.plot(app.remote(), session, out=out, state_dir=state, since=since, use_time=use_time, csv_path=csv_path)
    f = r.fetched
    click.echo(
        f"fetched {f.new_bytes} new bytes of metrics.jsonl in {f.calls} call(s); "
        f"{len(r.attempts)} attempt(s), {len(f.meta.get('checkpoints') or [])} checkpoint(s)"
    )
    for a in r.attempts:
        steps = f"steps {a.records[0]['step']}..{a.records[-1]['step']}" if a.records else "no records"
        click.echo(f"  attempt {a.number}: {len(a.records)} records, {steps}, {a.end or 'running'}")
    click.echo(f"wrote {out}" + (f" and {csv_path}" if csv_path else "") + f" ({r.points} points)")
    return ExitCode.OK


def main(argv: t.Sequence[str] | None = None) -> t.NoReturn:
    """Console entry point: run the CLI, map errors to one message and one exit code."""
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="dflashctl", standalone_mode=False)
    except errors.OpsError as e:
        click.echo(f"dflashctl: {e}", err=True)
        sys.exit(int(exit_code_for_error(e)))
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(int(ExitCode.ERROR))
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.BadParameter as e:
        e.show()
        sys.exit(int(ExitCode.ERROR))  # a bad argument VALUE is our error (1), not a usage error (2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    code = int(rv) if isinstance(rv, int) else 0
    if _exit_at_once and argv is None:  # the console script; a caller in this process gets SystemExit
        end_process(code)
    sys.exit(code)


# Set by a command that leaves nothing to finalize but stdout and stderr (status: its connection is
# closed with the click context, and it writes no file): main() then ends the process at once.
_exit_at_once = False


if __name__ == "__main__":
    main()
