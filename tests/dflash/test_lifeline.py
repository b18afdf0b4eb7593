"""A torchrun worker dies with its agent: a real parent SIGKILLed, its worker (in a session of its own, as
torchrun starts it) must go too; without torchrun's environment nothing is set."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from testkit import pid_alive, retry_until

# The "agent": starts a worker the way torchrun does (a session of its own), prints its pid, then waits.
AGENT = textwrap.dedent(
    """
    import subprocess, sys
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
    print(worker.pid, flush=True)
    worker.wait()
    """
)
WORKER = textwrap.dedent(
    """
    import time
    from dflash.train.lifeline import die_with_agent
    print("set" if die_with_agent() else "not set", flush=True)
    time.sleep(600)
    """
)


def _agent(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], int, Path]:
    out = tmp_path / "worker.out"
    with open(out, "w") as f:
        agent = subprocess.Popen(
            [sys.executable, "-c", AGENT, WORKER], stdout=subprocess.PIPE, stderr=f, text=True, env=env
        )
    assert agent.stdout is not None
    return agent, int(agent.stdout.readline()), out


def test_a_worker_under_torchrun_dies_with_its_agent(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    agent, worker, _ = _agent(tmp_path, env)
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "set"
        os.kill(agent.pid, signal.SIGKILL)  # as a stop's last step or the OOM killer would
        agent.wait(timeout=10)
        retry_until(lambda: not pid_alive(worker), 10)
    finally:
        for pid in (agent.pid, worker):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_without_torchrun_nothing_is_set(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    agent, worker, _ = _agent(tmp_path, env)
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "not set"
    finally:
        for pid in (agent.pid, worker):
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
