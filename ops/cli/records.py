"""The run's records: history (every attempt and the supervisor's incidents), pull (a checkpoint off the box),
plot (the dashboard from metrics.jsonl). Thin: the work is in ops/history.py, ops/pull.py and ops/plot.py."""

from __future__ import annotations

import json
import sys
import typing as t
from pathlib import Path

import click

from ops.cli.options import session_option
from ops.exit_codes import ExitCode

if t.TYPE_CHECKING:
    from ops.cli import App


# --- history: the records and the table are in ops/history.py ---------------------------


@click.command("history")
@session_option
@click.option("--json", "as_json", is_flag=True, help="Print the history as one JSON object.")
@click.option("-n", "--last", type=click.IntRange(min=1), default=None, metavar="N", help="Only the last N attempts.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    metavar="DIR",
    help="restart-on-crash's state dir, whose incidents are shown between the attempts (default: its default).",
)
@click.pass_obj
def history_cmd(app: App, session: str | None, as_json: bool, last: int | None, state_dir: str | None) -> ExitCode:
    """Every attempt of the session, oldest first: when, how long, how it ended (state, cause, exit code or
    signal), the step it reached, the checkpoint it resumed from, who started it and why, and the
    supervisor's incidents between them. With --group: a row per node."""
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


@click.command("pull")
@session_option
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
@click.pass_obj
def pull_cmd(
    app: App, session: str | None, pick: str, step: int | None, export: str | None, as_json: bool, dest: str
) -> ExitCode:
    """Copy a checkpoint (default: the latest) from the box into DEST, each file checked by its sha256;
    a pull that was cut goes on where it stopped. DEST may hold only this checkpoint's files."""
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


# --- plot: fetch + cache + draw are in ops/plot.py --------------------------------------


@click.command("plot")
@session_option
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
@click.pass_obj
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
