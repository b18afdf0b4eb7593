"""Shared pytest set-up. The real-process fixtures (sshd, fake Proxmox, tmux) live in testkit."""

from __future__ import annotations

import logging
import os
import typing as t

import pytest

# Real-process fixtures: sshd, fake_pve, tmux_socket, pve_hosts, ssh_home (testkit/plugin.py).
pytest_plugins = ["testkit.plugin"]

# Tiny models on a 2-core machine: one torch thread per process keeps tests from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # ops-only environments
        pass


@pytest.fixture(autouse=True)
def _root_logging() -> t.Iterator[None]:
    """Tests that call ``dflash.__main__.main`` in-process install a stderr handler bound to pytest's
    captured stream, which pytest closes after the test: put the root logger back so later tests' log
    lines do not end in "Logging error ... I/O operation on closed file"."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
