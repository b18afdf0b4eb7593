"""The agent's verbs on this machine (LocalTransport) with a real tmux server on a per-test socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from ops import errors, session
from ops.far import tmux
from ops.remote import Remote
from ops.transport import LocalTransport
from testkit import TmuxServers, pid_alive, retry_until
from testkit.hostsfile import local_host as make_host
from testkit.runkit import fake_release, reap_runs, train_command


def dflashctl(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    from testkit.hostsfile import dflashctl_argv

    return subprocess.Popen(
        [*dflashctl_argv(), "--hosts", str(tmp_path / "hosts.toml"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )


@pytest.fixture(autouse=True)
def _reap(tmp_path: Path) -> t.Iterator[None]:
    yield
    reap_runs(tmp_path / "runs")  # local runs outlive their tmux server by design


@pytest.fixture
def local(tmp_path: Path, tmux_socket: str) -> Remote:
    host = make_host(tmp_path, tmux_socket, train_command("--steps", "1", "--until", str(tmp_path / "finish")))
    fake_release(Path(host.workdir))
    return Remote(host, LocalTransport())


def tmux_out(socket: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", socket, *args], capture_output=True, text=True, timeout=10).stdout.strip()


def attempt_dir(remote: Remote, n: int) -> Path:
    return Path(remote.host.run_dir) / "dflash" / f"attempt-{n}"


def wait_state(remote: Remote, *states: str, seconds: float = 20) -> session.Status:
    return retry_until(lambda: (s := session.status(remote.host, None, lambda: remote)).state in states and s, seconds)


def test_start_needs_a_deploy(tmp_path: Path, tmux_socket: str) -> None:
    host = make_host(tmp_path, tmux_socket, ["true"])
    with pytest.raises(
        errors.NotDeployed, match=r"nothing is deployed at .*/work/current: run `dflashctl deploy` first"
    ):
        session.start(Remote(host, LocalTransport()))
    assert not (Path(host.run_dir) / "dflash").exists()  # no attempt made


def test_status_without_a_deploy_runs_in_fallback_mode_and_says_why(tmp_path: Path, tmux_socket: str) -> None:
    host = make_host(tmp_path, tmux_socket, ["true"])
    remote = Remote(host, LocalTransport())
    st = session.status(host, None, lambda: remote)
    assert (st.state, st.mode) == ("not-started", "fallback")
    assert st.evidence[0].startswith(f"fallback mode: nothing is deployed at {host.workdir}/current")
    assert st.tmux.evidence and "error connecting to" in st.tmux.evidence


def test_start_is_one_tmux_invocation_with_the_options_first(local: Remote) -> None:
    out = session.start(local)
    sock = local.host.tmux_socket
    assert out["attempt"] == 1 and out["release"] == "r0000000000000001"
    # Checked through libtmux, independently of the agent's own tmux calls.
    server = TmuxServers.server(sock)
    assert server.show_option("remain-on-exit", global_=True) is True
    assert server.show_option("exit-empty", global_=True) is False
    assert server.show_option("history-limit", global_=True) == 100000
    pane = server.sessions.get(session_name="dflash").active_window.active_pane
    assert (pane.pane_width, pane.pane_height) == ("240", "60")
    run = json.loads((attempt_dir(local, 1) / "run.json").read_text())
    # `exec` in the command string: the pane's process IS the runner
    assert pane.pane_pid == str(run["pid"])
    assert run["pid"] == out["pid"] and run["child_pid"] == out["child_pid"]
    assert run["cwd"] == os.path.realpath(Path(local.host.workdir) / "releases" / "r0000000000000001")
    link = Path(local.host.run_dir) / "dflash" / "current"
    assert os.readlink(link) == "attempt-1"  # relative
    env = dict(
        e.split(b"=", 1) for e in Path(f"/proc/{run['child_pid']}/environ").read_bytes().split(b"\0") if b"=" in e
    )
    assert env[b"DFLASH_RUN_DIR"] == str(attempt_dir(local, 1)).encode() and b"TMUX" not in env


def test_start_refuses_a_live_run_then_replace(local: Remote, tmp_path: Path) -> None:
    first = session.start(local)
    with pytest.raises(errors.RunActive) as e:
        session.start(local)
    msg = str(e.value)
    assert "session 'dflash' already has a live run" in msg
    assert f"attempt 1, pid {first['child_pid']}" in msg and "--replace" in msg
    assert not attempt_dir(local, 2).exists()

    second = session.start(local, replace=True)
    assert second["attempt"] == 2 and second["replaced"]["attempt"] == 1
    old = attempt_dir(local, 1)
    assert json.loads((old / "stop.json").read_text())["reason"] == "replaced"
    assert json.loads((old / "exit.json").read_text())["signal"] in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
    assert not pid_alive(first["child_pid"])
    assert os.readlink(Path(local.host.run_dir) / "dflash" / "current") == "attempt-2"

    # a run that ended leaves a dead pane: the next start takes the name over without --replace
    (tmp_path / "finish").touch()
    wait_state(local, "succeeded")
    third = session.start(local)
    assert third["attempt"] == 3
    assert sorted(p.name for p in (Path(local.host.run_dir) / "dflash").glob("attempt-*")) == [
        "attempt-1",
        "attempt-2",
        "attempt-3",
    ]
    assert (attempt_dir(local, 1) / "train.log").exists() and (attempt_dir(local, 2) / "exit.json").exists()


def test_stop_interrupts_and_marks_it_on_purpose(local: Remote) -> None:
    session.start(local)
    retry_until(lambda: "step 1" in (attempt_dir(local, 1) / "train.log").read_text(), 20)
    out = session.stop(local, grace=20)
    assert out["stopped"] and out["how"] == "interrupt" and out["steps"] == ["interrupt"]
    assert out["exit"]["signal"] == signal.SIGINT or out["exit"]["exit_code"] not in (None, 0)
    st = session.status(local.host, None, lambda: local)
    assert st.state == "stopped" and st.attempt == 1
    assert any(e.startswith("stop.json: requested at") for e in st.evidence)
    again = session.stop(local, grace=1)
    assert again["stopped"] is False and again["reason"] == "attempt 1 already ended"


def test_stop_escalates_to_term_then_kill(tmp_path: Path, tmux_socket: str) -> None:
    stubborn = "import signal, time; signal.signal(2, signal.SIG_IGN); signal.signal(15, signal.SIG_IGN); print('step 1 | loss 1', flush=True); time.sleep(600)"
    host = make_host(tmp_path, tmux_socket, ["python", "-c", stubborn])
    fake_release(Path(host.workdir))
    remote = Remote(host, LocalTransport())
    started = session.start(remote)
    retry_until(lambda: "step 1" in (attempt_dir(remote, 1) / "train.log").read_text(), 20)
    out = session.stop(remote, grace=0.5)
    assert out["steps"] == ["interrupt", "term", "kill"] and out["how"] == "kill"
    assert out["exit"] == json.loads((attempt_dir(remote, 1) / "exit.json").read_text())
    assert out["exit"]["signal"] == signal.SIGKILL
    assert not pid_alive(started["child_pid"])
    assert session.status(host, None, lambda: remote).state == "stopped"


def test_tail_follow_reads_new_lines_by_offset(local: Remote, tmp_path: Path) -> None:
    session.start(local)
    log = attempt_dir(local, 1) / "train.log"
    retry_until(lambda: "step 2 " in log.read_text(), 20)
    first = session.tail(local, lines=1, source="log")
    assert first.source == "log" and len(first.lines) == 1 and first.lines[0].startswith("step ")
    # the offset is where that last line ends (the log keeps growing meanwhile)
    assert log.read_bytes()[: first.offset].decode().endswith(first.lines[0] + "\n")
    got: list[str] = []
    retry_until(lambda: log.stat().st_size > first.offset, 20)
    session.follow(local, first, interval=0.01, emit=got.append, note=lambda m: None, rounds=3)
    assert got and all(line.startswith("step ") for line in got)
    n_first = int(first.lines[0].split()[1])
    assert [int(line.split()[1]) for line in got] == list(range(n_first + 1, n_first + 1 + len(got)))


def test_agent_answers_json_for_bad_requests(tmp_path: Path) -> None:
    def agent(verb: str, stdin: str) -> tuple[int, dict]:
        p = subprocess.run(
            [sys.executable, "-m", "ops.far.agent", verb, "--json"],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return p.returncode, json.loads(p.stdout)

    rc, a = agent("explode", "{}")
    assert rc == 2 and a["error"] == "usage"
    rc, a = agent("probe", "[1]")
    assert rc == 2 and a["error"] == "bad-request" and "expected a JSON object" in a["message"]
    rc, a = agent("start", json.dumps({"session": "x", "socket": "y", "run_dir": str(tmp_path)}))
    assert rc == 2 and "missing keys: workdir, command" in a["message"]
    rc, a = agent("probe", json.dumps({"session": "../etc", "socket": "y", "run_dir": str(tmp_path)}))
    assert rc == 2 and "session: use letters, digits, '-', '_' only, got '../etc'" in a["message"]


def test_session_option_is_checked_before_anything_runs(tmp_path: Path, tmux_socket: str) -> None:
    host = make_host(tmp_path, tmux_socket, ["true"])
    remote = Remote(host, LocalTransport())
    for bad in ("a:b", "x.y", "../up", ""):
        with pytest.raises(errors.ConfigError, match=r"^--session: use letters, digits"):
            session.start(remote, bad)
        with pytest.raises(errors.ConfigError):
            session.status(host, bad, lambda: remote)


def test_probe_without_tmux_installed(tmp_path: Path) -> None:
    req = {"session": "dflash", "socket": "nosuch", "run_dir": str(tmp_path), "tmux": str(tmp_path / "no-tmux")}
    p = subprocess.run(
        [sys.executable, "-m", "ops.far.agent", "probe", "--json"],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        timeout=30,
    )
    facts = json.loads(p.stdout)
    assert facts["ok"] and facts["tmux"]["installed"] is False and facts["attempt"] is None


def test_a_start_waits_for_an_ended_runs_pane_to_close_instead_of_refusing(local: Remote, tmp_path: Path) -> None:
    """Between an ended run's exit record and its pane's end, the runner still runs in the pane for a moment
    (seen under load): a start then is no start beside a live run, it waits for the pane, then starts."""
    session.start(local)
    (tmp_path / "finish").touch()
    wait_state(local, "succeeded")
    server = TmuxServers.server(local.host.tmux_socket)
    server.kill_session("=dflash")
    # the runner's last moment, stretched: the pane's process is the one run.json names, its exit record written
    pane = server.new_session(session_name="dflash", window_command="sleep 1").active_window.active_pane
    runner = int(pane.pane_pid)
    record = attempt_dir(local, 1) / "run.json"
    run = json.loads(record.read_text())
    start_ticks = int(Path(f"/proc/{runner}/stat").read_text().rsplit(")", 1)[1].split()[19])
    record.write_text(json.dumps({**run, "pid": runner, "pid_start": start_ticks}))
    assert session.start(local)["attempt"] == 2
    assert not pid_alive(runner)


# What only pull, plot and a crashed run's kernel-log read need: a status probe (every call's verb, the
# start-up CPU that `status` pays on the box) must not import them.
PROBE_SKIPS = ("hashlib", "base64", "dataclasses", "tempfile", "inspect")


def test_probe_imports_nothing_only_other_verbs_need(tmp_path: Path) -> None:
    program = (
        "import json, sys; sys.path.insert(0, sys.argv.pop(1)); from ops.far.agent import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(json.dumps(sorted(m for m in {PROBE_SKIPS!r} if m in sys.modules)))"
    )
    req = {"session": "dflash", "socket": "nosuch", "run_dir": str(tmp_path), "tmux": str(tmp_path / "no-tmux")}
    root = str(Path(__file__).resolve().parents[2])
    p = subprocess.run(
        [sys.executable, "-I", "-S", "-c", program, root, "probe", "--json"],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        timeout=30,
    )
    answer, loaded = p.stdout.strip().splitlines()[-2:]
    assert json.loads(answer)["ok"], p.stdout + p.stderr
    assert json.loads(loaded) == []


def test_tmux_stderr_table() -> None:
    cases = {
        "no server running on /tmp/tmux-0/dflash": ("dead", None, "stale-socket"),
        "error connecting to /tmp/tmux-0/dflash (No such file or directory)": ("dead", None, "no-socket"),
        "error connecting to /tmp/tmux-0/dflash (Permission denied)": ("dead", None, "socket-error"),
        "failed to connect to server: Connection refused": ("dead", None, "no-server"),
        "can't find session: dflash": ("alive", "missing", "no-session"),
        "can't find session dflash": ("alive", "missing", "no-session"),
        "session not found: dflash": ("alive", "missing", "no-session"),
        "can't find window: dflash": ("alive", "missing", "no-session"),
        "no current target": ("alive", "missing", "no-sessions"),
        "duplicate session: dflash": ("alive", "alive", "duplicate-session"),
        "something else": (None, None, "unknown"),
    }
    for text, (server, sess, kind) in cases.items():
        v = tmux.classify(text + "\n")
        assert (v.server, v.session, v.kind) == (server, sess, kind), text
        assert v.text == text


def test_tmux_text_helpers() -> None:
    assert tmux.collapse_cr("loading 10%\rloading 50%\rloading 100%") == "loading 100%"
    assert tmux.collapse_cr("windows line\r") == "windows line"
    assert tmux.decode_lines(b"a\xffb\nc\r\nd") == ["a\ufffdb", "c", "d"]
    assert tmux.last_lines(["1", "2", "", "3", "", " ", ""], 2) == ["", "3"]
    argv = tmux.start_argv("sock", "dflash", ["py", "-m", "ops.runner", "--", "a b", "it's"])
    assert argv[:3] == ["tmux", "-L", "sock"] and argv.count(";") == 5
    assert argv[argv.index("-c") + 1] == "/" and argv[argv.index("default-shell") + 1] == "/bin/sh"
    assert argv[-1] == "exec py -m ops.runner -- 'a b' 'it'\"'\"'s'"
    assert "=dflash" in tmux.panes_argv("sock", "dflash") and "=dflash:" in tmux.capture_argv("sock", "dflash", 5)


FAKE_NVIDIA_SMI = """#!/bin/sh
# answers the query the agent makes, in the real tool's csv,noheader,nounits shape
[ "$1" = "--query-gpu=index,name,memory.used,memory.total,utilization.gpu,pci.bus_id" ] || exit 2
[ "$2" = "--format=csv,noheader,nounits" ] || exit 2
if [ -n "$FAIL" ]; then
  echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."; exit 9
fi
echo "0, NVIDIA H200, 130511, 143771, 100, 00000000:18:00.0"
echo "5, NVIDIA H200, 143602, 143771, [N/A], 00000000:3B:00.0"
"""


def test_probe_reads_nvidia_smi_per_gpu(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    req = json.dumps({"session": "dflash", "socket": "nosock-gpu", "run_dir": str(tmp_path)})

    def probe(**env: str) -> dict:
        p = subprocess.run(
            [sys.executable, "-m", "ops.far.agent", "probe", "--json"],
            input=req,
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env},
        )
        return json.loads(p.stdout)

    gpus = probe()["gpus"]
    assert gpus == [
        {
            "index": 0,
            "name": "NVIDIA H200",
            "memory_used_mib": 130511.0,
            "memory_total_mib": 143771.0,
            "utilization_pct": 100.0,
            "pci_bus_id": "00000000:18:00.0",
        },
        {
            "index": 5,
            "name": "NVIDIA H200",
            "memory_used_mib": 143602.0,
            "memory_total_mib": 143771.0,
            "utilization_pct": None,
            "pci_bus_id": "00000000:3B:00.0",
        },
    ]
    failed = probe(FAIL="1")["gpus"]
    assert failed == {"error": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."}


def test_watch_and_follow_end_cleanly_on_ctrl_c(local: Remote, tmp_path: Path) -> None:
    import threading

    session.start(local)
    retry_until(lambda: "step 2 " in (attempt_dir(local, 1) / "train.log").read_text(), 20)
    procs = {
        "watch": dflashctl(tmp_path, "status", "--watch", "0.5"),
        "follow": dflashctl(tmp_path, "tail", "-n", "1", "-f", "--interval", "0.2"),
    }
    outs: dict[str, list[str]] = {k: [] for k in procs}
    readers = [
        threading.Thread(target=lambda k=k, p=p: outs[k].extend(p.stdout), daemon=True) for k, p in procs.items()
    ]
    for r in readers:
        r.start()
    try:
        retry_until(lambda: sum(x.startswith("--- ") for x in outs["watch"]) >= 2 and len(outs["follow"]) >= 4, 30)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGINT)
    for k, p in procs.items():
        assert p.wait(timeout=60) == 0, (k, p.stderr.read())
    for r in readers:
        r.join(timeout=10)
    watch_err, follow_err = procs["watch"].stderr.read(), procs["follow"].stderr.read()
    assert "Traceback" not in watch_err + follow_err and "Aborted" not in watch_err + follow_err
    assert sum(x.startswith("running: step ") for x in outs["watch"]) >= 2
    steps = [int(line.split()[1]) for line in outs["follow"]]
    assert steps == list(range(steps[0], steps[0] + len(steps)))  # in order, none lost, none twice
    assert follow_err.startswith("[log] following the log ")


def test_replace_over_a_hand_started_pane_leaves_the_ended_attempt_alone(local: Remote, tmp_path: Path) -> None:
    session.start(local)
    (tmp_path / "finish").touch()
    wait_state(local, "succeeded")
    first = attempt_dir(local, 1)
    sock = local.host.tmux_socket
    server = TmuxServers.server(sock)
    server.kill_session("=dflash")  # the dead pane goes; someone starts the name by hand
    pane = server.new_session(session_name="dflash", window_command="sleep 600").active_window.active_pane
    hand_pid = int(pane.pane_pid)
    out = session.start(local, replace=True)
    assert out["attempt"] == 2
    assert not (first / "stop.json").exists(), "an ended attempt's evidence was rewritten"
    assert json.loads((first / "exit.json").read_text())["exit_code"] == 0
    retry_until(lambda: not pid_alive(hand_pid), 20)
