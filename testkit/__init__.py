"""The real-process test harness: a real sshd, a fake Proxmox host whose containers are real
pid+mount namespaces, per-test tmux servers. Used by tests/ (through the pytest plugin
``testkit.plugin``) and by the bench/ scripts.

Nothing here is imported by dflashctl itself.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
import typing as t
from pathlib import Path

T = t.TypeVar("T")

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


def retry_until(fn: t.Callable[[], T], seconds: float = 10.0, *, interval: float = 0.05) -> T:
    """Call ``fn`` until it returns something truthy and return that; AssertionError on timeout.

    The error shows the last value, so a failing wait says what it saw instead of only "timed out".
    """
    deadline = time.monotonic() + seconds
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"retry_until: {getattr(fn, '__name__', fn)!s} still falsy after {seconds:g}s; last value: {value!r}"
            )
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (sshd cannot take port 0), below the
    ephemeral range: a client that retries connecting to a port in that range before its server listens can
    be given that very port as its own source port and connect to ITSELF (TCP simultaneous open); it then
    waits for its own answers forever (a torchrun node did, in CI: both nodes of a group "running", silent)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port below the ephemeral range ({low})")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


_NS_OK: bool | None = None


def missing_requirement(what: str) -> str | None:
    """Why the harness part ``what`` ("sshd", "tmux", "namespaces", "fish", "csh") cannot run here, or None."""
    global _NS_OK
    if what == "sshd":
        if not os.access("/usr/sbin/sshd", os.X_OK):
            return "/usr/sbin/sshd is not installed (apt-get install openssh-server)"
        if shutil.which("ssh-keygen") is None:
            return "ssh-keygen is not installed (apt-get install openssh-client)"
        return None
    if what == "tmux":
        return None if shutil.which("tmux") else "tmux is not installed (apt-get install tmux)"
    if what in ("fish", "csh"):  # login shells that are not sh (quoting tests)
        return None if shutil.which(what) else f"{what} is not installed (apt-get install {what})"
    if what == "namespaces":
        for tool in ("unshare", "nsenter", "mount"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (apt-get install util-linux)"
        if _NS_OK is None:
            probe = subprocess.run(
                ["unshare", "--pid", "--mount", "--fork", "--mount-proc", "--propagation", "private", "true"],
                capture_output=True,
                timeout=30,
            )
            _NS_OK = probe.returncode == 0
            if not _NS_OK:
                return f"pid+mount namespaces are not permitted here: {probe.stderr.decode(errors='replace').strip()}"
        return None if _NS_OK else "pid+mount namespaces are not permitted here (unshare failed)"
    raise ValueError(f"unknown requirement {what!r}")


# Imported last: these modules use the helpers above.
from testkit.hostsfile import CliResult, PveHosts  # noqa: E402
from testkit.pve import FakePve  # noqa: E402
from testkit.sshd import Sshd  # noqa: E402
from testkit.tmux import TmuxServers  # noqa: E402
