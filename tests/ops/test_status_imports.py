"""What `dflashctl status` imports, and when: classify's modules load while the agent call waits.

Each run is a fresh interpreter (sys.modules is the point), against the real sshd + fake Proxmox host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import typing as t

from testkit.hostsfile import PveHosts
from testkit.runkit import fake_release

# Runs `dflashctl --hosts PATH status --json` in this process, noting what was imported when the
# connection was asked for and which thread imported ops.probe.
PROGRAM = r"""
import json, sys, threading
import ops.cli
after_cli = sorted(m for m in ("ops.wire", "ops.probe") if m in sys.modules)
seen = {}
remote = ops.cli.App.remote
def noting(self):
    seen.setdefault("at connect", sorted(m for m in ("ops.wire", "ops.probe") if m in sys.modules))
    return remote(self)
ops.cli.App.remote = noting
import importlib.abc
class Note(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ops.probe":
            seen.setdefault("ops.probe imported by", threading.current_thread().name)
        return None
sys.meta_path.insert(0, Note())
try:
    ops.cli.main(["--hosts", sys.argv[1], "status", "--json"])
except SystemExit as e:
    code = e.code
commands = sorted(m for m in sys.modules if m.startswith("ops.cli."))
print(json.dumps({"after ops.cli": after_cli, **seen, "exit": code, "command modules": commands}))
"""


def noted(pve_hosts: PveHosts) -> tuple[dict[str, object], dict[str, object]]:
    p = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(pve_hosts.path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=pve_hosts.env(),
    )
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2, (p.stdout, p.stderr[-2000:])
    return json.loads(lines[0]), json.loads(lines[1])


def test_status_connects_before_it_imports_classify_which_loads_beside_the_agent_call(pve_hosts: PveHosts) -> None:
    """ops.probe (with ops.wire: some 30 frozen dataclasses) is start-up CPU that the agent call's wait can hide:
    ops.cli loads neither, the connection is asked for before them, and a thread of its own imports them."""
    fake_release(pve_hosts.workdir)
    status, notes = noted(pve_hosts)
    assert notes["after ops.cli"] == [], notes
    assert notes["at connect"] == [], notes
    assert notes["ops.probe imported by"] == "import ops.probe", notes
    assert status["host"] == "pve" and status["state"] == "not-started", status
    assert notes["exit"] == 7, notes  # the state's code, as the console script's
    # the commands are imported on first use: status loads its own module, not deploy's, plot's or supervise's
    assert notes["command modules"] == ["ops.cli.groups", "ops.cli.options", "ops.cli.run"], notes


def test_status_of_a_host_that_is_down_imports_classify_in_this_thread(pve_hosts: PveHosts) -> None:
    """No connection, no wait to hide the imports in: status still classifies (unreachable), and no thread ran."""
    pve_hosts.write(port=1)  # nothing listens on port 1 of 127.0.0.1
    status, notes = noted(pve_hosts)
    assert notes["ops.probe imported by"] == "MainThread", notes
    assert status["state"] == "unreachable", status


def test_the_agent_compiles_its_modules_once_and_then_reads_their_bytecode(pve_hosts: PveHosts) -> None:
    """The release folder is the agent's to write (-I -S leave bytecode writing on): the first call writes
    __pycache__ for the container's python, later calls read it (compiling them costs ~70 ms each time)."""
    rel = fake_release(pve_hosts.workdir)
    assert not list(rel.rglob("*.pyc"))
    assert pve_hosts.cli("status", "--json").exit_code == 7
    tag = sys.implementation.cache_tag  # the container's python is this one (hosts.toml's `python`)
    pyc = rel / "ops" / "far" / "__pycache__" / f"agent.{tag}.pyc"
    first = pyc.stat()
    assert pve_hosts.cli("status", "--json").exit_code == 7
    again = pyc.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # read, not written again


# The console script's way in (main() reads sys.argv), with an exit handler that says whether the
# interpreter was torn down the usual way.
CONSOLE = r"""
import atexit, sys
atexit.register(lambda: sys.stderr.write("finalized\n"))
from ops.cli import main
sys.argv = ["dflashctl", "--hosts", *sys.argv[1:]]
main()
"""


def test_status_ends_its_process_without_tearing_the_interpreter_down(pve_hosts: PveHosts) -> None:
    """Freeing every module's objects at exit was ~150 ms of each status under load: status leaves nothing to
    finalize (its connection closed, stdout and stderr flushed), so it ends at once; other commands do not."""
    fake_release(pve_hosts.workdir)

    def console(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", CONSOLE, str(pve_hosts.path), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=pve_hosts.env(),
        )

    p = console("status", "--json")
    assert p.returncode == 7, p.stderr
    assert json.loads(p.stdout)["state"] == "not-started"  # all of it arrived, flushed before the exit
    assert "finalized" not in p.stderr
    p = console("status")
    assert p.returncode == 7 and p.stdout.startswith("not-started: ") and "evidence:" in p.stdout, (p.stdout, p.stderr)
    p = console("hosts")
    assert p.returncode == 0 and "pve" in p.stdout, p.stderr
    assert p.stderr == "finalized\n"
    p = console("status", "--session", "bad name")  # an error: the usual exit, message and code
    assert p.returncode == 1 and p.stderr.endswith("finalized\n"), p.stderr


# The console entry's hook: `quick_status` first, the full CLI when it declines (what the entry script runs).
QUICK = r"""
import json, sys
from ops.session import quick_status
code = quick_status(sys.argv[2:])
print(json.dumps({"code": code, "loaded": sorted(m for m in ("click", "paramiko", "ops.cli") if m in sys.modules)}))
"""


def quick(pve_hosts: PveHosts, *argv: str) -> tuple[list[str], dict[str, t.Any]]:
    p = subprocess.run(
        [sys.executable, "-c", QUICK, "-", "--hosts", str(pve_hosts.path), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=pve_hosts.env(),
    )
    lines = p.stdout.strip().splitlines()
    assert lines, p.stderr[-2000:]
    return lines[:-1], json.loads(lines[-1])


def test_quick_status_prints_what_the_cli_prints_without_click(pve_hosts: PveHosts) -> None:
    fake_release(pve_hosts.workdir)
    cli = pve_hosts.cli("status", "--json")
    out, notes = quick(pve_hosts, "status", "--json")
    assert notes["code"] == cli.exit_code == 7
    assert "click" not in notes["loaded"] and "ops.cli" not in notes["loaded"], notes
    same = ("host", "session", "state", "cause", "mode", "tmux", "container", "evidence")
    assert {k: json.loads(out[0])[k] for k in same} == {k: cli.json()[k] for k in same}
    text, notes = quick(pve_hosts, "--host", "pve", "status", "--session=dflash")
    assert notes["code"] == 7 and text[0].startswith("not-started:"), text
    cli_text = pve_hosts.cli("status")
    assert text == cli_text.stdout.strip().splitlines()


def test_quick_status_declines_every_other_line_and_prints_nothing(pve_hosts: PveHosts) -> None:
    for argv in (
        ["status", "--watch", "2"],
        ["status", "--json", "--json"],
        ["--group", "g", "status"],
        ["status", "--all"],
        ["tail"],
        ["status", "--session"],
        ["-v", "status"],
        ["status", "--session", "no/such"],  # a bad name: the CLI words the error
        ["--host", "nosuch", "status"],
    ):
        out, notes = quick(pve_hosts, *argv)
        assert out == [] and notes["code"] is None, (argv, out, notes)
