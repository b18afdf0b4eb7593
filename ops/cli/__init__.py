"""dflashctl: deploy, start, watch and restart DFlash training on a remote GPU box (or this machine).

Laid out as hatch lays out its CLI: here the click group, the ``App`` every command is given (click's
``obj``), and ``main``, which maps errors to exit codes in one place (``ops.exit_codes``: ``ExitCode``,
``STATE_EXIT``, ``ERROR_EXIT``). Commands raise ``OpsError`` subclasses or return a state; ``main`` turns
either into one message and one code. The commands live in the modules beside this one (``COMMANDS``),
each imported when its command runs: `dflashctl status` does not load deploy, doctor, plot or supervise
(importing all of them doubles the start-up, 0.23 s -> 0.47 s here); ``--help`` imports them all to list them.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import typing as t

import click

from ops import errors
from ops.exit_codes import ExitCode, end_process, exit_code_for_error
from ops.hosts import Host, Inventory, load_inventory

logger = logging.getLogger("ops")

_exit_at_once = False  # set by App.end_at_once: main() then ends the process at once

# command name -> "module:attribute" of its click command
COMMANDS = {
    "hosts": "ops.cli.hosts:hosts_cmd",
    "doctor": "ops.cli.hosts:doctor_cmd",
    "trust-host": "ops.cli.hosts:trust_host_cmd",
    "deploy": "ops.cli.deploy:deploy_cmd",
    "start": "ops.cli.run:start_cmd",
    "stop": "ops.cli.run:stop_cmd",
    "status": "ops.cli.run:status_cmd",
    "tail": "ops.cli.run:tail_cmd",
    "attach": "ops.cli.run:attach_cmd",
    "restart-on-crash": "ops.cli.supervision:restart_on_crash_cmd",
    "supervise": "ops.cli.supervision:supervise_group",
    "gpus": "ops.cli.supervision:gpus_cmd",
    "history": "ops.cli.records:history_cmd",
    "pull": "ops.cli.records:pull_cmd",
    "plot": "ops.cli.records:plot_cmd",
}


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

    def end_at_once(self) -> None:
        """This command leaves nothing to finalize but stdout and stderr (status: its connection is closed
        with the click context, and it writes no file): main() then ends the process at once."""
        global _exit_at_once
        _exit_at_once = True

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (``lazy``: name -> "module:attribute")."""

    def __init__(self, *args: t.Any, lazy: t.Mapping[str, str], **kwargs: t.Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.lazy:
            return super().get_command(ctx, cmd_name)
        module, attribute = self.lazy[cmd_name].split(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command) and command.name == cmd_name, self.lazy[cmd_name]
        return command


def init_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
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
