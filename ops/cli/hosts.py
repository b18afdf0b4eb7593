"""The inventory's hosts: list them (hosts), check them (doctor), trust their SSH host keys (trust-host). Thin:
the work is in ops/doctor.py and ops/transport/ (host_keys, ssh)."""

from __future__ import annotations

import typing as t

import click

from ops import errors
from ops.exit_codes import ExitCode, exit_code_for_error

if t.TYPE_CHECKING:
    from ops.cli import App


@click.command("hosts")
@click.pass_obj
def hosts_cmd(app: App) -> None:
    """List the hosts of the inventory (and check it)."""
    inv = app.inventory
    click.echo(f"inventory: {inv.source}")
    for name, h in inv.hosts.items():
        mark = "*" if name == inv.default else " "
        where = "this machine" if h.is_local else f"{h.user + '@' if h.user else ''}{h.address}:{h.port or 22}"
        ct = f", ct {h.container}" if h.container is not None else ""
        click.echo(f"{mark} {name:<12} {h.transport:<5} {where}{ct}  session={h.session}  workdir={h.workdir}")


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as one JSON object.")
@click.pass_obj
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


@click.command("trust-host")
@click.option("--yes", is_flag=True, help="Record the key without asking.")
@click.option(
    "--replace", is_flag=True, help="Accept a CHANGED key: drop the old entries for this host, record the new one."
)
@click.pass_obj
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
