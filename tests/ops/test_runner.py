"""The runner on its own (no tmux): the tee, the records, signals, and a pane that goes away."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

from ops.far import runner
from testkit import pid_alive, retry_until
from testkit.runkit import FAKE_TRAIN as FAKE


def runner_argv(adir: Path, *command: str, env: tuple[str, ...] = (), python: str | None = None) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "ops.far.runner",
        "--attempt-dir",
        str(adir),
        "--session",
        "s",
        "--attempt",
        "1",
        "--release",
        "r1",
    ]
    if python:
        argv += ["--python", python]
    if env:
        # as the agent hands it over: a 0600 file the runner reads and unlinks
        env_file = adir.parent / f".{adir.name}.env.json"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(dict(e.split("=", 1) for e in env), f)
        argv += ["--env-file", str(env_file)]
    return [*argv, "--", *command]


def read(adir: Path, name: str) -> dict:
    return json.loads((adir / name).read_text())


def test_tee_records_and_environment(tmp_path: Path) -> None:
    adir = tmp_path / "attempt-1"
    probe = (
        "import os, sys; "
        "print('run_dir', os.environ['DFLASH_RUN_DIR']); print('unbuf', os.environ['PYTHONUNBUFFERED']); "
        "print('extra', os.environ['EXTRA']); print('path0', os.environ['PATH'].split(':')[0]); "
        "print('err line', file=sys.stderr); print('cwd', os.getcwd())"
    )
    fake_py = tmp_path / "venv" / "bin" / "python"
    p = subprocess.run(
        runner_argv(adir, sys.executable, "-c", probe, env=("EXTRA=a b=c",), python=str(fake_py)),
        capture_output=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr
    log = (adir / "train.log").read_bytes()
    assert p.stdout == log  # the pane got exactly what the log got
    text = log.decode()
    assert f"run_dir {adir}" in text
    assert "unbuf 1" in text and "extra a b=c" in text and "err line" in text  # stderr merged
    assert f"path0 {fake_py.parent}" in text  # the configured interpreter's folder comes first
    run, ex = read(adir, "run.json"), read(adir, "exit.json")
    assert run["session"] == "s" and run["attempt"] == 1 and run["release"] == "r1"
    assert isinstance(run["child_pid"], int) and run["child_pid"] != run["pid"]
    assert isinstance(run["pid_start"], int) and isinstance(run["child_start"], int)
    boot, ticks = runner.pid1_start()
    assert run["container_boot_ticks"] == ticks and abs(run["container_boot"] - boot) < 0.05
    assert run["command"][1:3] == ["-c", probe]
    assert run["started_at"].endswith("Z") and run["hostname"]
    assert ex["exit_code"] == 0 and ex["signal"] is None and ex["ended_at"].endswith("Z")
    assert not list(adir.glob("*.tmp*"))  # written then renamed


def test_nonzero_exit_and_signal(tmp_path: Path) -> None:
    a1, a2 = tmp_path / "a1", tmp_path / "a2"
    p = subprocess.run(
        runner_argv(a1, sys.executable, FAKE, "--steps", "1", "--then", "exit:3"), capture_output=True, timeout=60
    )
    assert p.returncode == 3
    assert read(a1, "exit.json")["exit_code"] == 3
    p = subprocess.run(
        runner_argv(a2, sys.executable, FAKE, "--steps", "1", "--then", "kill"), capture_output=True, timeout=60
    )
    assert p.returncode == 128 + 9
    ex = read(a2, "exit.json")
    assert ex["exit_code"] is None and ex["signal"] == 9


def test_command_not_found(tmp_path: Path) -> None:
    adir = tmp_path / "a"
    p = subprocess.run(runner_argv(adir, "/nonexistent/trainer", "x"), capture_output=True, timeout=60)
    assert p.returncode == 127
    assert read(adir, "exit.json")["exit_code"] == 127
    assert "cannot run /nonexistent/trainer: No such file or directory" in (adir / "train.log").read_text()


def test_sighup_and_ctrl_z_ignored_sigterm_forwarded(tmp_path: Path) -> None:
    adir = tmp_path / "a"
    until = tmp_path / "go"
    proc = subprocess.Popen(
        runner_argv(adir, sys.executable, FAKE, "--steps", "1", "--until", str(until)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        run = retry_until(lambda: (adir / "run.json").exists() and read(adir, "run.json"), 20)
        os.kill(proc.pid, signal.SIGHUP)  # what a dying tmux server sends
        os.kill(proc.pid, signal.SIGTSTP)  # Ctrl-Z in an attached pane
        n = retry_until(lambda: (adir / "train.log").read_text().count("step "), 10)
        retry_until(lambda: (adir / "train.log").read_text().count("step ") > n + 2, 20)  # still stepping
        assert proc.poll() is None and pid_alive(run["child_pid"])
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        ex = read(adir, "exit.json")
        assert ex["signal"] == signal.SIGTERM and ex["exit_code"] is None  # the child got the TERM
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dead_pane_never_stops_the_log(tmp_path: Path) -> None:
    """A pty whose master is closed (the pane is gone: EIO) and a pipe nobody reads (EPIPE)."""
    for kind in ("pty", "pipe"):
        adir = tmp_path / kind
        if kind == "pty":
            master, slave = pty.openpty()
            os.close(master)  # every write to the slave now fails with EIO
            out = slave
        else:
            r, w = os.pipe()
            os.close(r)  # writes fail with EPIPE
            out = w
        proc = subprocess.Popen(
            runner_argv(adir, sys.executable, FAKE, "--lines", "300", "--steps", "2"),
            stdout=out,
            stderr=subprocess.DEVNULL,
        )
        os.close(out)
        assert proc.wait(timeout=60) == 0, kind
        text = (adir / "train.log").read_text()
        assert "line 300" in text and "done after 2 steps" in text, kind
        assert read(adir, "exit.json")["exit_code"] == 0


def test_bytes_pass_through_raw(tmp_path: Path) -> None:
    adir = tmp_path / "a"
    p = subprocess.run(
        runner_argv(adir, sys.executable, FAKE, "--cr", "--binary", "--steps", "0"), capture_output=True, timeout=60
    )
    assert p.returncode == 0
    raw = (adir / "train.log").read_bytes()
    assert b"loading 10%\rloading 50%\rloading 100%\n" in raw
    assert b"bad bytes \xff\xfe here\n" in raw


def test_grandchild_holding_the_pipe_does_not_hold_the_runner(tmp_path: Path) -> None:
    adir = tmp_path / "a"
    p = subprocess.run(
        runner_argv(adir, "sh", "-c", "sleep 30 & echo $! > bg.pid; echo parent done; exit 4"),
        capture_output=True,
        timeout=25,
        cwd=tmp_path,
    )
    try:
        assert p.returncode == 4
        assert read(adir, "exit.json")["exit_code"] == 4
        assert "parent done" in (adir / "train.log").read_text()
    finally:
        bg = int((tmp_path / "bg.pid").read_text())
        if pid_alive(bg):
            os.kill(bg, signal.SIGKILL)


def test_usage_errors(tmp_path: Path) -> None:
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.far.runner",
            "--attempt-dir",
            str(tmp_path),
            "--session",
            "s",
            "--attempt",
            "1",
            "--",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2 and "no command after --" in p.stderr
    bad = tmp_path / "env.json"
    bad.write_text('["not", "an", "object"]')
    adir = tmp_path / "a"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.far.runner",
            "--attempt-dir",
            str(adir),
            "--session",
            "s",
            "--attempt",
            "1",
            "--env-file",
            str(bad),
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    # a run that cannot be set up is an ended run with a record, not a runner traceback
    assert p.returncode == 126 and "Traceback" not in p.stdout + p.stderr
    assert (
        f"cannot read the environment file {bad}: expected a JSON object of strings" in (adir / "train.log").read_text()
    )
    assert read(adir, "exit.json")["exit_code"] == 126 and not bad.exists()


def test_proc_stat_reads_a_comm_with_spaces_and_parentheses(tmp_path: Path) -> None:
    exe = tmp_path / "a (b) c"
    exe.symlink_to(sys.executable)
    proc = subprocess.Popen([str(exe), "-c", "import time; time.sleep(30)"])
    try:
        st = retry_until(lambda: runner.proc_stat(proc.pid), 10)
        assert st[0] in "RS" and st[1] > 0
    finally:
        proc.kill()
        proc.wait()
    assert runner.proc_stat(proc.pid) is None


def test_start_times_are_exact_to_the_tick_not_to_the_second() -> None:
    """/proc/stat's btime is whole seconds; a start time built on it reads up to 1 s early."""
    import time

    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    after = time.time()
    try:
        st = runner.proc_stat(proc.pid)
        assert st is not None
        started = runner.start_epoch(st[1])
        tick = 1 / os.sysconf("SC_CLK_TCK")
        assert before - 2 * tick <= started <= after + 2 * tick, (before, started, after)
    finally:
        proc.kill()
        proc.wait()
