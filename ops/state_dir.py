"""dflashctl's own state dir on the machine it runs on (the operator's, or the Proxmox host's for the installed
supervisor): where it is and how it is kept private. Stdlib only: the host side loads it."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/dflashctl``, else ``~/.local/state/dflashctl``."""
    xdg = os.environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "dflashctl"
    return Path.home() / ".local" / "state" / "dflashctl"


def private_dir(path: Path) -> Path:
    """``path`` as a folder only we can read (0700): incidents hold log tails, the lock the
    --on-event command line. An existing folder of ours that is open to others is closed."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        path.chmod(0o700)
    return path


__all__ = ["default_state_dir", "private_dir"]
