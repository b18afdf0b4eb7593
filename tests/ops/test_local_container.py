"""dflashctl on the Proxmox host itself. ``transport = "local"`` with ``container = N``
reaches the container with ``pct exec`` directly, no ssh; every verb works that way.

Real parts: the REAL dflashctl executable, the fake Proxmox host's ``pct`` on this machine (its
containers are real pid+mount namespaces), real tmux inside the container, a real deploy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import typing as t
from pathlib import Path

import pytest

from ops.attach import attach_argv
from ops.errors import ConfigError
from ops.hosts import parse_inventory
from testkit import FakePve, TmuxServers, forkserver, retry_until
from testkit.hostsfile import CliResult, dump_hosts
from testkit.runkit import reap_runs, train_command

VMID = 200


class OnTheHost:
    """hosts.toml with one host ``ct``: this machine is the Proxmox host, the run is in container 200."""

    def __init__(self, pve: FakePve, socket: str, root: Path) -> None:
        self.pve = pve
        self.root = root
        work = pve.fs / f"ct{VMID}"
        self.workdir, self.run_dir = work / "dflash", work / "runs"
        self.shared = work / "shared"
        self.shared.mkdir(parents=True)
        self.finish = self.shared / "finish"
        self.table: dict[str, t.Any] = {
            "transport": "local",
            "container": VMID,
            "pct": str(pve.pct),
            "workdir": str(self.workdir),
            "run_dir": str(self.run_dir),
            "python": sys.executable,
            "tmux_socket": socket,
            "startup_grace": 0,
            "command": train_command("--steps", "1000000", "--interval", "0.1", "--until", str(self.finish)),
        }
        self.path = root / "hosts.toml"
        self.write()

    def write(self) -> None:
        self.path.write_text(dump_hosts("ct", {"ct": self.table}))

    def cli(self, *args: str, timeout: float = 300) -> CliResult:
        env = {k: v for k, v in os.environ.items() if k not in ("SSH_AUTH_SOCK", "TMUX")}
        env["HOME"] = str(self.root / "home")
        # a fork of this worker's dflashctl fork server: the real command without an interpreter start each
        p = forkserver.shared("dflashctl").run(
            ["--hosts", str(self.path), *args], timeout=timeout, env=env, cwd=self.root
        )
        return CliResult(p.returncode, p.stdout, p.stderr)

    def log(self, n: int) -> str:
        p = self.run_dir / "dflash" / f"attempt-{n}" / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""


@pytest.fixture
def on_host(fake_pve: FakePve, tmux_servers: TmuxServers, tmp_path: Path) -> t.Iterator[OnTheHost]:
    fake_pve.create(VMID, start=True)
    h = OnTheHost(fake_pve, tmux_servers.new(), tmp_path)
    try:
        yield h
    finally:
        h.finish.touch()
        reap_runs(h.run_dir)


def test_every_verb_reaches_the_container_with_pct_and_no_ssh(on_host: OnTheHost) -> None:
    # deploy: the real bundle, into the container (its python has the training packages: the venv's)
    r = on_host.cli("deploy")
    assert r.exit_code == 0, r.output
    assert re.search(r"deployed \w{16} to ct \(ct 200\)", r.stdout), r.stdout
    rel = on_host.workdir / "current"
    assert (rel / "ops" / "far" / "agent.py").is_file()

    r = on_host.cli("start")
    assert r.exit_code == 0, r.output
    assert "started attempt 1 of session 'dflash' on ct (ct 200)" in r.stdout
    retry_until(lambda: "step 3 |" in on_host.log(1), 60)
    # the run lives in the container: its pid namespace, not ours
    run = json.loads((on_host.run_dir / "dflash" / "attempt-1" / "run.json").read_text())
    inside = on_host.pve.run_in(VMID, ["cat", f"/proc/{run['child_pid']}/cmdline"])
    assert inside.returncode == 0 and b"fake_train" in inside.stdout

    st = on_host.cli("status", "--json")
    assert st.exit_code == 0, st.output
    doc = st.json()
    assert (doc["state"], doc["container"]["id"], doc["container"]["status"], doc["mode"]) == (
        "running",
        VMID,
        "running",
        "agent",
    )
    assert doc["supervisor"] == {**doc["supervisor"], "state": "none"}  # nobody watches it yet
    assert "  watch:     not supervised" in on_host.cli("status").stdout

    tail = on_host.cli("tail", "-n", "3")
    assert tail.exit_code == 0 and re.search(r"^step \d+ \|", tail.stdout, re.M), tail.output

    # restart-on-crash: a crash restarted through local pct
    assert on_host.pve.run_in(VMID, ["kill", "-KILL", str(run["child_pid"])]).returncode == 0
    retry_until(lambda: (on_host.run_dir / "dflash" / "attempt-1" / "exit.json").exists(), 30)
    once = on_host.cli("restart-on-crash", "--once", "--state-dir", str(on_host.root / "state"))
    assert once.exit_code == 0, once.output
    assert "crashed: killed by signal 9 (SIGKILL)" in once.stdout and "restarted: attempt 2 started" in once.stdout
    retry_until(lambda: "step 2 |" in on_host.log(2), 60)

    # a stopped container: container-down from pct; --start-container starts it, locally
    on_host.pve.stop(VMID)
    down = on_host.cli("status", "--json")
    assert (down.exit_code, down.json()["state"], down.json()["cause"]) == (9, "container-down", "stopped")
    once = on_host.cli("restart-on-crash", "--once", "--start-container", "--state-dir", str(on_host.root / "state"))
    assert "container 200 started; re-probing" in once.stdout, once.output
    assert on_host.pve.init_pid(VMID) is not None

    doctor = on_host.cli("doctor", "--json")
    checks = {c["check"]: c["status"] for c in json.loads(doctor.stdout)["hosts"][0]["checks"]}
    assert checks["reachable"] == checks["container"] == checks["tmux"] == checks["python"] == "ok", doctor.stdout

    assert on_host.cli("stop", "--grace", "5").exit_code == 0


def test_doctor_says_the_container_is_stopped_and_stops_there(on_host: OnTheHost) -> None:
    on_host.pve.stop(VMID)
    r = on_host.cli("doctor")
    assert r.exit_code == 9, r.output
    assert "FAIL  container   ct 200 is stopped; start it on the host with" in r.stdout
    assert re.search(r"skip\s+tmux\s+container failed", r.stdout), r.stdout


def test_attach_is_pct_exec_without_ssh(on_host: OnTheHost) -> None:
    host = parse_inventory(on_host.path.read_text(), path=on_host.path, base=on_host.root).get("ct")
    argv = attach_argv(host)
    assert argv[:3] == ["env", "-u", "TMUX"] and argv[3:7] == [str(on_host.pve.pct), "exec", "200", "--"]
    assert argv[7:] == ["tmux", "-L", str(on_host.table["tmux_socket"]), "attach-session", "-t", "=dflash"]
    assert "ssh" not in argv


@pytest.mark.parametrize(
    ("extra", "path", "words"),
    [
        ({"workdir": "rel/dflash"}, "hosts.h.workdir", "absolute path in the container"),
        ({"address": "x"}, "hosts.h.address", 'only for transport = "ssh"'),
    ],
)
def test_a_local_container_host_takes_container_paths(extra: dict[str, str], path: str, words: str) -> None:
    table = {"transport": "local", "container": 200, "command": "x", **extra}
    with pytest.raises(ConfigError) as e:
        parse_inventory(dump_hosts(None, {"h": table}), path=None, base=Path("/somewhere"))
    assert e.value.path == path and words in str(e.value)


def test_a_local_container_host_keeps_the_container_s_python_and_defaults() -> None:
    text = dump_hosts(None, {"h": {"transport": "local", "container": 201, "command": "x", "python": ".venv/bin/py"}})
    h = parse_inventory(text, path=None, base=Path("/somewhere")).get("h")
    assert (h.is_local, h.container, h.python, h.workdir, h.run_dir) == (
        True,
        201,
        ".venv/bin/py",  # the container's, never resolved against this file's folder
        "/root/dflash",
        "/root/dflash/runs",
    )
    without = dump_hosts(None, {"h": {"transport": "local", "command": "x", "pct": "sudo pct"}})
    with pytest.raises(ConfigError) as e:
        parse_inventory(without, path=None, base=Path("/somewhere"))
    assert e.value.path == "hosts.h.pct" and "only for a host with a container" in str(e.value)


def test_on_the_host_the_api_is_this_machine_s() -> None:
    text = dump_hosts(
        None,
        {
            "h": {
                "transport": "local",
                "container": 200,
                "command": "x",
                "proxmox": {"node": "pve", "token_name": "t", "token_value_env": "PVE_TOKEN"},
            }
        },
    )
    api = parse_inventory(text, path=None, base=Path("/x")).get("h").proxmox
    assert api is not None and api.api_host == "localhost"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_hosts_lists_a_local_container_host(on_host: OnTheHost) -> None:
    r = on_host.cli("hosts")
    assert r.exit_code == 0 and re.search(r"\* ct\s+local\s+this machine, ct 200", r.stdout), r.output


def _blind(cli: t.Callable[..., CliResult], state_dir: Path) -> None:
    """With a pct that cannot be run: unreachable (cause unknown) naming it, never not-started; the supervisor says so."""
    st = cli("status", "--json")
    assert st.exit_code == 10, st.output
    doc = json.loads(st.stdout)
    assert (doc["state"], doc["cause"]) == ("unreachable", "unknown"), doc
    assert any("cannot run /nonexistent/pct" in e for e in doc["evidence"]), doc["evidence"]
    from testkit.webhook import Webhook

    with Webhook() as hook:
        once = cli("restart-on-crash", "--once", "--notify", hook.url, "--state-dir", str(state_dir))
        assert "unreachable (unknown)" in once.output and "cannot run /nonexistent/pct" in once.output, once.output
        assert "blind" in once.output and "nothing runs under this session" not in once.output, once.output
        retry_until(lambda: "cannot run /nonexistent/pct" in hook.texts(), 30)  # the supervisor says it is blind


def test_a_pct_that_cannot_run_is_unreachable_not_not_started(on_host: OnTheHost) -> None:
    from testkit.runkit import fake_release

    on_host.table["command"] = ["sh", "-c", "echo step 1; exit 3"]
    on_host.write()
    fake_release(on_host.workdir)
    r = on_host.cli("start")
    assert r.exit_code == 0, r.output
    retry_until(lambda: (on_host.run_dir / "dflash" / "attempt-1" / "exit.json").exists(), 30)
    assert on_host.cli("status").exit_code == 5  # crashed, seen through pct
    on_host.table["pct"] = "/nonexistent/pct"
    on_host.write()
    _blind(on_host.cli, on_host.root / "state")


def test_a_pct_that_runs_but_fails_is_blind_never_not_started(on_host: OnTheHost) -> None:
    """`pct` = /bin/false (a broken wrapper, sudo refusing): it runs, fails and says nothing. Nothing inside
    was read, so a live run is not called not-started: unreachable (unknown) with what was asked and heard."""
    from testkit.runkit import fake_release

    on_host.table["command"] = ["sh", "-c", "echo step 1; sleep 600"]
    on_host.write()
    fake_release(on_host.workdir)
    assert on_host.cli("start").exit_code == 0
    retry_until(lambda: on_host.cli("status").exit_code == 0, 30)  # running, seen through pct
    on_host.table["pct"] = "/bin/false"
    on_host.write()
    try:
        st = on_host.cli("status", "--json")
        assert st.exit_code == 10, st.output
        doc = json.loads(st.stdout)
        assert (doc["state"], doc["cause"]) == ("unreachable", "unknown"), doc
        assert doc["detail"] == (
            "ct (ct 200): nothing inside can be read: the agent failed: exit 1; tmux, asked the same way, exited 1 "
            "without a word (a pct, wrapper or sudo that fails silently?)"
        ), doc["detail"]
        assert (doc["container"] or {}).get("status") != "running", doc["container"]
        once = on_host.cli("restart-on-crash", "--once", "--state-dir", str(on_host.root / "state"))
        assert "unreachable (unknown)" in once.output and "not-started" not in once.output, once.output
    finally:
        on_host.table["pct"] = str(on_host.pve.pct)
        on_host.write()
        assert on_host.cli("stop").exit_code == 0


def test_a_pct_that_cannot_run_on_the_ssh_host_is_unreachable(pve_hosts: t.Any) -> None:
    from testkit.runkit import fake_release

    pve_hosts.write(command=["sh", "-c", "echo step 1; exit 3"])
    fake_release(pve_hosts.workdir)
    assert pve_hosts.cli("start").exit_code == 0
    retry_until(lambda: (pve_hosts.run_dir / "dflash" / "attempt-1" / "exit.json").exists(), 30)
    pve_hosts.write(pct="/nonexistent/pct")
    _blind(pve_hosts.cli, pve_hosts.root / "state")


XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=2841, name=python, GPU has fallen off the bus."


def test_a_gpu_fallen_off_the_bus_is_read_from_the_host_kernel_log_and_never_restarted_into(
    on_host: OnTheHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer only says torch's CUDA error; the Xid is in the Proxmox host's kernel log (journalctl -k),
    which dflashctl on the host reads. restart-on-crash gives up with exit 13 instead of a restart; with
    --on-gpu-fault exclude it restarts without that GPU (DFLASH_EXCLUDED_GPUS), and gives up (13) when the
    GPU it left out faults again, also after its own restart; `gpus --include` puts it back."""
    on_host.table["command"] = train_command(
        "--steps", "3", "--interval", "0.05", "--then", "cuda-launch", "--gpus", "0000:3b:00.0,0000:5e:00.0"
    )
    on_host.write()
    assert on_host.cli("deploy").exit_code == 0
    assert on_host.cli("start").exit_code == 0
    ended = on_host.run_dir / "dflash" / "attempt-1" / "exit.json"
    retry_until(ended.exists, 60)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime())
    on_host.pve.kernel_log(
        f"{stamp} pve kernel: NVRM: GPU at PCI:0000:3b:00: GPU-5e2b6d3c-90a1-4c7f-8d2e-1f0a9b3c4d5e",
        f"{stamp} pve kernel: {XID_79}",
    )
    monkeypatch.setenv("PATH", f"{on_host.pve.bin}:{os.environ['PATH']}")

    st = on_host.cli("status", "--json")
    doc = st.json()
    assert (st.exit_code, doc["state"], doc["cause"], doc["xid"], doc["gpu_bus_id"]) == (
        5,
        "crashed",
        "gpu-fault",
        79,
        "0000:3b:00",
    )
    assert doc["detail"] == XID_79
    assert (
        "the program's last error (python-exception): RuntimeError: CUDA error: unspecified launch failure"
        in (doc["evidence"])
    )
    assert on_host.cli("status").stdout.startswith("crashed: GPU fault: Xid 79 (fallen off the bus) on PCI 0000:3b:00")

    state = str(on_host.root / "state")
    sup = on_host.cli("restart-on-crash", "--interval", "0.5", "--backoff", "0.2", "--state-dir", state, timeout=120)
    assert sup.exit_code == 13, sup.output
    assert "gave up: not restarted into a failed GPU: crashed: GPU fault: Xid 79" in sup.output
    assert not (on_host.run_dir / "dflash" / "attempt-2").exists()
    hist = on_host.cli("history", "--state-dir", state)
    assert "supervisor saw crashed (gpu-fault) of attempt 1 -> give-up" in hist.stdout, hist.output
    row = on_host.cli("history", "--json", "--state-dir", state).json()["attempts"][0]
    assert (row["cause"], row["cause_from"]) == ("gpu-fault", "incident")  # the records alone say python-exception
    _excluded_then_given_up(on_host, state)


def _excluded_then_given_up(on_host: OnTheHost, state: str) -> None:
    """--on-gpu-fault exclude on the crashed attempt 1: attempt 2 runs without 0000:3b:00.0 and crashes; the
    kernel log names the same GPU again: a second fault on it gives up with 13."""
    exclude = ("restart-on-crash", "--interval", "0.5", "--backoff", "0.2", "--on-gpu-fault", "exclude")
    sup = on_host.cli(*exclude, "--state-dir", state, timeout=120)
    assert sup.exit_code == 13, sup.output
    said = "GPU 0000:3b:00.0 (Xid 79) excluded; attempt 2 runs without it (DFLASH_EXCLUDED_GPUS=0000:3b:00.0)"
    assert said in sup.output
    assert (
        "gave up: a second fault on GPU 0000:3b:00.0, which the run already leaves out (excluded after attempt 1)"
        in (sup.output)
    )
    assert "DFLASH_EXCLUDED_GPUS=0000:3b:00.0: 2 drafters -> 1 drafters" in on_host.log(2)  # the run's environment
    assert not (on_host.run_dir / "dflash" / "attempt-3").exists()
    doc = on_host.cli("status", "--json").json()
    assert (doc["attempt"], doc["cause"], doc["excluded_gpus"]) == (2, "gpu-fault", ["0000:3b:00.0"])
    assert "  excluded:  0000:3b:00.0 (this attempt runs without" in on_host.cli("status").stdout
    hist = on_host.cli("history", "--state-dir", state).stdout
    assert (
        "supervisor saw crashed (gpu-fault) of attempt 1 -> restart: done, attempt 2 started; GPU 0000:3b:00.0 "
        "(Xid 79) excluded; attempt 2 runs without it" in hist
    ), hist

    # the set outlives the supervisor: a new one gives up on the same fault again
    once = on_host.cli(*exclude, "--once", "--state-dir", state, timeout=120)
    assert once.exit_code == 13 and "a second fault on GPU 0000:3b:00.0" in once.output, once.output
    listed = on_host.cli("gpus", "--state-dir", state)
    assert "the next attempt the supervisor starts runs without 1 GPU(s)" in listed.stdout
    assert "  0000:3b:00.0  NVRM: Xid (PCI:0000:3b:00): 79" in listed.stdout, listed.output
    bad = on_host.cli("gpus", "--state-dir", state, "--include", "b3")
    assert bad.exit_code == 1 and "not a PCI bus id" in bad.stderr and "Traceback" not in bad.output
    back = on_host.cli("gpus", "--state-dir", state, "--include", "3b:00")
    assert back.exit_code == 0 and "GPU 0000:3b:00.0 put back" in back.stdout, back.output
    twice = on_host.cli("gpus", "--state-dir", state, "--include", "3b:00").stdout
    assert "GPU 3b:00 was not excluded: nothing to put back\nct/dflash: no GPU excluded" in twice, twice
