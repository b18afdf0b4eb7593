"""What the harness asks of this machine: a free port, whether a pid lives, whether a harness part can run
here, and the one way a test waits (``retry_until``, never a bare sleep)."""

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
    first, last = _port_slice(max(1024, _ephemeral_low() - 12000), _ephemeral_low())
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(first, last)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{first}, {last}) (below the ephemeral range)")


def _port_slice(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's own share of [low, high): a port one worker's sshd gives up while it is
    "down for a while" is never the next port another worker's server takes. DFLASH_TEST_PORT_SHARE=I/N
    first gives this pytest run the I-th of N shares (scripts/test runs the floor run beside the main run)."""
    share = os.environ.get("DFLASH_TEST_PORT_SHARE", "")
    if share:
        try:
            i, n = (int(x) for x in share.split("/"))
        except ValueError:
            i, n = 0, 1
        if n > 1 and 0 <= i < n:
            size = (high - low) // n
            low, high = low + i * size, low + (i + 1) * size
    try:
        index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    except ValueError:
        return low, high
    if count <= 1 or not 0 <= index < count:
        return low, high
    size = (high - low) // count
    return low + index * size, low + (index + 1) * size


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
