"""The real-process test harness: a real sshd, a fake Proxmox host whose containers are real
pid+mount namespaces, per-test tmux servers. Used by tests/ (through the pytest plugin
``testkit.plugin``) and by the bench/ scripts.

Nothing here is imported by dflashctl itself.
"""

from __future__ import annotations

from testkit.hostsfile import CliResult, PveHosts
from testkit.machine import free_port, missing_requirement, pid_alive, retry_until
from testkit.pve import FakePve
from testkit.sshd import Sshd
from testkit.tmux import TmuxServers

__all__ = [
    "Sshd",
    "FakePve",
    "TmuxServers",
    "PveHosts",
    "CliResult",
    "retry_until",
    "free_port",
    "missing_requirement",
    "pid_alive",
]
