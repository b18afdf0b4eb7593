"""The operator's install: `pip install dflash` with no extra (.venv-base: no torch, no transformers) runs every
dflashctl command against a real sshd and the fake Proxmox host, and every `dflash` command there says in one
line that the training core is the [train] extra.

The laptop's dflashctl is .venv-base's console script (the project installed from a copy, as pipx would); the
container's python is this one (it has torch: the run lives there). Each command runs for real, in the order an
operator would use them (attach prints the tmux command it would run: --exec needs a terminal).
"""

from __future__ import annotations

import os
import subprocess
import sys
import typing as t
from pathlib import Path

import click
import pytest

from ops.cli import cli
from testkit import PveHosts, TmuxServers, missing_requirement, retry_until
from testkit.runkit import bench_box, reap_runs, train_command

# (command, its arguments, the exit code, a text its stdout or stderr holds), in an operator's order
PLAN: list[tuple[str, tuple[str, ...], int, str]] = [
    ("hosts", (), 0, "pve"),
    ("trust-host", ("--yes",), 0, "already trusted"),
    ("doctor", (), 0, "ok"),
    ("deploy", (), 0, "current ->"),
    ("start", (), 0, "started attempt 1"),
    ("status", ("--json",), 0, '"state": "running"'),
    ("tail", ("-n", "5"), 0, "step"),
    ("attach", (), 0, "tmux"),
    ("history", (), 0, "1 attempt(s)"),
    ("plot", ("--out", "dash.png"), 1, "pip install 'dflash[plot]'"),
    ("pull", ("pulled",), 1, "no checkpoint"),  # the fake trainer writes none: the one line that says so
    ("restart-on-crash", ("--once",), 0, "watching (once): running"),
    ("gpus", (), 0, "no GPU excluded"),
    # the supervisor on "the Proxmox host" (this machine, over sshd): deployed from the base install's own files
    ("supervise install", ("--interval", "1"), 0, "installed the supervisor of pve/dflash"),
    ("supervise status", (), 0, "running (tmux"),
    ("supervise logs", (), 0, "watching (every 1s)"),
    ("supervise gpus", (), 0, "no GPU excluded"),
    ("supervise stop", (), 0, "stopped the supervisor"),
    ("supervise uninstall", (), 0, "uninstalled the supervisor"),
    ("stop", ("--grace", "5"), 0, "stopped attempt 1"),
]


def commands(group: click.Group, prefix: str = "") -> list[str]:
    """Every command of the click group, a subgroup's as "group sub"."""
    out = []
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # dflashctl's commands are imported on first use
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            out.extend(commands(cmd, f"{prefix}{name} "))
        else:
            out.append(f"{prefix}{name}")
    return out


def test_the_plan_runs_every_dflashctl_command() -> None:
    assert sorted(c for c, *_ in PLAN) == sorted(commands(cli))


class Laptop:
    """.venv-base's dflashctl with the box's hosts.toml and HOME."""

    def __init__(self, python: str, hosts: PveHosts) -> None:
        self.dflashctl = str(Path(python).parent / "dflashctl")
        self.hosts = hosts

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.dflashctl, "--hosts", str(self.hosts.path), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.hosts.env(),
            cwd=self.hosts.root,
        )


@pytest.fixture(scope="module")
def laptop(base_python: str) -> t.Iterator[Laptop]:
    for what in ("sshd", "namespaces", "tmux"):
        reason = missing_requirement(what)
        if reason is not None:
            if os.environ.get("CI", "").lower() == "true":
                pytest.fail(f"CI=true and {reason}", pytrace=False)
            pytest.skip(reason)
    tmux = TmuxServers()
    try:
        with bench_box(tmux.new()) as hosts:
            hosts.write(
                command=train_command("--steps", "100000", "--interval", "0.2"),
                # restart-on-crash's memory and the host's supervisor (in real life ~/.local/state, /var/lib/dflashctl)
                supervise={
                    "dir": str(hosts.root / "host-dflashctl"),
                    "python": sys.executable,
                    "mode": "tmux",
                    "tmux_socket": tmux.new(),
                },
            )
            try:
                yield Laptop(base_python, hosts)
            finally:
                reap_runs(hosts.run_dir)
    finally:
        tmux.reap()


def test_every_dflashctl_command_runs_from_the_base_install(laptop: Laptop) -> None:
    """The plan in its order, in one test: each command builds on the one before (deploy, then start...),
    so under xdist they cannot be tests of their own that a worker might run apart."""
    for command, args, code, text in PLAN:
        argv = [*command.split(), *args]
        if command in ("restart-on-crash", "gpus"):  # the laptop supervisor's memory, where the test keeps it
            argv += ["--state-dir", str(laptop.hosts.root / "state")]
        p = laptop.run(*argv)
        if command == "tail":  # the first step lines, once the run has printed them
            retry_until(lambda a=argv: "step" in laptop.run(*a).stdout, 60)
            p = laptop.run(*argv)
        out = p.stdout + p.stderr
        assert "Traceback" not in out and "torch" not in p.stderr, (command, out)
        assert p.returncode == code, (command, out)
        assert text in out, (command, out)


def test_the_base_install_has_no_torch_and_dflash_names_the_extra(base_python: str, tmp_path: Path) -> None:
    probe = subprocess.run([base_python, "-c", "import torch"], capture_output=True, text=True, timeout=60)
    assert probe.returncode == 1 and "No module named 'torch'" in probe.stderr, probe.stderr
    dflash = str(Path(base_python).parent / "dflash")
    hint = "dflash: the training core is not installed (no torch, transformers, safetensors, accelerate): pip install 'dflash[train]'"
    for argv in ([dflash, "train", "--config", "run.toml"], [dflash, "--help"], [base_python, "-m", "dflash", "eval"]):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert (p.returncode, p.stdout, p.stderr) == (1, "", hint + "\n"), argv
