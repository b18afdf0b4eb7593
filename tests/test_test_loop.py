"""The test loop itself: what lets tests run side by side under pytest-xdist (scripts/test), and the quick tier."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from testkit import free_port
from testkit.machine import _ephemeral_low, _port_slice
from testkit.slowlist import durations, listed
from testkit.slowlist import main as slowlist_main
from testkit.xdist_groups import plain

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built_once() -> t.Iterator[list[str]]:
    yield []


def test_each_worker_draws_ports_from_its_own_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_TEST_PORT_SHARE", raising=False)  # scripts/test sets it for its two runs
    low, high = max(1024, _ephemeral_low() - 12000), _ephemeral_low()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    slices = []
    for i in range(4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{i}")
        first, last = _port_slice(low, high)
        slices.append(range(first, last))
        port = free_port()
        assert first <= port < last, f"gw{i} drew {port} outside its slice [{first}, {last})"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # and it is free
    assert all(not set(a) & set(b) for a in slices for b in slices if a is not b), "the slices are disjoint"
    assert slices[0].start == low and slices[-1].stop <= high
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert _port_slice(low, high) == (low, high), "no xdist: the whole range"
    # two pytest runs side by side (scripts/test: the floor run beside the main run): halves of their own
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    halves = []
    for share in ("0/2", "1/2"):
        monkeypatch.setenv("DFLASH_TEST_PORT_SHARE", share)
        halves.append(range(*_port_slice(low, high)))
    assert not set(halves[0]) & set(halves[1]) and halves[0].start == low
    assert halves[1].stop <= high and len(halves[0]) == len(halves[1]) >= (high - low) // 8 - 1


def test_a_test_on_a_module_fixture_stays_with_its_module(
    built_once: list[str], request: pytest.FixtureRequest
) -> None:
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args == ("tests/test_test_loop.py",)


CHILD = """
import os, pytest

@pytest.fixture(scope="module")
def built():
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("i", range(6))
def test_on_the_module_fixture(built, i):
    assert built == os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.serial
@pytest.mark.parametrize("i", range(4))
def test_serial(i):
    pass

@pytest.mark.parametrize("i", range(4))
def test_free(i):
    pass
"""


def test_under_xdist_a_module_fixtures_tests_and_the_serial_tests_each_run_on_one_worker(tmp_path: Path) -> None:
    """pytest 9.2 ignores the id xdist 3.8 writes to say a test's group, so every group was lost: a module's
    fixture was built on each worker, serial tests ran side by side. A real xdist run of 3 workers."""
    (tmp_path / "test_child.py").write_text(CHILD, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    args = "-p testkit.xdist_groups -p no:cacheprovider -n 3 --dist loadgroup -v -W ignore::pytest.PytestUnknownMarkWarning"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *args.split(), "test_child.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    ran = re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED test_child.py::(\w+)\[(\d+)\](\S*)", run.stdout, re.M)
    assert len(ran) == 14, run.stdout
    workers = {name: {w for w, n, _, _ in ran if n == name} for name in ("test_on_the_module_fixture", "test_serial")}
    assert all(len(w) == 1 for w in workers.values()), workers
    assert {plain(n + "[" + i + "]" + suffix) for _, n, i, suffix in ran} == {n + "[" + i + "]" for _, n, i, _ in ran}


def test_a_test_on_function_fixtures_goes_to_any_worker(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    assert request.node.get_closest_marker("xdist_group") is None


def test_the_tests_listed_in_slow_txt_are_marked_slow(request: pytest.FixtureRequest) -> None:
    slow = listed(Path(__file__).with_name("slow.txt"))
    assert slow, "tests/slow.txt lists the slowest tests"
    marked = {plain(i.nodeid) for i in request.session.items if i.get_closest_marker("slow") is not None}
    collected = {plain(i.nodeid) for i in request.session.items}
    assert {n for n in slow if n in collected} <= marked
    assert plain(request.node.nodeid) not in marked


def test_the_slow_list_adds_up_a_tests_setup_call_and_teardown() -> None:
    report = """
============================= slowest durations ==============================
39.25s call     tests/dflash/test_train.py::test_cli_exit_codes[a b]
1.50s setup    tests/dflash/test_train.py::test_cli_exit_codes[a b]
0.25s teardown tests/dflash/test_train.py::test_cli_exit_codes[a b]
2.00s call     tests/ops/test_x.py::test_y
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
1 passed in 3.0s
"""
    assert durations(report) == {
        "tests/dflash/test_train.py::test_cli_exit_codes[a b]": 41.0,
        "tests/ops/test_x.py::test_y": 2.0,
    }


def test_a_test_is_slow_by_its_cpu_or_its_wait_in_any_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full run's times and a quick run's: the module fixture's cost lands on whichever test of the module
    came first in each, so the list takes the most of any report."""
    full = tmp_path / "full.times"
    full.write_text(
        "0.10s setup tests/a.py::test_fixture_first\n# cpu 0.05 setup tests/a.py::test_fixture_first\n"
        "0.20s call tests/a.py::test_fixture_first\n# cpu 0.50 call tests/a.py::test_fixture_first\n"
        "0.10s call tests/a.py::test_after\n# cpu 0.10 call tests/a.py::test_after\n"
        "3.00s call tests/b.py::test_waits\n# cpu 0.01 call tests/b.py::test_waits\n"
        "0.10s call tests/b.py::test_cheap\n# cpu 0.01 call tests/b.py::test_cheap\n"
    )
    quick = tmp_path / "quick.times"  # test_fixture_first left out: test_after builds the fixture now
    quick.write_text("0.90s setup tests/a.py::test_after\n# cpu 0.70 setup tests/a.py::test_after\n")
    assert slowlist_main([str(full), str(quick)]) == 0
    listed_now = {line.split()[0] for line in capsys.readouterr().out.splitlines() if not line.startswith("#")}
    assert listed_now == {"tests/a.py::test_fixture_first", "tests/a.py::test_after", "tests/b.py::test_waits"}


def test_a_forked_dflashctl_is_the_real_command_with_the_callers_home(tmp_path: Path) -> None:
    """testkit.forkserver's dflashctl: the same exit code, stdout and stderr as a fresh `dflashctl`, with the
    HOME and cwd the caller gives (tests/ops run each command with a HOME of its own)."""
    from testkit import forkserver

    home = tmp_path / "home"
    (home / ".config" / "dflashctl").mkdir(parents=True)
    (home / ".config" / "dflashctl" / "hosts.toml").write_text('default = "x"\n[hosts.x]\ntransport = "nope"\n')
    env = {**os.environ, "HOME": str(home)}
    env.pop("DFLASHCTL_HOSTS", None)
    forked = forkserver.shared("dflashctl").run(["status"], env=env, cwd=tmp_path, timeout=120)
    fresh = subprocess.run(
        [*forkserver.dflashctl_argv(), "status"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert forked.args[0] == "dflashctl", "it forked (a fallback runs the whole command line)"
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert 'got "nope"' in forked.stderr, forked.stderr  # the hosts.toml of the HOME given was read
    shadowed = {**env, "PYTHONPATH": str(tmp_path)}  # what Python imports changes: a real interpreter
    assert forkserver.shared("dflashctl").run(["status"], env=shadowed, cwd=tmp_path).args[0] != "dflashctl"


def test_a_spawned_dflashctl_streams_runs_beside_a_forked_command_and_ends_by_its_signal(tmp_path: Path) -> None:
    """testkit.forkserver's spawn (a supervisor a test watches): a fork of the real command with its own pid,
    its output read while it runs, a `run` forking meanwhile, and a signal to its pid ends it as it would a
    fresh `dflashctl` (restart-on-crash's farewell, exit 0)."""
    import signal

    from testkit import forkserver, retry_until
    from testkit.hostsfile import local_host

    local_host(tmp_path, "dflash-spawn-test", ["sleep", "600"])  # never started: the supervisor only watches
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env.pop("DFLASHCTL_HOSTS", None)
    hosts = ["--hosts", str(tmp_path / "hosts.toml")]
    server = forkserver.shared("dflashctl")
    sup = server.spawn([*hosts, "restart-on-crash", "--interval", "0.2", "--state-dir", str(tmp_path / "s")], env=env)
    try:
        assert isinstance(sup, forkserver.Spawned), "it forked (a fallback is a Popen)"
        assert sup.stdout is not None
        first = sup.stdout.readline()
        assert "local/dflash: watching (every 0.2s): not-started" in first, first
        assert sup.poll() is None and Path(f"/proc/{sup.pid}").exists()
        beside = server.run([*hosts, "status", "--json"], env=env, cwd=tmp_path)
        assert beside.args[0] == "dflashctl" and beside.returncode == 7, beside  # forked too, meanwhile
        sup.send_signal(signal.SIGINT)
        assert sup.wait(60) == 0
        assert "supervisor stopped by SIGINT; the run is left as it is" in sup.stdout.read()
        assert retry_until(lambda: not Path(f"/proc/{sup.pid}").exists(), 30)  # reaped by the server
    finally:
        sup.kill()


def test_no_ops_module_reads_the_environment_when_it_is_imported() -> None:
    """What lets a dflashctl command fork from a server that imported ops under another environment."""
    import ast

    found = []
    for path in sorted((REPO / "ops").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        todo: list[ast.AST] = list(tree.body)
        while todo:  # module level and class bodies run at import; function bodies do not
            node = todo.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            text = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.Call, ast.Name)) else ""
            if re.search(r"\b(environ|getenv)\b", text) and not isinstance(node, ast.Name):
                found.append(f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')}: {text}")
            todo.extend(ast.iter_child_nodes(node))
    assert found == []
