"""The REAL dflashctl against a real sshd + a fake Proxmox container (a real
pid+mount namespace) + real tmux inside it, with a fake trainer. Each scenario asserts the state,
the cause, the exit code and the key JSON fields.

Pids in run.json are pids inside the container's namespace, so faults are injected from inside
(`pct exec 200 -- kill ...`), as a user on the box would.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import typing as t
from pathlib import Path

import pytest

from ops.transport import remote_command
from testkit import CliResult, PveHosts, retry_until
from testkit.runkit import fake_release, train_command

VMID = 200


class Box:
    """The pve host of the harness, with the fake trainer as its command."""

    def __init__(self, hosts: PveHosts) -> None:
        self.hosts = hosts
        self.pve = hosts.pve
        self.socket = str(hosts.pve_table["tmux_socket"])
        self.shared = hosts.workdir.parent  # seen at the same path by the host and the container
        self.finish = self.shared / "finish"

    def configure(self, *train_args: str, deploy: bool = True, **table: t.Any) -> None:
        self.hosts.write(command=train_command(*train_args), **table)
        if deploy:
            fake_release(self.hosts.workdir)

    def cli(self, *args: str, timeout: float = 90) -> CliResult:
        return self.hosts.cli(*args, timeout=timeout)

    def status(self) -> tuple[int, dict[str, t.Any]]:
        r = self.cli("status", "--json")
        assert r.stdout.strip(), r.stderr
        return r.exit_code, json.loads(r.stdout)

    def wait(self, *states: str, seconds: float = 30) -> tuple[int, dict[str, t.Any]]:
        def check() -> tuple[int, dict[str, t.Any]] | None:
            code, st = self.status()
            return (code, st) if st["state"] in states else None

        return retry_until(check, seconds, interval=0.2)

    def start(self, *args: str) -> CliResult:
        r = self.cli("start", *args)
        assert r.exit_code == 0, r.output
        return r

    def attempt(self, n: int = 1) -> Path:
        return self.hosts.run_dir / "dflash" / f"attempt-{n}"

    def run_json(self, n: int = 1) -> dict[str, t.Any]:
        return retry_until(
            lambda: (self.attempt(n) / "run.json").exists() and json.loads((self.attempt(n) / "run.json").read_text()),
            20,
        )

    def log(self, n: int = 1) -> str:
        p = self.attempt(n) / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def inside(self, *argv: str) -> subprocess.CompletedProcess[bytes]:
        return self.pve.run_in(VMID, list(argv))

    def tmux(self, *args: str) -> subprocess.CompletedProcess[bytes]:
        return self.inside("tmux", "-L", self.socket, *args)

    def tmux_server_pid(self) -> int:
        return int(self.tmux("display-message", "-p", "#{pid}").stdout.decode().strip())

    def steps(self, n: int = 1) -> int:
        return len(re.findall(r"^step \d+", self.log(n), re.M))


@pytest.fixture
def box(pve_hosts: PveHosts) -> t.Iterator[Box]:
    b = Box(pve_hosts)
    yield b
    b.finish.touch()  # let a fake trainer that is still stepping end by itself


def forever(box: Box, *extra: str) -> tuple[str, ...]:
    return ("--steps", "1", "--interval", "0.1", "--until", str(box.finish), *extra)


# ---------------------------------------------------------------------------------------------
# the run itself


def test_running_then_succeeded_with_the_real_deploy(box: Box) -> None:
    box.configure(*forever(box), deploy=False, hang_after=600, startup_grace=0)
    r = box.cli("start")
    assert r.exit_code == 1 and "run `dflashctl deploy` first" in r.stderr
    d = box.cli("deploy", timeout=120)
    assert d.exit_code == 0, d.output
    box.start()
    retry_until(lambda: box.steps() >= 2, 20)
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (0, "running", None)
    assert st["host"] == "pve" and st["session"] == "dflash" and st["attempt"] == 1 and st["mode"] == "agent"
    assert st["tmux"] == {
        "socket": box.socket,
        "server": "alive",
        "session": "alive",
        "pane": "alive",
        "evidence": None,
    }
    assert st["container"]["id"] == VMID and st["container"]["status"] == "running" and st["container"]["booted_at"]
    assert st["progress"]["step"] >= 1 and st["progress"]["loss"] > 0 and st["progress"]["ktok_s"] == 12.5
    assert st["log"] == str(box.attempt() / "train.log") and st["pid"] == box.run_json()["child_pid"]
    assert st["exit_code"] is None and st["ended_at"] is None and st["started_at"].endswith("Z")
    human = box.cli("status")
    assert human.exit_code == 0 and human.stdout.startswith("running: step ")
    assert "container: 200 running" in human.stdout and f"socket {box.socket}" in human.stdout

    box.finish.touch()
    code, st = box.wait("succeeded")
    assert (code, st["exit_code"], st["signal"], st["cause"]) == (4, 0, None, None)
    assert st["ended_at"] and st["tmux"]["pane"] == "dead"


def test_stalled_when_stopped_with_sigstop(box: Box) -> None:
    box.configure(*forever(box), hang_after=1, startup_grace=0)
    box.start()
    retry_until(lambda: box.steps() >= 1, 20)
    pid = box.run_json()["child_pid"]
    assert box.inside("kill", "-STOP", str(pid)).returncode == 0
    try:
        code, st = box.wait("stalled")
        assert code == 3 and st["cause"] is None and st["pid"] == pid
        assert st["detail"].startswith("no progress for ") and "(hang_after 1s)" in st["detail"]
        assert any("is stopped (state T" in e for e in st["evidence"])
        assert box.cli("status").stdout.startswith("stalled: no progress for ")
    finally:
        box.inside("kill", "-CONT", str(pid))


def test_crashed_cuda_oom_on_gpu_5(box: Box) -> None:
    box.configure("--steps", "2", "--then", "oom")
    box.start()
    code, st = box.wait("crashed")
    assert (code, st["cause"], st["gpu"], st["exit_code"], st["signal"]) == (5, "cuda-oom", 5, 1, None)
    assert st["detail"].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5")
    assert st["fingerprint"] == "cuda-oom|gpu 5" and st["progress"]["step"] == 2
    head = box.cli("status").stdout.splitlines()[0]
    assert re.fullmatch(r"crashed: CUDA out of memory on GPU 5 \(exit 1, \d\d:\d\d:\d\d, attempt 1\)", head), head


def test_crashed_python_exception_with_the_line_as_detail(box: Box) -> None:
    box.configure("--steps", "1", "--then", "exception:bad_key_7")
    box.start()
    code, st = box.wait("crashed")
    assert (code, st["cause"], st["exit_code"]) == (5, "python-exception", 1)
    assert st["detail"] == "KeyError: 'bad_key_7'"
    assert st["fingerprint"] == "python-exception|KeyError: 'bad_key_#'"


def test_crashed_by_sigkill(box: Box) -> None:
    box.configure(*forever(box))
    box.start()
    retry_until(lambda: box.steps() >= 1, 20)
    assert box.inside("kill", "-KILL", str(box.run_json()["child_pid"])).returncode == 0
    code, st = box.wait("crashed")
    assert (code, st["cause"], st["signal"], st["exit_code"]) == (5, "signal", 9, None)
    assert "killed by signal 9 (SIGKILL)" in box.cli("status").stdout.splitlines()[0]


# ---------------------------------------------------------------------------------------------
# tmux dies, the run does not


def test_tmux_server_sigkilled_training_keeps_running_and_logging(box: Box) -> None:
    box.configure(*forever(box), hang_after=600, startup_grace=0)
    box.start()
    retry_until(lambda: box.steps() >= 1, 20)
    assert box.inside("kill", "-KILL", str(box.tmux_server_pid())).returncode == 0
    code, st = box.wait("running")
    assert code == 0 and st["tmux"]["server"] == "dead"
    assert re.fullmatch(r"no server running on /tmp/tmux-\d+/" + re.escape(box.socket), st["tmux"]["evidence"])
    assert any("the training process is alive" in e for e in st["evidence"])
    n = box.steps()
    retry_until(lambda: box.steps() > n + 3, 20)  # still logging, no pane needed
    box.finish.touch()
    code, st = box.wait("succeeded")  # and its exit record still gets written
    assert code == 4 and st["exit_code"] == 0 and st["tmux"]["server"] == "dead"


def test_session_killed_training_keeps_running(box: Box) -> None:
    box.configure(*forever(box), hang_after=600, startup_grace=0)
    box.start()
    retry_until(lambda: box.steps() >= 1, 20)
    assert box.tmux("kill-session", "-t", "=dflash").returncode == 0
    code, st = box.wait("running")
    assert code == 0 and st["tmux"]["server"] == "alive" and st["tmux"]["session"] == "missing"
    assert st["tmux"]["evidence"] in ("no current target", "can't find session: dflash")
    assert any("session 'dflash' is gone" in e and "alive" in e for e in st["evidence"])
    n = box.steps()
    retry_until(lambda: box.steps() > n + 3, 20)


def test_hand_started_session_whose_server_was_killed_is_lost(box: Box) -> None:
    box.configure(*forever(box))
    assert box.tmux("new-session", "-d", "-s", "dflash", "sleep 600").returncode == 0
    code, st = box.status()
    assert (code, st["state"]) == (0, "running") and st["attempt"] is None
    assert box.inside("kill", "-KILL", str(box.tmux_server_pid())).returncode == 0
    code, st = box.wait("lost")
    assert (code, st["cause"]) == (6, "unknown")
    assert st["tmux"]["server"] == "dead"
    assert re.fullmatch(r"no server running on /tmp/tmux-\d+/" + re.escape(box.socket), st["tmux"]["evidence"])
    assert "only an exit record" in st["detail"]


def test_hand_started_command_that_exited_took_the_server_with_it(box: Box) -> None:
    """Same tmux text as a kill: the report must say it cannot tell without an exit record."""
    box.configure(*forever(box))
    assert box.tmux("new-session", "-d", "-s", "dflash", "sleep 0.3; exit 3").returncode == 0
    code, st = box.wait("lost")
    assert (code, st["cause"]) == (6, "unknown")
    assert re.fullmatch(r"no server running on /tmp/tmux-\d+/" + re.escape(box.socket), st["tmux"]["evidence"])
    assert "cannot be called a crash or a kill" in st["detail"] and "exit record" in st["detail"]
    assert "when the session's command ended and the server exited with it" in st["detail"]


# ---------------------------------------------------------------------------------------------
# the container and the host


def test_container_rebooted_is_lost_container_restart(box: Box) -> None:
    box.configure(*forever(box))
    box.start()
    retry_until(lambda: box.steps() >= 1, 20)
    box.pve.reboot(VMID)
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (6, "lost", "container-restart")
    assert st["container"]["status"] == "running" and st["container"]["booted_at"] >= st["started_at"]
    # /tmp was wiped with the reboot: no socket file at all
    assert re.fullmatch(r"error connecting to /tmp/tmux-\d+/\S+ \(No such file or directory\)", st["tmux"]["evidence"])
    assert st["attempt"] == 1 and st["exit_code"] is None


def test_container_stopped_and_missing(box: Box) -> None:
    box.configure(*forever(box))
    box.pve.stop(VMID)
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (9, "container-down", "stopped")
    assert st["container"] == {"id": VMID, "status": "stopped", "booted_at": None}
    assert "container '200' not running!" in st["detail"]
    box.pve.destroy(VMID)
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (9, "container-down", "missing")
    assert "200.conf' does not exist" in st["detail"]


def test_sshd_down_is_unreachable_refused(box: Box) -> None:
    box.configure(*forever(box))
    box.hosts.sshd.stop()
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (10, "unreachable", "refused")
    assert st["container"] == {"id": VMID, "status": None, "booted_at": None}


def test_unknown_host_key_is_unreachable_and_nothing_runs(box: Box, tmp_path: Path) -> None:
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    box.configure(*forever(box), known_hosts=str(empty))
    code, st = box.status()
    assert (code, st["state"], st["cause"]) == (10, "unreachable", "host-key")
    assert "SHA256:" in st["detail"]
    r = box.cli("start")
    assert r.exit_code == 10 and not box.attempt().exists()


# ---------------------------------------------------------------------------------------------
# tail, start/stop


def test_tail_pane_while_alive_then_log_after_the_server_died(box: Box) -> None:
    box.configure("--lines", "100", "--steps", "0", "--then", "forever")
    box.start()
    retry_until(lambda: "line 100" in box.log(), 20)
    want = [f"line {i}" for i in range(71, 101)]
    r = retry_until(lambda: (r := box.cli("tail", "-n", "30")).stdout.splitlines() == want and r, 10)
    assert r.exit_code == 0 and r.stderr.startswith("[pane] session 'dflash' is alive")
    assert box.inside("kill", "-KILL", str(box.tmux_server_pid())).returncode == 0
    r = box.cli("tail", "-n", "30")
    assert r.exit_code == 0 and r.stdout.splitlines() == want
    log = str(box.attempt() / "train.log")
    assert re.match(
        r"\[log\] tmux server is not running \(no server running on \S+\); showing the log " + re.escape(log), r.stderr
    )
    r = box.cli("tail", "-n", "5", "--source", "pane")
    assert r.exit_code == 1 and "no server running on" in r.stderr


def test_tail_collapses_cr_rows_and_survives_bad_bytes(box: Box) -> None:
    box.configure("--cr", "--binary", "--steps", "1", "--then", "exit:0")
    box.start()
    box.wait("succeeded")
    r = box.cli("tail", "-n", "4", "--source", "log")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "loading 100%",
        "bad bytes \ufffd\ufffd here",
        "step 1 | loss 3.0 | acc 0.5 | tau_tf 2.0 | 12.5 Ktok/s | queue 3/8 | drafters 1/1",
        "done after 1 steps",
    ]


def test_start_refused_over_a_live_run_replace_and_new_attempts(box: Box) -> None:
    box.configure(*forever(box))
    box.start()
    first = box.run_json(1)
    r = box.cli("start")
    assert r.exit_code == 1
    assert f"session 'dflash' already has a live run (attempt 1, pid {first['child_pid']}" in r.stderr
    r = box.start("--replace")
    assert "replaced attempt 1" in r.stdout and "started attempt 2" in r.stdout
    assert box.run_json(2)["attempt"] == 2 and (box.attempt(1) / "exit.json").exists()
    code, st = box.wait("running")
    assert st["attempt"] == 2
    r = box.cli("stop", "--grace", "10")
    assert r.exit_code == 0 and r.stdout.startswith("stopped attempt 2 by interrupt")
    code, st = box.status()
    assert (code, st["state"], st["attempt"]) == (8, "stopped", 2)
    box.start()
    assert box.run_json(3)["attempt"] == 3 and sorted(p.name for p in box.attempt(1).parent.glob("attempt-*")) == [
        "attempt-1",
        "attempt-2",
        "attempt-3",
    ]


def test_fallback_mode_when_the_agent_cannot_run(box: Box) -> None:
    box.configure(*forever(box), python="/nonexistent/python3")
    assert box.tmux("new-session", "-d", "-s", "dflash", "echo hello from a hand-made pane; sleep 600").returncode == 0
    code, st = box.status()
    assert (code, st["state"], st["mode"]) == (0, "running", "fallback")
    assert st["evidence"][0].startswith("fallback mode: cannot run /nonexistent/python3")
    human = box.cli("status")
    assert "mode:      fallback" in human.stdout
    r = retry_until(lambda: (r := box.cli("tail", "-n", "3")).stdout.strip() and r, 10)
    assert r.exit_code == 0 and "hello from a hand-made pane" in r.stdout
    assert r.stderr.startswith("[pane] fallback mode (cannot run /nonexistent/python3")


def test_attach_prints_the_ssh_pct_tmux_command(box: Box) -> None:
    box.configure(*forever(box))
    r = box.cli("attach")
    h = box.hosts.pve_table
    assert r.exit_code == 0
    assert r.stdout.startswith(f"ssh -t -o StrictHostKeyChecking=yes -p {h['port']} -i {h['identity_file']}")
    tail = shlex.quote(
        remote_command([h["pct"], "exec", "200", "--", "tmux", "-L", box.socket, "attach-session", "-t", "=dflash"])
    )
    assert r.stdout.rstrip().endswith(f"-- root@127.0.0.1 {tail}")


@pytest.mark.parametrize("every", [False, True], ids=["one-host", "all"])
def test_status_watch_keeps_one_ssh_connection_across_its_rounds(pve_hosts: PveHosts, every: bool) -> None:
    import signal
    import threading

    from testkit.hostsfile import dflashctl_argv

    log = pve_hosts.sshd.log
    before = log.read_text().count("Accepted publickey")
    argv = [
        *dflashctl_argv(),
        "--hosts",
        str(pve_hosts.path),
        "status",
        *(["--all"] if every else []),
        "--watch",
        "0.5",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=pve_hosts.env(), cwd=pve_hosts.root
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(t.cast(t.IO[str], proc.stdout)), daemon=True)
    reader.start()
    try:
        retry_until(lambda: sum(x.startswith("--- ") for x in lines) >= 4, 60)
    finally:
        proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=60)  # Ctrl-C: one host's watch exits with the last state's code, --all's with 0
    err = t.cast(t.IO[str], proc.stderr).read()
    assert code == (0 if every else 7) and "Traceback" not in err, err
    reader.join(timeout=10)
    assert any("not-started" in x for x in lines), lines
    # four rounds (and more), one login: the rounds share the host's connection
    assert log.read_text().count("Accepted publickey") - before == 1, lines
