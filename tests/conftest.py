"""Shared pytest set-up. The real-process fixtures (sshd, fake Proxmox, tmux) live in ops.testing."""

from __future__ import annotations

import os

import pytest

# Real-process fixtures: sshd, fake_pve, tmux_socket, pve_hosts, ssh_home (ops/testing/plugin.py).
pytest_plugins = ["ops.testing.plugin"]

# Tiny models on a 2-core machine: one torch thread per process keeps tests from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # ops-only environments
        pass
