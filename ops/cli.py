"""dflashctl: deploy, start, watch and restart DFlash training on a remote GPU box (or this machine).

This module is the only place that maps states and errors to exit codes (``ExitCode``,
``STATE_EXIT``, ``ERROR_EXIT``). Commands raise ``OpsError`` subclasses or return a state; ``main``
turns either into one message and one code.
"""

from __future__ import annotations

import enum
import logging
import sys
import typing as t

import click

from ops import errors
from ops.hosts import Host, Inventory, load_inventory

logger = logging.getLogger("ops")


class ExitCode(enum.IntEnum):
    OK = 0
    ERROR = 1  # dflashctl's own error: bad config, bad argument values
    USAGE = 2  # click's usage error
    STALLED = 3
    SUCCEEDED = 4
    CRASHED = 5
    LOST = 6
    NOT_STARTED = 7
    STOPPED = 8
    CONTAINER_DOWN = 9
    UNREACHABLE = 10
    CRASH_LOOP = 11


# DESIGN.md section 6: the state a status reports -> the exit code of `status`.
STATE_EXIT: dict[str, ExitCode] = {
    "running": ExitCode.OK,
    "stalled": ExitCode.STALLED,
    "succeeded": ExitCode.SUCCEEDED,
    "crashed": ExitCode.CRASHED,
    "lost": ExitCode.LOST,
    "not-started": ExitCode.NOT_STARTED,
    "stopped": ExitCode.STOPPED,
    "container-down": ExitCode.CONTAINER_DOWN,
    "unreachable": ExitCode.UNREACHABLE,
}

# Errors -> exit codes; the first matching class wins (subclasses before their parents).
ERROR_EXIT: tuple[tuple[type[errors.OpsError], ExitCode], ...] = (
    (errors.UnreachableError, ExitCode.UNREACHABLE),
    (errors.ContainerDown, ExitCode.CONTAINER_DOWN),
    (errors.CrashLoop, ExitCode.CRASH_LOOP),
    (errors.OpsError, ExitCode.ERROR),
)


def exit_code_for_error(exc: errors.OpsError) -> ExitCode:
    for cls, code in ERROR_EXIT:
        if isinstance(exc, cls):
            return code
    return ExitCode.ERROR


def exit_code_for_state(state: str) -> ExitCode:
    return STATE_EXIT[state]


class App:
    """What every command shares within one CLI call: the inventory, the host, one connection."""

    def __init__(self, hosts_path: str | None, host_name: str | None, verbosity: int) -> None:
        self.hosts_path = hosts_path
        self.host_name = host_name
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
        return self.inventory.get(self.host_name)

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


def init_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--hosts", "hosts_path", metavar="PATH", help="hosts.toml to use (else $DFLASHCTL_HOSTS, ./hosts.toml, ~/.config/dflashctl/hosts.toml).")
@click.option("--host", "host_name", metavar="NAME", help="Host from hosts.toml (default: its `default`).")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for every command run).")
@click.pass_context
def cli(ctx: click.Context, hosts_path: str | None, host_name: str | None, verbose: int) -> None:
    """Run and watch DFlash drafter training on a remote GPU box, or on this machine."""
    init_logging(verbose)
    app = App(hosts_path, host_name, verbose)
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
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    sys.exit(int(rv) if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
