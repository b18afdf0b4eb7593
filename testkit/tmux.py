"""Per-test tmux servers on their own ``-L`` sockets, reaped by socket name (never by process name).

The harness drives these local servers with libtmux, the way a user's own scripts would. dflashctl's
agent does not use libtmux: it must never block (libtmux waits on tmux without a timeout) and it
needs tmux's exact stderr as evidence, so it runs tmux itself.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from pathlib import Path

import libtmux


def socket_path(name: str) -> Path:
    """Where ``tmux -L <name>`` puts its socket on this machine."""
    return Path(os.environ.get("TMUX_TMPDIR") or "/tmp") / f"tmux-{os.getuid()}" / name


class TmuxServers:
    """Hands out unique socket names (``dflash-test-<rand>``) and kills their servers at ``reap()``."""

    def __init__(self, prefix: str = "dflash-test") -> None:
        self.prefix = prefix
        self.names: list[str] = []

    def new(self) -> str:
        name = f"{self.prefix}-{secrets.token_hex(4)}"
        self.names.append(name)
        return name

    @staticmethod
    def server(name: str) -> libtmux.Server:
        """A libtmux handle on the server of socket ``name`` (it may not be running)."""
        return libtmux.Server(socket_name=name)

    def reap(self) -> None:
        # Errors suppressed: a finalizer that raises hides the real test failure.
        for name in self.names:
            with contextlib.suppress(OSError, subprocess.SubprocessError, libtmux.exc.LibTmuxException):
                server = self.server(name)
                if server.is_alive():
                    server.kill()
            with contextlib.suppress(OSError):
                socket_path(name).unlink()
        self.names.clear()
