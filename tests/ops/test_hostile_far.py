"""The far side (agent, runner, tmux): each test plays one fault a hostile or unlucky user
found, against the real agent, the real runner and a real tmux server on the test's own socket."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import typing as t
from pathlib import Path

import pytest
from test_agent import attempt_dir, dflashctl, wait_state

from ops import errors, session
from ops.far import agent
from ops.remote import Remote
from ops.transport import LocalTransport
from testkit import pid_alive, retry_until
from testkit.hostsfile import local_host as make_host
from testkit.runkit import fake_release, reap_runs, train_command


@pytest.fixture(autouse=True)
def _reap(tmp_path: Path) -> t.Iterator[None]:
    yield
    reap_runs(tmp_path / "runs")


def local_host(tmp_path: Path, socket: str, command: list[str], **extra: t.Any) -> Remote:
    host = make_host(tmp_path, socket, command, **extra)
    fake_release(Path(host.workdir))
    return Remote(host, LocalTransport())


def forever(tmp_path: Path) -> list[str]:
    return train_command("--steps", "1", "--interval", "0.05", "--until", str(tmp_path / "finish"))


def sdir(remote: Remote) -> Path:
    return Path(remote.host.run_dir) / "dflash"


# ---------------------------------------------------------------------------------------- item 2


def test_six_starts_at_once_one_run_and_current_points_at_it(tmp_path: Path, tmux_socket: str) -> None:
    remote = local_host(tmp_path, tmux_socket, forever(tmp_path))
    outcomes: list[t.Any] = []
    gate = threading.Barrier(6)

    def one() -> None:
        gate.wait()
        try:
            outcomes.append(session.start(Remote(remote.host, LocalTransport())))
        except errors.OpsError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    started = [o for o in outcomes if isinstance(o, dict)]
    refused = [o for o in outcomes if isinstance(o, errors.RunActive)]
    assert len(started) == 1 and len(refused) == 5, outcomes
    # the losers made nothing: one attempt, `current` at it, no empty attempt dirs
    assert sorted(p.name for p in sdir(remote).glob("attempt-*")) == ["attempt-1"]
    assert os.readlink(sdir(remote) / "current") == "attempt-1"
    st = session.status(remote.host, None, lambda: remote)
    assert st.state == "running" and st.attempt == 1 and st.pid == started[0]["child_pid"]
    assert not any("no run record" in e for e in st.evidence)
    assert oct((sdir(remote) / ".lock").stat().st_mode & 0o777) == "0o600"


# ---------------------------------------------------------------------------------------- item 3


def test_a_start_that_fails_keeps_the_previous_crash(tmp_path: Path, tmux_socket: str) -> None:
    remote = local_host(tmp_path, tmux_socket, train_command("--steps", "1", "--then", "exit:3"))
    session.start(remote)
    assert wait_state(remote, "crashed").exit_code == 3
    make_host(tmp_path, tmux_socket, ["python", "-c", "print('a\0b')"])  # hosts.toml for the real CLI
    r = dflashctl(tmp_path, "start")
    out, err = r.communicate(timeout=120)
    assert r.returncode == 1, (out, err)
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert "command: argument 2 holds a NUL byte" in err
    assert sorted(p.name for p in sdir(remote).glob("attempt-*")) == ["attempt-1"]
    assert os.readlink(sdir(remote) / "current") == "attempt-1"
    s = dflashctl(tmp_path, "status", "--json")
    sout, _ = s.communicate(timeout=120)
    assert s.returncode == 5 and json.loads(sout)["state"] == "crashed"
    # the dead pane of the crash is still there to read
    st = session.status(remote.host, None, lambda: remote)
    assert st.tmux.session == "alive" and st.tmux.pane == "dead"


def test_a_runner_that_dies_at_once_leaves_no_attempt(tmp_path: Path, tmux_socket: str) -> None:
    remote = local_host(tmp_path, tmux_socket, train_command("--steps", "1", "--then", "exit:3"))
    session.start(remote)
    wait_state(remote, "crashed")
    # an interpreter that runs the agent (-I) but not the runner
    py = tmp_path / "py"
    py.write_text(f'#!/bin/sh\ncase "$1" in -I) exec {sys.executable} "$@";; esac\necho "py: runner refused"; exit 3\n')
    py.chmod(0o755)
    broken = local_host(tmp_path, tmux_socket, ["true"], python=str(py))
    # what it printed, when tmux kept it: a pane whose process exits at once can lose its last output
    # (seen here: only tmux's "Pane is dead" line left, in 3 runs of 5), and that line is not the runner's
    with pytest.raises(errors.AgentError) as e:
        session.start(broken)
    assert re.search(
        r"the runner died at once, nothing was started: (py: runner refused|it printed nothing)$", str(e.value)
    )
    assert sorted(p.name for p in sdir(remote).glob("attempt-*")) == ["attempt-1"]
    assert session.status(remote.host, None, lambda: remote).state == "crashed"


# ---------------------------------------------------------------------------------------- item 10


def test_sigkill_of_the_runner_leaves_training_running_and_recorded(tmp_path: Path, tmux_socket: str) -> None:
    remote = local_host(tmp_path, tmux_socket, forever(tmp_path))
    out = session.start(remote)
    log = attempt_dir(remote, 1) / "train.log"
    retry_until(lambda: log.read_text().count("step ") >= 2, 20)
    os.kill(out["pid"], signal.SIGKILL)  # the pane's process
    retry_until(lambda: not pid_alive(out["pid"]), 10)
    n = log.read_text().count("step ")
    retry_until(lambda: log.read_text().count("step ") >= n + 5, 20)  # the command still writes its log
    st = session.status(remote.host, None, lambda: remote)
    assert st.state == "running" and st.pid == out["child_pid"] and st.tmux.pane == "dead"
    assert any("the runner (pid" in e and "is gone, the command goes on" in e for e in st.evidence)
    (tmp_path / "finish").touch()
    st = wait_state(remote, "succeeded")
    assert st.exit_code == 0  # the keeper recorded the real end
    assert "done after" in log.read_text()


# ---------------------------------------------------------------------------------------- item 4


def test_a_workdir_with_tmux_formats_is_never_expanded(tmp_path: Path, tmux_socket: str) -> None:
    marker = tmp_path / "pwned"
    wd = tmp_path / f"wd#(touch {marker})#S#{{pid}}"
    host = make_host(tmp_path, tmux_socket, ["python", "-c", "import os; print('cwd', os.getcwd())"], workdir=str(wd))
    rel = fake_release(wd)
    remote = Remote(host, LocalTransport())
    session.start(remote)
    wait_state(remote, "succeeded")
    assert not marker.exists()
    run = json.loads((attempt_dir(remote, 1) / "run.json").read_text())
    assert run["cwd"] == os.path.realpath(rel)
    assert f"cwd {os.path.realpath(rel)}" in (attempt_dir(remote, 1) / "train.log").read_text()


# ---------------------------------------------------------------------------------------- item 5


def test_env_secrets_never_reach_an_argv(tmp_path: Path, tmux_socket: str) -> None:
    secret = "hf_SeCrEt0123456789"
    remote = local_host(tmp_path, tmux_socket, forever(tmp_path), env={"HF_TOKEN": secret})
    out = session.start(remote)
    run = json.loads((attempt_dir(remote, 1) / "run.json").read_text())
    pids = [run["pid"], run["keeper_pid"], run["child_pid"]]
    for pid in pids:
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
    child_env = Path(f"/proc/{out['child_pid']}/environ").read_bytes().split(b"\0")
    assert f"HF_TOKEN={secret}".encode() in child_env  # the command does get it
    start_cmd = subprocess.run(
        ["tmux", "-L", tmux_socket, "display-message", "-p", "-t", "=dflash:", "#{pane_start_command}"],
        capture_output=True,
        text=True,
        timeout=10,
    ).stdout
    assert "ops.far.runner" in start_cmd and secret not in start_cmd and "--env-file" in start_cmd
    assert not list(attempt_dir(remote, 1).glob(".env*"))  # read and unlinked by the runner


def test_the_env_file_is_private_while_it_exists(tmp_path: Path) -> None:
    adir = tmp_path / "attempt-1"
    adir.mkdir()
    path = agent._prepare_attempt(str(adir), {"HF_TOKEN": "x"})
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert json.loads(Path(path).read_text()) == {"HF_TOKEN": "x"}


# ---------------------------------------------------------------------------------------- item 13


def test_a_user_shell_that_is_not_posix_does_not_break_start(
    tmp_path: Path, tmux_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fish = tmp_path / "fish"
    fish.write_text("#!/bin/sh\necho 'fish: Unsupported use of POSIX syntax' >&2\nexit 42\n")
    fish.chmod(0o755)
    monkeypatch.setenv("SHELL", str(fish))  # the tmux server this start creates inherits it
    remote = local_host(tmp_path, tmux_socket, train_command("--steps", "2"))
    out = session.start(remote)
    assert out["pid"] is not None and "warning" not in out
    st = wait_state(remote, "succeeded")
    assert st.exit_code == 0
    shell = subprocess.run(
        ["tmux", "-L", tmux_socket, "show-options", "-gv", "default-shell"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    assert shell == "/bin/sh"


# ---------------------------------------------------------------------------------------- item 11


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar")


def test_tail_and_status_read_a_bounded_window_of_a_huge_cr_log(tmp_path: Path) -> None:
    adir = tmp_path / "runs" / "dflash" / "attempt-1"
    adir.mkdir(parents=True)
    log = adir / "train.log"
    with open(log, "wb") as f:
        f.truncate(64 << 20)  # 64 MiB with no newline (sparse: cheap on disk, costly to read)
        f.seek(0, 2)
        f.write(b"".join(b"\rstep %d | loss 1.0" % i for i in range(200_000)))
    (tmp_path / "runs" / "dflash" / "current").symlink_to("attempt-1")
    req = {
        "session": "dflash",
        "socket": "nosock-h2-tail",
        "run_dir": str(tmp_path / "runs"),
        "lines": 999_999_999,
        "source": "log",
    }
    before = _rchar()
    a = agent.tail(req)
    facts = agent.attempt_facts(req, agent.DIAG_LINES)
    used = _rchar() - before
    assert used < 3 * agent.TAIL_WINDOW + (1 << 16), used  # two reads of the window, not 64 MiB
    assert a["lines"] == ["step 199999 | loss 1.0"]  # the `\r` row shows its last segment
    assert facts and facts["log"]["tail"] == ["step 199999 | loss 1.0"]
    assert f"at most {agent.MAX_LINES} lines" in a["reason"]


def test_tail_n_is_capped(tmp_path: Path) -> None:
    adir = tmp_path / "runs" / "dflash" / "attempt-1"
    adir.mkdir(parents=True)
    (adir / "train.log").write_bytes(b"".join(b"line %d\n" % i for i in range(30_000)))
    req = {
        "session": "dflash",
        "socket": "nosock-h2-cap",
        "run_dir": str(tmp_path / "runs"),
        "lines": 999_999_999,
        "source": "log",
    }
    a = agent.tail(req)
    assert len(a["lines"]) == agent.MAX_LINES and a["lines"][-1] == "line 29999"
    assert a["reason"].endswith(f"(at most {agent.MAX_LINES} lines are shown)")


def test_follow_shows_progress_of_a_cr_only_stream(tmp_path: Path) -> None:
    adir = tmp_path / "runs" / "dflash" / "attempt-1"
    adir.mkdir(parents=True)
    (adir / "train.log").write_bytes(b"10%\r20%\r30%")
    req = {"session": "dflash", "socket": "x", "run_dir": str(tmp_path / "runs"), "offset": 0}
    a = agent.tail(req)
    assert a["lines"] == ["20%"] and a["offset"] == len(b"10%\r20%\r")


# ---------------------------------------------------------------------------------------- item 9

# Runs inside `unshare -m`: a private mount namespace with a 1 MiB tmpfs as the run's disk. Prints
# one JSON object with what the test checks (the tmpfs and its files vanish with the namespace).
FULL_DISK = r"""
import json, os, subprocess, sys
repo, disk, hosts, socket = sys.argv[1:5]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk], check=True)
sys.path.insert(0, repo)
from ops import probe
from ops.far import agent

FILL = ("import os, sys\n"
        "f = open(os.path.join(os.environ['DFLASH_RUN_DIR'], '..', '..', 'fill'), 'ab', buffering=0)\n"
        "try:\n    while True: f.write(b'x' * 4096)\nexcept OSError: pass\n"
        "os._exit(int(sys.argv[1]))  # nothing more can be printed: the log is on the full disk\n")

def runner(adir, code):
    p = subprocess.run([sys.executable, "-m", "ops.far.runner", "--attempt-dir", adir, "--session", "dflash",
                        "--attempt", adir[-1], "--", sys.executable, "-c", FILL, str(code)],
                       capture_output=True, text=True, timeout=120, cwd=repo)
    return {"rc": p.returncode, "stderr": p.stderr, "files": sorted(os.listdir(adir)),
            "exit": json.load(open(os.path.join(adir, "exit.json"))) if os.path.exists(os.path.join(adir, "exit.json")) else None}

out = {}
runs = os.path.join(disk, "runs", "dflash")
out["ok_run"] = runner(os.path.join(runs, "attempt-1"), 0)
os.unlink(os.path.join(disk, "runs", "fill"))
out["bad_run"] = runner(os.path.join(runs, "attempt-2"), 3)
os.symlink("attempt-2", os.path.join(runs, "current"))
req = {"session": "dflash", "socket": socket, "run_dir": os.path.join(disk, "runs")}
facts = {"host": "local", "session": "dflash", "socket": socket, "container_id": None, "hang_after": 600,
         "startup_grace": 0, "checked_at": 0, "mode": "agent", "agent": agent.probe(req)}
out["facts"] = facts
out["status"] = probe.classify(facts).to_json()
cli = subprocess.run([*json.loads(sys.argv[5]), "--hosts", hosts, "start"], capture_output=True, text=True, timeout=120)
out["start"] = {"rc": cli.returncode, "stdout": cli.stdout, "stderr": cli.stderr,
                "attempts": sorted(n for n in os.listdir(runs) if n.startswith("attempt-"))}
print(json.dumps(out))
"""


def test_a_full_disk_keeps_the_real_end_and_refuses_a_start(tmp_path: Path, tmux_socket: str) -> None:
    from testkit import missing_requirement
    from testkit.hostsfile import dflashctl_argv
    from testkit.runkit import REPO

    why = missing_requirement("namespaces")
    if why:
        pytest.skip(why)
    disk = tmp_path / "disk"
    disk.mkdir()
    make_host(tmp_path, tmux_socket, forever(tmp_path), run_dir=str(disk / "runs"))
    fake_release(tmp_path / "work")
    script = tmp_path / "inside.py"
    script.write_text(FULL_DISK)
    p = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            str(script),
            str(REPO),
            str(disk),
            str(tmp_path / "hosts.toml"),
            tmux_socket,
            json.dumps(dflashctl_argv()),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    ok, bad = out["ok_run"], out["bad_run"]
    # the command filled the disk and exited 0: recorded as such, the runner says the same
    assert ok["rc"] == 0 and "Traceback" not in ok["stderr"], ok
    assert ok["exit"]["exit_code"] == 0 and ok["exit"]["disk_full"] is True
    assert not [f for f in ok["files"] if ".tmp" in f or f.endswith(".reserved")], ok["files"]
    assert bad["rc"] == 3 and bad["exit"]["exit_code"] == 3
    st = out["status"]
    assert (st["state"], st["cause"], st["exit_code"]) == ("crashed", "disk-full", 3), st
    assert st["detail"] == "0 bytes were free where the run writes when the command ended"
    assert any("is full" in e for e in st["evidence"])
    start = out["start"]
    assert start["rc"] == 1 and "Traceback" not in start["stderr"], start
    assert start["stderr"].strip().count("\n") == 0 and "is full" in start["stderr"], start
    assert start["attempts"] == ["attempt-1", "attempt-2"]
    # a fact set for tests/ops/test_probe.py, recorded here for real
    (tmp_path / "facts.json").write_text(json.dumps(out["facts"]))


def test_a_run_that_ends_between_start_s_two_looks_is_started_and_keeps_its_records(
    tmp_path: Path, tmux_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start reads run.json, then looks at the pane. A command that fails at once can end between the two
    (on a loaded box the agent is descheduled there: played here by holding the first read until the pane is
    dead): that run started, and its attempt with run.json and exit.json stays; it was 'the runner died at
    once, nothing was started', and the attempt dir with its exit record was removed."""
    remote = local_host(tmp_path, tmux_socket, ["sh", "-c", "echo step 1; exit 3"])
    real = agent._read_json
    held: list[str] = []

    def descheduled(path: str, *a: t.Any, **kw: t.Any) -> tuple[dict[str, t.Any] | None, str | None]:
        if path.endswith("run.json") and not held:
            held.append(path)
            panes = ["tmux", "-L", tmux_socket, "list-panes", "-a", "-F", "#{pane_dead}"]
            retry_until(lambda: subprocess.run(panes, capture_output=True, text=True).stdout.split() == ["1"], 30)
            return None, None
        return real(path, *a, **kw)

    monkeypatch.setattr(agent, "_read_json", descheduled)
    req = session.request(remote.host)
    req.update(command=list(remote.host.command), env={}, started_by=session.operator_start(True))
    agent.start(req)
    assert held, "the first look at run.json was the held one"
    adir = Path(held[0]).parent
    assert (adir / "run.json").exists() and (adir / "exit.json").exists()
    assert json.loads((adir / "exit.json").read_text())["exit_code"] == 3


def test_replace_starts_nothing_beside_a_run_its_stop_did_not_end(
    tmp_path: Path, tmux_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start --replace whose stop leaves the old run alive (a process no signal ends, as one in
    uninterruptible sleep on a dead NFS mount: root cannot make one here on purpose, so the stop's outcome
    is the one part played) refuses, names what still runs, and makes no attempt beside it."""
    remote = local_host(tmp_path, tmux_socket, forever(tmp_path))
    session.start(remote)
    wait_state(remote, "running")
    monkeypatch.setattr(agent, "_stop", lambda *a, **kw: {"ended": False, "stopped": False})
    req = session.request(remote.host)
    req.update(command=list(remote.host.command), env={}, replace=True, started_by=session.operator_start(True))
    with pytest.raises(agent.Refused) as refused:
        agent.start(req)
    assert refused.value.kind == "run-active"
    assert "the run it replaces did not end" in str(refused.value)
    assert "nothing was started beside it" in str(refused.value)
    assert sorted(p.name for p in sdir(remote).glob("attempt-*")) == ["attempt-1"]
    assert wait_state(remote, "running").state == "running"  # the old run is as it was
