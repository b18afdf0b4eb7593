"""`dflashctl supervise install|status|stop|logs|uninstall`, from the operator's side.

The supervisor goes where it cannot fall asleep: the Proxmox host that runs the container (always on, and
able to start a stopped container). Over the host's own ssh connection (the container is not involved):
deploy's machinery puts dflashctl's code there as a release in ``[hosts.NAME.supervise] dir`` (the host's
python, stdlib only: nothing is installed, nothing is fetched), then ONE call of the host-side program
(ops/supervise/service.py) writes the container's entry as a ``transport = "local"`` host and starts the
supervisor: a systemd unit where systemd is PID 1, else a tmux session on its own socket. Every other
verb is one call of that program too. Secrets travel in the JSON on stdin, never on a command line.
(docs/design.md section 18; docs/overnight.md.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing as t

from ops import deploy, errors, far_call, wire
from ops import session as run
from ops.far import refusal, watch
from ops.hosts import SYSTEM_DIRS, Host
from ops.remote import Remote, connect_host, wrap
from ops.supervise import unit
from ops.supervise.heartbeat import holder_text
from ops.supervise.policy import Options

CALL_TIMEOUT = 60.0
INSTALL_TIMEOUT = 300.0  # stopping the old supervisor, starting the new one, its first probe


def supervised(host: Host) -> Host:
    """The host itself as deploy's target: the supervise dir and the host's python, no container."""
    if host.container is None:
        raise errors.ConfigError(
            f"hosts.{host.name}.container",
            "supervise installs the supervisor on the Proxmox host that runs a container: this host has none "
            "(run `dflashctl restart-on-crash` in a unit or tmux of that machine instead)",
        )
    place = host.supervise
    return dataclasses.replace(
        host,
        container=None,
        proxmox=None,
        workdir=place.dir,
        run_dir=f"{place.dir}/runs",
        python=place.python,
        keep_releases=2,
    )


class HostSide:
    """One connection to the Proxmox host; its container behind the same connection when asked."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.target = supervised(host)
        self._transport: t.Any = None

    def remote(self) -> Remote:
        """The host itself (commands run on it, not in the container)."""
        if self._transport is None:
            self._transport = connect_host(self.host)
        return Remote(self.target, self._transport)

    def container(self) -> Remote:
        return wrap(self.host, self.remote().transport)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def call(self, verb: str, req: t.Mapping[str, t.Any], *, timeout: float = CALL_TIMEOUT) -> dict[str, t.Any]:
        """One verb of the host-side program; its refusal is one ``SuperviseError`` line."""
        place = self.host.supervise
        argv = [place.python, "-I", "-c", unit.BOOT, f"{place.dir}/current", verb]
        body = {"dir": place.dir, **req}
        reply = far_call.call(self.remote(), argv, stdin=json.dumps(body).encode(), timeout=timeout)
        res = reply.result
        last = self._ran(reply, f"supervise {verb}", timeout)
        if reply.answer is None:
            if "No module named 'ops" in last:
                raise errors.NotInstalled(
                    f"{self.host.name}: no supervisor is installed in {place.dir} (run `dflashctl supervise install`)"
                )
            raise errors.SuperviseError(f"{self.host.name}: supervise {verb} failed: {last or f'exit {res.exit_code}'}")
        if not reply.answer.get("ok"):
            kind, message = reply.answer.get("error"), reply.answer.get("message")
            if kind == refusal.NOT_INSTALLED:
                raise errors.NotInstalled(f"{self.host.name}: {message}")
            if kind == refusal.BAD_CONFIG:
                raise errors.ConfigError(str(reply.answer.get("key")), f"{message} (on {self.host.name})")
            if kind in (refusal.LOCKED, refusal.REFUSED, refusal.TAKEN):
                raise errors.SupervisorLocked(f"{self.host.name}: {message}")
            raise errors.SuperviseError(f"{self.host.name}: {message}")
        return reply.answer

    def _ran(self, reply: far_call.Reply, doing: str, timeout: float) -> str:
        """The last line of stderr, once the host's python could be run and answered in time."""
        res, python = reply.result, self.host.supervise.python
        last = (res.err.strip().splitlines() or [""])[-1]
        if res.timed_out:
            raise errors.SuperviseError(f"{self.host.name}: {doing} did not answer within {timeout:g}s")
        if far_call.cannot_exec(res):
            raise errors.SuperviseError(
                f"{self.host.name}: cannot run {python!r} there ({last or 'not found'}); "
                f"set hosts.{self.host.name}.supervise.python"
            )
        return last

    def check_python(self) -> None:
        """The host's python can run the supervisor (deploy.MIN_PYTHON): asked before anything is sent, so an
        old Proxmox host gets one line naming supervise.python (deploy's own check names the container's)."""
        python = self.host.supervise.python
        argv = [python, "-I", "-c", unit.PYTHON_CHECK]
        reply = far_call.call(self.remote(), argv, timeout=CALL_TIMEOUT)
        last = self._ran(reply, f"{python} (its version)", CALL_TIMEOUT)
        version = (reply.answer or {}).get("version")
        if not (isinstance(version, list) and version and all(isinstance(v, int) for v in version)):
            raise errors.SuperviseError(
                f"{self.host.name}: {python!r} there did not say its version: {last or f'exit {reply.result.exit_code}'}"
            )
        if tuple(version) < deploy.MIN_PYTHON:
            need = ".".join(map(str, deploy.MIN_PYTHON))
            raise errors.SuperviseError(
                f"{self.host.name}: {python} on the host is Python {'.'.join(map(str, version))}: the supervisor "
                f"needs Python {need} or newer (Proxmox VE 8 has it); set hosts.{self.host.name}.supervise.python"
            )


def _claim(side: HostSide) -> None:
    """The supervise dir is dflashctl's (its marker), or new or empty and made so; else nothing is sent."""
    place = side.host.supervise
    # the host's own folders travel with it: what the dir really is (links followed) is known there only
    system = json.dumps(sorted(SYSTEM_DIRS))
    argv = [place.python, "-I", "-c", unit.CLAIM, place.dir, unit.MARKER, system, *unit.OWN_NAMES]
    reply = far_call.call(side.remote(), argv, timeout=CALL_TIMEOUT)
    last = side._ran(reply, f"checking {place.dir}", CALL_TIMEOUT)
    answer = reply.answer or {}
    if answer.get("ok"):
        return
    why = answer.get("why") or last or f"exit {reply.result.exit_code}"
    raise errors.ConfigError(
        f"hosts.{side.host.name}.supervise.dir",
        f"{place.dir} on {side.host.name} {why}: supervise installs only into a new or empty folder "
        f"(or one it installed into: {unit.MARKER}); give a folder of its own, e.g. {place.dir}/dflashctl",
    )


def install(
    host: Host,
    session: str | None,
    opts: Options,
    *,
    notify: t.Sequence[str] = (),
    echo: t.Callable[[str], None] = print,
) -> dict[str, t.Any]:
    """Deploy dflashctl to the host, refuse over another live supervisor, install and start this one."""
    name = run.session_name(host, session)
    side = HostSide(host)
    try:
        side.check_python()
        _claim(side)
        outcome = deploy.deploy(side.remote(), side.target, modules=(), echo=echo)
        echo(outcome.summary)
        _refuse_foreign(side, name)
        entry = {**unit.host_entry(host), "session": name}
        proxmox = unit.proxmox_entry(host)
        env: dict[str, str] = {}
        if host.proxmox is not None:
            token = os.environ.get(host.proxmox.token_value_env)
            if token:
                env[host.proxmox.token_value_env] = token
            else:
                echo(
                    f"note: ${host.proxmox.token_value_env} is not set here: the supervisor on {host.name} "
                    "uses pct for the container's status and start (local there; no API token needed)"
                )
                proxmox = None
        req = {
            "session": name,
            "by": host.name,
            "mode": host.supervise.mode,
            "tmux_socket": host.supervise.tmux_socket,
            "entry": entry,
            "proxmox": proxmox,
            "env": env,
            "notify": list(notify),
            "options": {k: v for k, v in dataclasses.asdict(opts).items() if k not in unit.NOT_FORWARDED},
        }
        return side.call("install", req, timeout=INSTALL_TIMEOUT)
    finally:
        side.close()


def _refuse_foreign(side: HostSide, session: str) -> None:
    """Another live supervisor (restart-on-crash on a laptop, say) holds the run's lease: refuse in one
    line before anything starts on the host. The installed one itself (same id) is replaced, not refused."""
    try:
        mine = side.call("status", {"session": session}).get("service") or {}
    except errors.NotInstalled:
        mine = {}
    agent = wire.parse_facts(run.gather(side.host, session, side.container)).agent
    rec, now = (agent.supervisor, agent.now) if agent is not None else (None, None)
    if rec is not None and now is not None and rec.id != mine.get("id"):
        if rec.live(now):
            raise errors.SupervisorLocked(
                f"another supervisor watches {side.host.name}/{session}: {holder_text(rec.named(), now)}; stop it first "
                f"(Ctrl-C or kill <pid>), or wait until it is stale ({watch.STALE_AFTER} of its intervals)"
            )


def call(host: Host, verb: str, session: str | None, **extra: t.Any) -> dict[str, t.Any]:
    """``status``, ``stop``, ``uninstall``, ``logs``: one call each."""
    side = HostSide(host)
    try:
        timeout = INSTALL_TIMEOUT if verb in ("stop", "uninstall") else CALL_TIMEOUT
        return side.call(verb, {"session": run.session_name(host, session), **extra}, timeout=timeout)
    finally:
        side.close()


# --------------------------------------------------------------------------------------------
# What `supervise status` prints


def status_lines(host: str, session: str, out: wire.SupervisorStatus) -> list[str]:
    if not out.installed:
        return [
            f"no supervisor is installed for {host}/{session} on {host}" + (f" ({out.message})" if out.message else "")
        ]
    mode, facts = out.mode, out.unit
    if out.running:
        head = f"supervisor of {host}/{session} on {host}: running ({mode}, pid {out.pid}, since {out.since})"
    else:
        head = f"supervisor of {host}/{session} on {host}: NOT running ({mode})"
    lines = [head]
    if mode == "systemd" and facts:
        lines.append(
            f"  unit:        {unit.unit_name(session)} {facts.get('ActiveState')}/{facts.get('SubState')}, "
            f"{facts.get('UnitFileState')}, restarted {facts.get('NRestarts', '?')} time(s) by systemd"
        )
    elif mode == "tmux":
        lines.append(f"  tmux:        session {session} on socket {out.tmux_socket}: {facts.get('tmux_session')}")
    if out.options:
        lines.append(f"  policy:      {' '.join(unit.options_argv(Options(**out.options)))}")
    lines.append(f"  installed:   {out.installed_at} (release {out.release})")
    probe = out.last_probe
    if probe:
        lines.append(f"  last probe:  {probe.at}: {probe.headline} -> {probe.decision} ({out.probes} probes)")
    else:
        lines.append("  last probe:  none yet")
    act = out.last_action
    if act:
        nxt = f", attempt {act.next_attempt} started" if act.next_attempt is not None else ""
        att = f", attempt {act.attempt}" if act.attempt is not None else ""
        lines.append(
            f"  last action: {act.at}: {act.action} ({act.outcome}) after {act.state}"
            f"{' (' + str(act.cause) + ')' if act.cause else ''}{att}{nxt}"
        )
    else:
        lines.append("  last action: none")
    if out.error:
        lines.append(f"  ended on:    {out.error}")
    lines.append(f"  incidents:   {out.incidents}" + (" (newest last)" if out.newest else ""))
    for i in out.newest:
        nxt = f" -> attempt {i.next_attempt}" if i.next_attempt is not None else ""
        cause = f" ({i.cause})" if i.cause else ""
        att = f"attempt {i.attempt} " if i.attempt is not None else ""
        lines.append(f"    {i.time}  {att}{i.state}{cause}: {i.action} {i.outcome}{nxt}")
    lines.append(f"  log:         {out.log} (dflashctl supervise logs)")
    return lines + [f"  unreadable:  {p}" for p in out.problems]


def installed_lines(host: str, session: str, out: wire.SupervisorInstalled) -> list[str]:
    """What `supervise install` prints."""
    where = f"systemd unit {out.unit}" if out.mode == "systemd" else f"tmux session on socket {out.tmux_socket}"
    verb = "updated" if out.updated else "installed"
    lines = [f"{verb} the supervisor of {host}/{session} on {host}: {where}, pid {out.pid}"]
    if out.replaced_running:
        lines.append(f"  replaced:    the supervisor that ran before (pid {out.replaced_pid})")
    lines.append(f"  command:     {' '.join(out.command)}")
    first = out.first_probe
    if first:
        lines.append(f"  first probe: {first.headline} -> {first.decision}")
    else:
        lines.append("  first probe: not yet (see `dflashctl supervise status`)")
    lines.append(f"  log:         {out.log} (dflashctl supervise logs)")
    return lines + [f"  unreadable:  {p}" for p in out.problems]


def uninstalled_lines(host: str, session: str, out: wire.SupervisorStopped) -> list[str]:
    """What `supervise uninstall` prints."""
    was = f" (it ran as pid {out.pid})" if out.was_running else ""
    lines = [f"uninstalled the supervisor of {host}/{session}{was}; the run is left as it is"]
    lines += [f"  removed {path}" for path in out.removed]
    lines.append(f"  kept    {out.kept} (incidents, memory, supervisor.log)")
    return lines + [f"  unreadable:  {p}" for p in out.problems]
