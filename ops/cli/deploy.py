"""deploy (and deploy --rollback): this project's code on the host as a new release, then current -> it.
Thin: the work is in ops/deploy.py; the --group form is one line per host (ops/cli/groups.py)."""

from __future__ import annotations

import typing as t

import click

from ops.cli import groups
from ops.exit_codes import ExitCode
from ops.hosts import Host

if t.TYPE_CHECKING:
    from ops.cli import App


@click.command("deploy")
@click.option("--dry-run", is_flag=True, help="List the files that would be added/changed/removed; upload nothing.")
@click.option("--rollback", is_flag=True, help="Switch current back to the previous release.")
@click.option("--force", is_flag=True, help="Deploy even while a run is live (it keeps its old modules).")
@click.option("--install", is_flag=True, help="pip-install the modules the host's python lacks.")
@click.option("--source", metavar="DIR", help="Checkout to deploy (default: the one dflashctl runs from).")
@click.pass_obj
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

        return groups.on_each(app.members(), app.group_name, one)
    if rollback:
        outcome = deploy.rollback(app.remote(), app.host, force=force, dry_run=dry_run, echo=click.echo)
    else:
        outcome = deploy.deploy(
            app.remote(), app.host, source=source, dry_run=dry_run, force=force, install=install, echo=click.echo
        )
    click.echo(outcome.summary)
    return ExitCode.OK
