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
    """Open the host's transport (raises ``UnreachableError`` subclasses) and wrap its container. A local
    host with a container is dflashctl on the Proxmox host itself: ``pct exec`` straight, no ssh."""
    return wrap(host, connect_host(host))


def connect_host(host: Host) -> Transport:
    """The transport to the machine itself (the Proxmox host, not its container): this machine for a
    local host, else one ssh connection: the host's connection keeper's when it has one (``keep_connection``)."""
    if host.is_local:
        return LocalTransport()
    if host.keep_connection > 0:
        from ops.transport import keeper  # stdlib only: paramiko waits until a direct connection is needed

        return keeper.connect(host)
    from ops.transport import SSHTransport  # here: paramiko is imported for ssh hosts only

    return SSHTransport.connect(host)


def wrap(host: Host, transport: Transport) -> Remote:
    """``transport`` with the host's container (when it has one) in front."""
    return Remote(host, transport, container_of(host, transport))


def container_of(host: Host, transport: Transport) -> Container | None:
    """The host's container behind ``transport``, or None for a host without one."""
    if host.container is None:
        return None
    return Container(
        transport,
        host.container,
        pct=host.pct,
        api=host.proxmox,
        label=host.label,
        config_key=f"hosts.{host.name}.proxmox",
    )
