"""The runner on its own (no tmux): the tee, the records, signals, and a pane that goes away."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
from pathlib import Path

from ops.far import procfs, runner
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
    """A command that exits and leaves a child running ends its run (systemd's KillMode=control-group):
    the child gets SIGTERM, exit.json waits for it and names it in `left`."""
    adir = tmp_path / "a"
    p = subprocess.run(
        runner_argv(adir, "sh", "-c", "sleep 30 & echo $! > bg.pid; echo parent done; exit 4"),
        capture_output=True,
        timeout=25,
        cwd=tmp_path,
    )
    bg = int((tmp_path / "bg.pid").read_text())
    try:
        assert p.returncode == 4
        ex = read(adir, "exit.json")
        assert ex["exit_code"] == 4 and [m["pid"] for m in ex["left"]] == [bg] and ex["killed"] == []
        assert not pid_alive(bg), "exit.json comes once the leftover is gone"
        log = (adir / "train.log").read_text()
        # named by its command line when read: `sleep 30`, or still sh's if the fork had not exec'd yet
        assert "parent done" in log and re.search(rf"left pid {bg} \((sleep 30|sh -c sleep 30 .*)\) running", log), log
    finally:
        if pid_alive(bg):
            os.kill(bg, signal.SIGKILL)


def test_what_ignores_the_leftover_term_is_killed_after_the_grace_and_named(tmp_path: Path) -> None:
    adir = tmp_path / "a"
    # it ignores TERM once it printed its first line: the command exits then
    ready = 'until grep -q "^line 1" "$DFLASH_RUN_DIR/train.log"; do sleep 0.05; done'
    command = f"{sys.executable} {FAKE} --lines 1 --steps 1 --until never --ignore-signals & {ready}; exit 0"
    argv = runner_argv(adir, "sh", "-c", command)
    argv[argv.index("--") : argv.index("--")] = ["--leftover-grace", "0.5"]
    p = subprocess.run(argv, capture_output=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    ex = read(adir, "exit.json")
    assert len(ex["left"]) == 1 and ex["killed"] == ex["left"], ex
    assert not pid_alive(ex["left"][0]["pid"])
    assert "SIGKILL to pid" in (adir / "train.log").read_text()


def test_a_stop_that_never_finishes_its_steps_is_finished_by_the_keeper(tmp_path: Path) -> None:
    """A stop was asked for (stop.json) and the command ended, but that stop never sent its TERM and
    KILL (its dflashctl or agent was killed midway): the keeper ends what is left itself, two stop
    graces and a leftover grace later, instead of waiting for it forever."""
    adir = tmp_path / "a"
    go, end = tmp_path / "go", tmp_path / "end"
    ready = 'until grep -q "^line 1" "$DFLASH_RUN_DIR/train.log"; do sleep 0.05; done'
    command = (
        f"{sys.executable} {FAKE} --lines 1 --steps 1 --until {end} --ignore-signals & {ready}; "
        f"until [ -e {go} ]; do sleep 0.05; done; exit 0"
    )
    argv = runner_argv(adir, "sh", "-c", command)
    argv[argv.index("--") : argv.index("--")] = ["--leftover-grace", "0.3"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        retry_until(lambda: (adir / "train.log").exists() and "line 1" in (adir / "train.log").read_text(), 20)
        stop = {"requested_at": "2026-12-01T15:00:00Z", "grace": 0.1, "reason": "stop", "by": "dflashctl"}
        (adir / "stop.json").write_text(json.dumps(stop))
        go.touch()  # the command ends; the stop that was asked for sends nothing more
        assert proc.wait(timeout=60) == 0
        ex = read(adir, "exit.json")
        assert len(ex["left"]) == 1 and ex["killed"] == ex["left"], ex
        assert not pid_alive(ex["left"][0]["pid"])
        log = (adir / "train.log").read_text()
        assert "the stop did not end them" in log and "SIGKILL to pid" in log, log
    finally:
        end.touch()  # a trainer the code under test left running ends by itself
        if proc.poll() is None:
            proc.kill()


def test_a_double_forked_child_comes_back_to_the_keeper_and_is_ended_with_the_run(tmp_path: Path) -> None:
    """The keeper is a child subreaper: a child whose parent exited (a daemon's double fork) is
    re-parented to it, not to init, and the run's SIGTERM reaches it."""
    adir = tmp_path / "a"
    until = tmp_path / "go"
    daemon = "sh -c 'echo $$ > bg.pid; exec sleep 600' &"
    proc = subprocess.Popen(
        runner_argv(adir, "sh", "-c", f"({daemon}); exec {sys.executable} {FAKE} --steps 1 --until {until}"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        run = retry_until(lambda: (adir / "run.json").exists() and read(adir, "run.json"), 20)
        bg = retry_until(lambda: (tmp_path / "bg.pid").exists() and int((tmp_path / "bg.pid").read_text() or 0), 20)
        assert run["subreaper"] is True and run["tag"].startswith("s/1/")
        assert retry_until(lambda: runner.proc_stat(bg) and _ppid(bg) == run["keeper_pid"], 10)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        assert not pid_alive(bg) and not pid_alive(run["child_pid"])
    finally:
        if proc.poll() is None:
            proc.kill()
        if (tmp_path / "bg.pid").exists() and pid_alive(int((tmp_path / "bg.pid").read_text() or 0)):
            os.kill(int((tmp_path / "bg.pid").read_text()), signal.SIGKILL)


def _ppid(pid: int) -> int | None:
    st = procfs.stat(pid)
    return st.ppid if st else None


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


def test_started_by_is_limited_as_the_agent_limits_it_not_by_its_indented_file(tmp_path: Path) -> None:
    from ops.far import records, runner
    from ops.far.atomic import write_json_atomic

    near = {"by": "supervisor", "after": {"seen": {f"k{i}": i for i in range(150)}}}  # ~1.9 KB, 2.4 KB indented
    assert len(json.dumps(near)) <= records.STARTED_BY_MAX
    write_json_atomic(str(tmp_path / records.STARTED_BY), near)
    assert (tmp_path / records.STARTED_BY).stat().st_size > records.STARTED_BY_MAX
    assert runner.read_started_by(str(tmp_path)) == near
    (tmp_path / records.STARTED_BY).write_text("[" * 5000 + "]" * 5000)
    assert runner.read_started_by(str(tmp_path)) == {"note": ".started_by.json was not kept: nested too deeply"}
    (tmp_path / records.STARTED_BY).write_text(json.dumps({"by": "x" * 3000}))
    assert "larger than 2048 bytes" in runner.read_started_by(str(tmp_path))["note"]
