"""A Proxmox LXC container reached through ``pct`` on its host (and, optionally, the PVE API).

``Container.run(argv)`` is ``<pct...> exec <vmid> -- timeout -k 5 <N> argv`` through the host's
transport: the argv after ``--`` is never re-parsed by pct or lxc-attach, and the inner ``timeout``
kills the command inside the container when it outlives its time.

pct's texts (pve-container ``src/PVE/CLI/pct.pm``) decide, not its exit codes (a perl ``die`` exits
255, or errno when one is set):
  stopped: ``container '<id>' not running!`` (exec)
  missing: ``Configuration file 'nodes/<node>/lxc/<id>.conf' does not exist``
Files reach the container as a tar stream on ``run``'s stdin (ops/deploy.py), verified there by sha256.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import re
import shlex
import time
import typing as t

from ops.errors import ConfigError, ConnectionRefused, ContainerDown, RemoteCommandError, UnreachableError
from ops.transport.base import DEFAULT_TIMEOUT, KILL_AFTER, TIMEOUT_EXITS, CommandResult, Stdin, Transport, timeout_arg

if t.TYPE_CHECKING:
    from ops.hosts import ProxmoxApi

logger = logging.getLogger(__name__)

# Status values a container can have (docs/design.md section 11: container.status).
RUNNING, STOPPED, MISSING = "running", "stopped", "missing"


def _missing_re(vmid: int) -> re.Pattern[str]:
    return re.compile(rf"^Configuration file 'nodes/[^/']+/lxc/{vmid}\.conf' does not exist", re.M)


def _stopped_re(vmid: int) -> re.Pattern[str]:
    # The older (June 2021) text had an "Error: " prefix.
    return re.compile(rf"^(Error: )?container '{vmid}' not running!$", re.M)


class Container:
    """LXC container ``vmid`` on the host behind ``transport``."""

    def __init__(
        self,
        transport: Transport,
        vmid: int,
        *,
        pct: t.Sequence[str] = ("pct",),
        api: ProxmoxApi | None = None,
        label: str | None = None,
        config_key: str = "proxmox",
    ) -> None:
        self.transport = transport
        self.vmid = int(vmid)
        self.pct = tuple(pct)
        self.api = api
        self.label = label or f"ct {vmid}"
        self.config_key = config_key  # where hosts.toml holds `api`, for error messages
        self._api_client: t.Any = None

    # -- commands inside ----------------------------------------------------------------------

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        """Run argv inside the container; ``ContainerDown`` when it is stopped or missing."""
        argv = tuple(str(a) for a in argv)
        inner = ["timeout", "-k", str(KILL_AFTER), timeout_arg(timeout), *argv]
        started = time.monotonic()
        # The host-side deadline is later than the inner one, so the inner timeout fires first and
        # kills the command where it runs.
        res = self.transport.run(
            self._pct("exec", str(self.vmid), "--", *inner), stdin=stdin, timeout=timeout + KILL_AFTER + 5
        )
        self._raise_if_blind(res)
        self._raise_if_down(res)
        timed_out = res.timed_out or (res.exit_code in TIMEOUT_EXITS and time.monotonic() - started >= timeout)
        return dataclasses.replace(res, argv=argv, timed_out=timed_out, timeout=timeout)

    # -- state ----------------------------------------------------------------------------------

    def status(self) -> str:
        """``"running"``, ``"stopped"`` or ``"missing"``. Down is an answer, never an error; an
        unreachable host or a broken pct still raises."""
        if self.api is not None:
            return self._api_status()
        res = self.transport.run(self._pct("status", str(self.vmid)), timeout=30)
        if _missing_re(self.vmid).search(res.err):
            return MISSING
        m = re.search(r"^status: (\w+)", res.out, re.M)
        if res.exit_code == 0 and m:
            return RUNNING if m.group(1) == RUNNING else STOPPED
        raise RemoteCommandError(
            res.argv, res.exit_code, res.err or res.out, what=f"{shlex.join(self.pct)} status {self.vmid}"
        )

    def status_facts(self) -> dict[str, str]:
        """``pct status <id> --verbose`` as a dict (``pid``, ``uptime``, ...); empty when missing."""
        res = self.transport.run(self._pct("status", str(self.vmid), "--verbose"), timeout=30)
        if _missing_re(self.vmid).search(res.err):
            return {}
        res.check(f"{shlex.join(self.pct)} status {self.vmid} --verbose")
        facts = {}
        for line in res.out.splitlines():
            key, sep, value = line.partition(": ")
            if sep:
                facts[key.strip()] = value.strip()
        return facts

    def booted_at(self) -> dt.datetime | None:
        """When the container last started (from its uptime), None when it is not running."""
        if self.api is not None:
            facts: dict[str, t.Any] = self._api_current()
        else:
            facts = self.status_facts()
        if facts.get("status") != RUNNING:
            return None
        try:
            uptime = int(facts.get("uptime", 0))
        except (TypeError, ValueError):
            return None
        now = dt.datetime.now(dt.UTC).replace(microsecond=0)
        return now - dt.timedelta(seconds=uptime)

    def start(self, timeout: float = 300) -> None:
        """Start the container; already running is fine."""
        if self.api is not None:
            self._api_start(timeout)
            return
        res = self.transport.run(self._pct("start", str(self.vmid)), timeout=timeout)
        if res.exit_code == 0 or re.search(rf"CT {self.vmid} already running", res.err):
            return
        self._raise_if_down(res)
        res.check(f"{shlex.join(self.pct)} start {self.vmid}")

    # -- helpers --------------------------------------------------------------------------------

    def _pct(self, *args: str) -> list[str]:
        return [*self.pct, *args]

    def _raise_if_blind(self, res: CommandResult) -> None:
        """``pct`` itself cannot be run (missing, not executable: sh's 127/126 naming it, not the inner
        command's): nothing inside can be seen, which is no answer about the run (never not-started)."""
        if res.exit_code not in (126, 127):
            return
        program = re.escape(self.pct[0])
        # sh's "sh: 1: PCT: not found", this machine's "PCT: No such file or directory", and the ssh side's
        # `timeout` around it: "timeout: failed to run command 'PCT': ..." (never the inner command's name)
        named = re.compile(
            rf"(?:^|: ){program}: (?:.*: )?(?:not found|No such file or directory|Permission denied)"
            rf"|failed to run command [‘'`]{program}['’]"
        )
        for line in res.err.strip().splitlines()[-3:]:
            if named.search(line):
                raise UnreachableError(self.label, f"cannot run {shlex.join(self.pct)}: {line.strip()}")

    def _raise_if_down(self, res: CommandResult) -> None:
        if res.exit_code == 0:
            return
        if _missing_re(self.vmid).search(res.err):
            raise ContainerDown(
                self.vmid,
                MISSING,
                f"container {self.vmid} does not exist on this host ({res.err.strip().splitlines()[0]})",
            )
        if _stopped_re(self.vmid).search(res.err):
            raise ContainerDown(
                self.vmid, STOPPED, f"container {self.vmid} is stopped (pct: {res.err.strip().splitlines()[-1]})"
            )

    # -- the optional PVE API path (proxmoxer, https + API token) -------------------------------

    def _api(self) -> t.Any:
        if self._api_client is None:
            assert self.api is not None
            token = os.environ.get(self.api.token_value_env)
            if not token:
                raise ConfigError(
                    f"{self.config_key}.token_value_env",
                    f"environment variable {self.api.token_value_env} is not set (it holds the API token's secret)",
                )
            from proxmoxer import ProxmoxAPI  # here: only hosts with [hosts.X.proxmox] load proxmoxer (and requests)

            self._api_client = ProxmoxAPI(
                self.api.api_host,
                port=self.api.port,
                user=self.api.user,
                token_name=self.api.token_name,
                token_value=token,
                verify_ssl=self.api.verify_ssl,
                backend="https",
                timeout=30,
            )
        return self._api_client

    def _api_current(self) -> dict[str, t.Any]:
        from proxmoxer.core import (
            ResourceException,  # here: only hosts with [hosts.X.proxmox] load proxmoxer (and requests)
        )

        assert self.api is not None
        try:
            return dict(self._api().nodes(self.api.node).lxc(self.vmid).status.current.get())
        except ResourceException as e:
            if "does not exist" in str(e):
                return {"status": MISSING}
            raise RemoteCommandError(
                ["pve-api", "status/current"],
                getattr(e, "status_code", None),
                str(e),
                what=f"PVE API status of {self.label}",
            ) from e
        except OSError as e:  # requests' connection errors are OSErrors
            raise ConnectionRefused(
                self.label, f"PVE API at {self.api.api_host}:{self.api.port} unreachable: {e}"
            ) from e

    def _api_status(self) -> str:
        status = self._api_current().get("status")
        return status if status in (RUNNING, MISSING) else STOPPED

    def _api_start(self, timeout: float) -> None:
        from proxmoxer.core import (
            ResourceException,  # here: only hosts with [hosts.X.proxmox] load proxmoxer (and requests)
        )
        from proxmoxer.tools import Tasks

        assert self.api is not None
        if self._api_status() == RUNNING:
            return
        try:
            upid = self._api().nodes(self.api.node).lxc(self.vmid).status.start.post()
        except ResourceException as e:
            if "already running" in str(e):
                return
            raise RemoteCommandError(
                ["pve-api", "status/start"],
                getattr(e, "status_code", None),
                str(e),
                what=f"PVE API start of {self.label}",
            ) from e
        done = Tasks.blocking_status(self._api(), upid, timeout=int(timeout), polling_interval=1)
        if not done or done.get("exitstatus") != "OK":
            why = (done or {}).get("exitstatus", f"no result within {timeout:g}s")
            raise RemoteCommandError(["pve-api", "status/start"], None, str(why), what=f"PVE API start of {self.label}")
