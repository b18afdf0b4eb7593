"""Transports: the one choke point through which every external command runs.

``Transport.run(argv, *, stdin=None, timeout) -> CommandResult``. ``LocalTransport`` runs on this
machine with subprocess; ``SSHTransport`` runs on a host over one paramiko connection.
argv is always a list; where a shell has to parse it (ssh), it is quoted once (``remote_command``).

``base`` (the contract) and ``local`` are stdlib only; ``ssh``, ``ssh_config`` and ``host_keys`` need
paramiko and are imported on first use of one of their names here, so ``import ops.transport.base``
(or ``dflashctl`` on the local transport) never loads paramiko.
"""

from __future__ import annotations

import importlib
import typing as t

from ops.transport.base import (
    CHUNK,
    DEFAULT_TIMEOUT,
    KILL_AFTER,
    TIMEOUT_EXITS,
    CommandResult,
    Stdin,
    Transport,
    iter_stdin,
)
from ops.transport.local import LocalTransport

if t.TYPE_CHECKING:
    from ops.transport.host_keys import HostKeyScan as HostKeyScan
    from ops.transport.host_keys import KnownHosts as KnownHosts
    from ops.transport.host_keys import KnownHostsEntry as KnownHostsEntry
    from ops.transport.host_keys import fingerprint as fingerprint
    from ops.transport.host_keys import parse_known_hosts_line as parse_known_hosts_line
    from ops.transport.host_keys import record_host_key as record_host_key
    from ops.transport.host_keys import revoked_error as revoked_error
    from ops.transport.ssh import SSHTransport as SSHTransport
    from ops.transport.ssh import remote_command as remote_command
    from ops.transport.ssh import scan_host_key as scan_host_key
    from ops.transport.ssh_config import SSHTarget as SSHTarget
    from ops.transport.ssh_config import expand_proxy_command as expand_proxy_command
    from ops.transport.ssh_config import resolve_target as resolve_target
    from ops.transport.ssh_config import ssh_config_word as ssh_config_word

# The names that need paramiko, and where they live.
_LAZY = {
    "HostKeyScan": "host_keys",
    "KnownHosts": "host_keys",
    "KnownHostsEntry": "host_keys",
    "fingerprint": "host_keys",
    "parse_known_hosts_line": "host_keys",
    "record_host_key": "host_keys",
    "revoked_error": "host_keys",
    "SSHTransport": "ssh",
    "remote_command": "ssh",
    "scan_host_key": "ssh",
    "SSHTarget": "ssh_config",
    "expand_proxy_command": "ssh_config",
    "resolve_target": "ssh_config",
    "ssh_config_word": "ssh_config",
}

__all__ = [
    "CHUNK",
    "DEFAULT_TIMEOUT",
    "KILL_AFTER",
    "TIMEOUT_EXITS",
    "CommandResult",
    "LocalTransport",
    "Stdin",
    "Transport",
    "iter_stdin",
    *_LAZY,
]


def __getattr__(name: str) -> t.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
