"""The fault rig of restart-on-crash's tests (tests/ops/test_fault_matrix.py, test_notify.py, test_history.py):
the pve host of the harness with a fake trainer that checkpoints a step counter every K steps and resumes
from it, faults asked through a control file, and `dflashctl -v restart-on-crash` run as a subprocess
whose events (stdout) and probes (stderr) are collected."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import typing as t
from pathlib import Path

import pytest

from testkit import PveHosts, forkserver, retry_until
from testkit.hostsfile import dflashctl_argv
from testkit.runkit import fake_release, train_command

VMID = 200
K = 5  # checkpoint every K steps
FAST = ("--interval", "0.5", "--backoff", "0.2", "--max-backoff", "1")


class Supervisor:
    """``argv`` (`dflashctl -v restart-on-crash ...`) as a child process: a fork of the worker's dflashctl fork
    server when it is the dflashctl command itself (click, paramiko and ops imported once: ~0.3 s of CPU a
    supervisor), else run whole (a wrapper that execs it); its stdout (events) and stderr (one `probe` log
    line per probe) collected by threads."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc: subprocess.Popen[str] | forkserver.Spawned
        program = dflashctl_argv()
        if argv[: len(program)] == program:
            self.proc = forkserver.shared("dflashctl").spawn(argv[len(program) :], env=env, cwd=cwd)
        else:
            self.proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
            )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [
            threading.Thread(target=self._read, args=(s, sink), daemon=True)
            for s, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for th in self._threads:
            th.start()

    @staticmethod
    def _read(stream: t.IO[str], sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.out) + "\n--- stderr\n" + "\n".join(self.err[-40:])

    def event(self, pattern: str, seconds: float = 45) -> str:
        """The first stdout line matching ``pattern`` (waits for it)."""
        rx = re.compile(pattern)

        def find() -> str | None:
            hit = next((line for line in list(self.out) if rx.search(line)), None)
            if hit is None and self.proc.poll() is not None:
                raise AssertionError(f"the supervisor exited ({self.proc.returncode}) before {pattern!r}:\n{self.text}")
            return hit

        hit = retry_until(find, seconds, interval=0.1)
        assert hit is not None  # retry_until returns only a truthy value
        return hit

    def events(self, pattern: str) -> list[str]:
        return [line for line in list(self.out) if re.search(pattern, line)]

    def probes(self) -> int:
        return sum(1 for line in list(self.err) if " probe " in line)

    def more_probes(self, n: int = 3, seconds: float = 45) -> None:
        """Wait until the supervisor probed ``n`` more times: a negative assertion needs it to have looked."""
        start = self.probes()
        retry_until(
            lambda: (
                self.probes() >= start + n
                or (self.proc.poll() is not None and pytest.fail(f"supervisor exited:\n{self.text}"))
            ),
            seconds,
        )

    def wait(self, seconds: float = 60) -> int:
        rc = self.proc.wait(timeout=seconds)
        for th in self._threads:
            th.join(timeout=5)
        return rc

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by pid
            self.proc.wait(timeout=10)


class Rig:
    """The pve host of the harness with the resuming fake trainer, and the supervisors started on it."""

    def __init__(self, hosts: PveHosts, tmp_path: Path) -> None:
        self.hosts = hosts
        self.pve = hosts.pve
        self.socket = str(hosts.pve_table["tmux_socket"])
        self.shared = hosts.workdir.parent  # seen at the same path by the host and the container
        self.shared.mkdir(parents=True, exist_ok=True)
        self.finish = self.shared / "finish"
        self.ckpt = self.shared / "ckpt.json"
        self.control = self.shared / "control"
        self.state_dir = tmp_path / "state"
        self.supervisors: list[Supervisor] = []

    def configure(self, *, interval: float = 0.1, **table: t.Any) -> None:
        cmd = train_command(
            "--steps",
            "1",
            "--interval",
            str(interval),
            "--until",
            str(self.finish),
            "--checkpoint",
            str(self.ckpt),
            "--every",
            str(K),
            "--control",
            str(self.control),
        )
        self.hosts.write(command=cmd, **{"hang_after": 600, "startup_grace": 0, **table})
        fake_release(self.hosts.workdir)

    def cli(self, *args: str, timeout: float = 90) -> t.Any:
        return self.hosts.cli(*args, timeout=timeout)

    def start(self, steps: int = 2) -> None:
        """`dflashctl start`, then attempt 1's log shows ``steps`` steps: a supervisor started after that has
        no steps to wait through (each of its probes is an ssh exec of the agent: ~0.2 s of CPU)."""
        r = self.cli("start")
        assert r.exit_code == 0, r.output
        retry_until(lambda: len(self.steps(1)) >= steps, 30)

    def supervise(self, *args: str, env: t.Mapping[str, str] | None = None, wrap: t.Sequence[str] = ()) -> Supervisor:
        """`dflashctl -v restart-on-crash --state-dir <rig's> ARGS` (``env``: more variables for it; ``wrap``:
        a command that execs it, e.g. ``prlimit --as=N --``)."""
        argv = [
            *wrap,
            *dflashctl_argv(),
            "--hosts",
            str(self.hosts.path),
            "-v",
            "restart-on-crash",
            "--state-dir",
            str(self.state_dir),
            *args,
        ]
        sup = Supervisor(argv, self.hosts.env(env), self.hosts.root)
        self.supervisors.append(sup)
        sup.event(r": watching \(")
        return sup

    def fault(self, text: str) -> None:
        tmp = self.control.with_name("control.tmp")
        tmp.write_text(text)
        tmp.replace(self.control)  # the trainer never reads half a line

    def status(self) -> dict[str, t.Any]:
        r = self.cli("status", "--json")
        assert r.stdout.strip(), r.stderr
        return t.cast(dict[str, t.Any], json.loads(r.stdout))

    def attempt(self, n: int) -> Path:
        return self.hosts.run_dir / "dflash" / f"attempt-{n}"

    def attempts(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in (self.hosts.run_dir / "dflash").glob("attempt-*"))

    def log(self, n: int) -> str:
        p = self.attempt(n) / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def steps(self, n: int) -> list[int]:
        return [int(x) for x in re.findall(r"^step (\d+) \|", self.log(n), re.M)]

    def run_json(self, n: int) -> dict[str, t.Any]:
        path = self.attempt(n) / "run.json"

        def read() -> dict[str, t.Any] | None:
            return t.cast(dict[str, t.Any], json.loads(path.read_text())) if path.exists() else None

        found = retry_until(read, 30)
        assert found is not None  # retry_until returns only a truthy value
        return found

    def inside(self, *argv: str) -> subprocess.CompletedProcess[bytes]:
        return self.pve.run_in(VMID, list(argv))

    def incidents(self) -> list[dict[str, t.Any]]:
        d = self.state_dir / "incidents"
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.exists() else []

    def assert_resumed(self, old: int, new: int) -> None:
        """No completed step lost beyond the checkpoint interval."""
        retry_until(lambda: len(self.steps(new)) >= 2, 30)
        before, after = self.steps(old), self.steps(new)
        m = re.search(r"^resumed from checkpoint at step (\d+)$", self.log(new), re.M)
        assert m, self.log(new)[:500]
        ckpt = int(m.group(1))
        assert ckpt % K == 0 and ckpt in before, (ckpt, before[-5:])
        assert after[0] == ckpt + 1  # starts right after the last checkpoint
        # Checkpoints are written in the background, one at a time: when the run died, the last one due
        # (at or before its last logged step) was either on disk or still being written, and then the one
        # before it was on disk (the writer finishes one before it starts the next). CI once saw the
        # write of step 10 cut short by the stop: resumed from 5 with step 10 logged.
        due = before[-1] // K * K
        assert ckpt in (due, due - K), (ckpt, before[-5:])

    def close(self) -> None:
        for s in self.supervisors:
            s.close()
        self.finish.touch()
