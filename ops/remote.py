"""The far end of a host: its transport, and its container when it has one.

``Remote.run(argv)`` runs where the agent, the runner and training live: inside the container
(``pct exec <id> -- argv``) for a Proxmox host, on the host itself for a plain ssh host, on this
machine for a local host. Everything above this layer (agent calls, deploy, supervise) talks to a
``Remote`` and never cares which of the three it is.
"""

from __future__ import annotations

import dataclasses
import typing as t

from ops.hosts import Host
from ops.proxmox import Container
from ops.transport import DEFAULT_TIMEOUT, CommandResult, LocalTransport, Stdin, Transport


@dataclasses.dataclass
class Remote:
    host: Host
    transport: Transport
    container: Container | None = None

    def run(self, argv: t.Sequence[str], *, stdin: Stdin = None, timeout: float = DEFAULT_TIMEOUT) -> CommandResult:
        """Run argv where the run lives (in the container when there is one)."""
        if self.container is not None:
            return self.container.run(argv, stdin=stdin, timeout=timeout)
        return self.transport.run(argv, stdin=stdin, timeout=timeout)

    def close(self) -> None:
        self.transport.close()


def connect(host: Host) -> Remote:
    """Open the host's transport (raises ``UnreachableError`` subclasses) and wrap its container."""
    if host.is_local:
        return Remote(host, LocalTransport())
    from ops.transport import SSHTransport  # here: paramiko is imported for ssh hosts only

    transport = SSHTransport.connect(host)
    container = (
        Container(
            transport,
            host.container,
            pct=host.pct,
            api=host.proxmox,
            label=host.label,
            config_key=f"hosts.{host.name}.proxmox",
        )
        if host.container is not None
        else None
    )
    return Remote(host, transport, container)
