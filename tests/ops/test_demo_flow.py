"""The demo's flow, shortened, with the REAL parts: make-tiny's target and raw chat
corpus, `dflash regen` (the target rewrites every assistant turn) and `dflash prepare-data` (the token store
the run trains on), `dflashctl deploy` of this checkout to a local host, `start` in a real tmux server (this test's own
socket), `status`, `tail`, `restart-on-crash`, the real `dflash train` (2 target + 2 drafter threads)
and `dflash eval`. A crash is injected with the training core's DFLASH_FAULT hook.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import torch

from dflash.data.tiny import TinySpec, make_tiny
from testkit import CliResult, forkserver, retry_until
from testkit.hostsfile import dump_hosts
from testkit.runkit import REPO, reap_runs

pytestmark = pytest.mark.timeout(240)

SMALL = TinySpec(
    target_steps=40, train_samples=8, conversations=24, eval_prompts=3, response_len=20, gen_batch=8, threads=1
)


def dflash(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`python -m dflash ARGS`, a fork of this worker's dflash fork server: torch and transformers imported once
    per worker (~7 s of CPU each fresh interpreter paid), not once per command. The environment is the
    server's (tests/conftest.py set OMP_NUM_THREADS=1 before it started), so the command forks."""
    p = forkserver.shared("dflash").run(args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-tiny, then the demo's data steps as scripts/demo runs them: regen, prepare-data -> tiny/store.

    Built once per test run (~18 s of CPU: a target trained, two `dflash` commands), not once per module
    that uses it (tests/ops/test_plot.py does too): under pytest-xdist the first worker to ask builds it in
    the run's shared temp dir while the others wait on the lock; each demo copies it, nothing writes it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' common dir
    out, done = shared / "demo-tiny" / "tiny", shared / "demo-tiny" / "built"
    with (shared / "demo-tiny.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a build cut short by another worker's crash
            build_tiny(out)
            done.touch()
    return out


def build_tiny(out: Path) -> None:
    make_tiny(out, SMALL)
    p = dflash(
        "regen",
        "--config",
        "configs/tiny-cpu.toml",
        "--set",
        f"target.path={out / 'target'}",
        "--in",
        str(out / "chat.jsonl"),
        "--out",
        str(out / "regen.jsonl"),
        "--max-new-tokens",
        "24",
    )
    assert f"regen: {SMALL.conversations} records -> {SMALL.conversations} written" in p.stdout, p.stdout
    p = dflash(
        "prepare-data",
        "--tokenizer",
        str(out / "target"),
        "--max-len",
        "256",
        "--in",
        str(out / "regen.jsonl"),
        "--out",
        str(out / "store"),
    )
    assert re.search(
        rf"^prepare-data: {SMALL.conversations} records -> [1-9]\d* sequences, .* wrote ", p.stdout, re.M
    ), p.stdout


class LocalDemo:
    """A local host like the shipped one (hosts.toml `local`), in a temp dir, on this test's tmux socket."""

    def __init__(self, root: Path, socket: str, tiny: Path) -> None:
        self.root = root
        self.workdir = root / "wd"
        self.run_dir = self.workdir / "runs"
        self.session_dir = self.run_dir / "dflash"
        self.hosts = root / "hosts.toml"
        self.socket = socket
        self.workdir.mkdir(parents=True)
        shutil.copytree(tiny, self.workdir / "tiny")  # <workdir>/tiny/{target,store}: what configs/tiny-cpu.toml reads

    def configure(self, *overrides: str, env: dict[str, str] | None = None) -> None:
        command = ["python", "-m", "dflash", "train", "--config", "configs/tiny-cpu.toml"]
        for item in ("log_every=5", "average_every=5", *overrides):
            command += ["--set", item]
        table: dict[str, t.Any] = {
            "transport": "local",
            "workdir": str(self.workdir),
            "run_dir": str(self.run_dir),
            "python": sys.executable,
            "session": "dflash",
            "command": command,
            "tmux_socket": self.socket,
            "env": {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1", **(env or {})},
        }
        self.hosts.write_text(dump_hosts("local", {"local": table}))

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("DFLASHCTL_HOSTS", "TMUX", "TMUX_PANE", "DFLASH_FAULT")}
        env["HOME"] = str(self.root / "home")
        return env

    def cli(self, *args: str, timeout: float = 90) -> CliResult:
        """The real ``dflashctl``, a fork of this worker's fork server (its imports paid once, not per call)."""
        p = forkserver.shared("dflashctl").run(
            ["--hosts", str(self.hosts), *args], timeout=timeout, env=self.environ(), cwd=self.root
        )
        return CliResult(p.returncode, p.stdout, p.stderr)

    def status(self) -> dict[str, t.Any]:
        r = self.cli("status", "--json")
        assert r.stdout.strip(), r.output
        st = json.loads(r.stdout)
        st["_exit"] = r.exit_code
        return st

    def log(self, n: int) -> str:
        p = self.session_dir / f"attempt-{n}" / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def eval(self, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, t.Any]]:
        out = self.root / "eval.json"
        p = dflash("eval", "--drafter", str(self.session_dir / "checkpoints"), "--json", str(out), *args, cwd=self.root)
        return p, json.loads(out.read_text())


@pytest.fixture
def demo(tmp_path: Path, tmux_socket: str, tiny: Path) -> t.Iterator[LocalDemo]:
    d = LocalDemo(tmp_path, tmux_socket, tiny)
    try:
        yield d
    finally:
        reap_runs(d.run_dir)  # a local run outlives its tmux server by design; end what we started


def test_deploy_start_status_running_then_succeeded_tail_and_eval_equals_greedy(demo: LocalDemo) -> None:
    demo.configure("max_steps=20", "checkpoint.interval=10")  # 20 steps prove what 40 did
    r = demo.cli("deploy")
    assert r.exit_code == 0 and "deployed" in r.stdout, r.output
    r = demo.cli("start")
    assert r.exit_code == 0 and "started attempt 1 of session 'dflash'" in r.stdout, r.output

    seen: list[str] = []

    def finished() -> dict[str, t.Any] | None:
        st = demo.status()
        if not seen or seen[-1] != st["state"]:
            seen.append(st["state"])
        return st if st["state"] not in ("running", "not-started") else None

    final = retry_until(finished, 150, interval=0.3)
    assert final["state"] == "succeeded" and final["_exit"] == 4, (final, demo.log(1)[-2000:])
    assert seen == ["running", "succeeded"], seen
    assert final["exit_code"] == 0 and final["attempt"] == 1 and final["progress"]["step"] == 20

    r = demo.cli("tail", "-n", "30")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert 0 < len(lines) <= 30
    steps = [
        int(m.group(1)) for m in (re.match(r"step (\d+) \| loss [\d.]+ \| acc [\d.]+ \| tau_tf", x) for x in lines) if m
    ]
    assert steps and steps[-1] == 20 and steps == sorted(steps)
    assert r.stderr.startswith("[log]"), r.stderr  # the session ended: the durable log, and it says so

    p, report = demo.eval("--strict", "--max-new-tokens", "16")
    assert report["all_equal"] is True and report["num_prompts"] == SMALL.eval_prompts and report["step"] == 20
    # token for token the target's own greedy output up to its end of turn, computed here without the drafter
    from dflash.model.target import TargetModel

    assert report["protocol"]["stop_token_ids"] == [SMALL.chat.eos]  # the tiny target's EOS: <|im_end|>
    target = TargetModel.from_pretrained(str(demo.workdir / "tiny" / "target"), dtype=torch.float32, num_draft_layers=2)
    prompts = [json.loads(x)["input_ids"] for x in (demo.workdir / "tiny" / "eval.jsonl").read_text().splitlines()]
    for prompt, out in zip(prompts, report["outputs"]):
        greedy = target.generate_greedy(torch.tensor([prompt]), 16, stop_token_ids=[SMALL.chat.eos])
        assert out == greedy[0, len(prompt) :].tolist()
    assert f"tau {report['tau']:.2f}" in p.stdout


def test_restart_on_crash_restarts_the_run_which_resumes_from_its_checkpoint(demo: LocalDemo) -> None:
    demo.configure("max_steps=25", "checkpoint.interval=6", env={"DFLASH_FAULT": "raise-at-step:16"})
    assert demo.cli("deploy").exit_code == 0
    assert demo.cli("start").exit_code == 0
    state = demo.root / "supervisor"
    r = demo.cli(
        "restart-on-crash",
        "--interval",
        "1",
        "--backoff",
        "0.2",
        "--min-uptime",
        "5",
        "--state-dir",
        str(state),
        timeout=200,
    )
    assert r.exit_code == 0, r.output
    assert re.search(r"crashed: .*-> restart in", r.stdout) and "restarted: attempt 2 started" in r.stdout, r.stdout
    assert "the run succeeded" in r.stdout

    first = json.loads((demo.session_dir / "attempt-1" / "exit.json").read_text())
    assert first["exit_code"] == 1
    assert "DFLASH_FAULT raise-at-step:16: injected failure at step 16" in demo.log(1)
    m = re.search(r"resuming from \S+/step-(\d+) at step (\d+)", demo.log(2))
    assert m, demo.log(2)[-2000:]
    resumed = int(m.group(2))
    assert 6 <= resumed < 16, resumed
    steps = [int(x) for x in re.findall(r"^step (\d+) \|", demo.log(2), re.M)]
    assert steps and steps[0] > resumed and steps[-1] == 25, steps
    assert not (demo.session_dir / "attempt-3").exists()

    st = demo.status()
    assert st["state"] == "succeeded" and st["attempt"] == 2 and st["_exit"] == 4
    incidents = [json.loads(p.read_text()) for p in (state / "incidents").glob("*.json")]
    assert any(i.get("state") == "crashed" and i.get("cause") == "python-exception" for i in incidents), incidents
