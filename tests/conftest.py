"""Shared pytest set-up. The real-process fixtures (sshd, fake Proxmox, tmux) live in testkit."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from testkit import slowlist

# Real-process fixtures: sshd, fake_pve, tmux_socket, pve_hosts, ssh_home (testkit/plugin.py); which
# xdist worker a test runs on (testkit/xdist_groups.py).
pytest_plugins = ["testkit.plugin", "testkit.xdist_groups"]

REPO = Path(__file__).resolve().parents[1]

# Tiny models on a 2-core machine: one torch thread per process keeps tests from fighting.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # ops-only environments
        pass


@pytest.hookimpl(tryfirst=True)  # before testkit.xdist_groups renames the grouped tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests listed in tests/slow.txt are marked ``slow``."""
    slow = slowlist.listed(REPO / "tests" / "slow.txt")
    for item in items:
        if item.nodeid in slow or item.nodeid.split("[")[0] in slow or item.nodeid.split("::")[0] in slow:
            item.add_marker(pytest.mark.slow)


_CPU_MARK = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """This process's CPU and its reaped children's (a test's `dflash`/`dflashctl` subprocesses, sshd, tmux)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    item.stash[_CPU_MARK] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> t.Iterator[None]:
    """Each phase's CPU seconds ride on its report (to the controller under xdist): unlike wall time, a
    test's CPU does not grow with the machine's load, so it says what a test costs on any machine."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    now = _cpu_seconds()
    report.user_properties.append(("cpu", round(now - item.stash.get(_CPU_MARK, now), 2)))
    item.stash[_CPU_MARK] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """DFLASH_TEST_TIMES=FILE: each test phase's seconds appended as it ends, in --durations' form (the
    input of ``python -m testkit.slowlist``), then its CPU seconds as a comment line (`# cpu 1.23 call
    NODEID`), the call's start and end (epoch seconds) and worker (`# at START STOP gwN NODEID`), a failure as
    a comment line: a run cut short still tells.
    Under xdist the controller writes them all (the workers' reports reach it)."""
    path = os.environ.get("DFLASH_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cpu = dict(report.user_properties).get("cpu")
    with open(path, "a", encoding="utf-8") as f:
        from testkit.xdist_groups import plain  # here: imported at the top, pytest could not rewrite it as a plugin

        nodeid = plain(report.nodeid)
        f.write(f"{report.duration:.2f}s {report.when} {nodeid}\n")
        if cpu is not None:
            f.write(f"# cpu {cpu} {report.when} {nodeid}\n")
        if report.when == "call":  # when and where it ran: what a run's tail waits for
            worker = getattr(report, "worker_id", None) or getattr(getattr(report, "node", None), "workerid", "-")
            f.write(f"# at {report.start:.1f} {report.stop:.1f} {worker} {nodeid}\n")
        if report.failed:
            f.write(f"# {report.outcome} {report.when} {nodeid}\n")


# A signal a test (or a library it calls, from C) leaves ignored or blocked stays so for the rest of that xdist
# worker, and every child started after it inherits it: an ignored SIGINT made each later Ctrl-C test of the
# worker time out. The kernel's word (/proc/self/status), not Python's cache of the handlers, is compared.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP, signal.SIGCHLD, signal.SIGALRM)


def _ignored_and_blocked() -> tuple[int, int]:
    masks = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigBlk"):
                masks[key] = int(value, 16)
    wanted = sum(1 << (sig - 1) for sig in _SIGNALS)
    return masks.get("SigIgn", 0) & wanted, masks.get("SigBlk", 0) & wanted


# A run started in the background by a shell without job control (`scripts/test &` in a script) inherits
# SIGINT and SIGQUIT ignored (POSIX), and so would every child: the tests run as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)
_BASELINE = (_ignored_and_blocked(), {sig: signal.getsignal(sig) for sig in _SIGNALS})


def _put_back() -> str:
    """The signals' state as the session found it; the names of those that were not, or ""."""
    (ign0, blk0), handlers = _BASELINE
    ign, blk = _ignored_and_blocked()
    if (ign, blk) == (ign0, blk0):
        return ""
    changed = [sig for sig in _SIGNALS if ((ign ^ ign0) | (blk ^ blk0)) >> (sig - 1) & 1]
    for sig in changed:
        if (ign ^ ign0) >> (sig - 1) & 1 and handlers[sig] is not None:
            signal.signal(sig, handlers[sig])
    if blk != blk0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig for sig in _SIGNALS if (blk & ~blk0) >> (sig - 1) & 1])
    return ", ".join(signal.Signals(sig).name for sig in changed)


@pytest.fixture(autouse=True)
def _signals_as_found(request: pytest.FixtureRequest) -> t.Iterator[None]:
    before = _put_back()  # a module fixture set up for this test, or something before it
    if before:
        request.node.warn(pytest.PytestWarning(f"found {before} ignored or blocked before the test (put back)"))
    yield
    after = _put_back()
    if after:
        request.node.warn(pytest.PytestWarning(f"the test left {after} ignored or blocked (put back)"))


@pytest.fixture(autouse=True)
def _root_logging() -> t.Iterator[None]:
    """Tests that call ``dflash.__main__.main`` in-process install a stderr handler bound to pytest's
    captured stream, which pytest closes after the test: put the root logger back so later tests' log
    lines do not end in "Logging error ... I/O operation on closed file"."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


# ---- the side venvs of scripts/floor-venv ---------------------------------------------------------


def _missing(reason: str) -> t.NoReturn:
    """Skip, or under CI=true fail: CI builds every side venv (scripts/test), so a missing one is a bug."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def _in_floor_venv() -> bool:
    return Path(sys.prefix).resolve() == REPO / ".venv-floor"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``speculators`` tests run in .venv-floor only (speculators 0.9.0 needs transformers <= 5.19):
    skipped elsewhere, a failure there under CI=true when the package is missing."""
    if item.get_closest_marker("speculators") is None or importlib.util.find_spec("speculators") is not None:
        return
    reason = "speculators is not installed (it lives in .venv-floor: scripts/floor-venv; scripts/test runs it)"
    if _in_floor_venv():
        _missing(reason)
    pytest.skip(reason)


def _side_python(venv: str, builds: str) -> str:
    python = REPO / venv / "bin" / "python"
    if not os.access(python, os.X_OK):
        _missing(f"{python} does not exist (scripts/floor-venv {builds} builds it)")
    return str(python)


@pytest.fixture(scope="session")
def tf457_python() -> str:
    """The interpreter of .venv-tf457: transformers 4.57 (z-lab's pin), torch, safetensors, no dflash."""
    return _side_python(".venv-tf457", "tf457")


@pytest.fixture(scope="session")
def floor_python() -> str:
    """The interpreter of .venv-floor: transformers 5.17, speculators 0.9.0, the project (editable)."""
    return _side_python(".venv-floor", "floor")


@pytest.fixture(scope="session")
def base_python() -> str:
    """The interpreter of .venv-base: the project installed with no extra (the operator's: no torch), from a
    copy of the checkout. A copy that no longer matches the checkout would test old code: it counts as missing."""
    python = _side_python(".venv-base", "base")
    where = subprocess.run(
        [python, "-c", "import dflash, ops, os; print(os.path.dirname(os.path.dirname(ops.__file__)))"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",  # not this checkout's packages, the installed ones
    )
    if where.returncode != 0:
        _missing(f"{python} cannot import the project: {where.stderr.strip()[-300:]}")
    site = Path(where.stdout.strip())
    for pkg in ("dflash", "ops"):
        for f in sorted((REPO / pkg).rglob("*")):
            rel = f.relative_to(REPO)
            if f.is_file() and "__pycache__" not in rel.parts:
                installed = site / rel
                if not installed.is_file() or installed.read_bytes() != f.read_bytes():
                    _missing(
                        f"{python}'s copy of the project is older than the checkout ({rel}): scripts/floor-venv base"
                    )
    return python
