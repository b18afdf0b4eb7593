"""`dflashctl supervise install` puts the supervisor on the Proxmox host, where it
cannot fall asleep.

Real parts: the REAL dflashctl on "the laptop" (a subprocess with its own HOME), the real sshd on
127.0.0.1 as "the Proxmox host" (this machine), the fake Proxmox host's pct and container 200 (a real
pid+mount namespace), a real deploy of dflashctl's code onto the host, the supervisor in a real tmux
session on its own socket on the host (systemd is not PID 1 here), the resuming fake trainer in the
container. Faults from outside, as on a real box: kill -9, pct reboot, pct stop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest

from ops.supervise import unit
from ops.supervise.policy import Options
from testkit import PveHosts, TmuxServers, forkserver, pid_alive, retry_until
from testkit.runkit import LEAKY_TOKEN, fake_release, leaked, leaky_command, reap_runs, train_command

VMID = 200
K = 5  # the fake trainer checkpoints every K steps
FAST = ("--interval", "1", "--backoff", "0.2", "--max-backoff", "1")
NOTIFY = "json://127.0.0.1:9/hook?token=s3cret"  # a port nothing listens on: only where the URL is kept matters here


class Night:
    """The laptop's hosts.toml (host ``pve`` with ``[hosts.pve.supervise]`` in a test folder), the
    training run in container 200, and the supervisor's files on the host."""

    def __init__(self, hosts: PveHosts, tmux: TmuxServers, tmp_path: Path) -> None:
        self.hosts = hosts
        self.pve = hosts.pve
        self.socket = tmux.new()  # the supervisor's tmux on the host (reaped by the fixture)
        self.dir = tmp_path / "host-dflashctl"  # on the host: /var/lib/dflashctl in real life
        self.shared = hosts.workdir.parent
        self.shared.mkdir(parents=True, exist_ok=True)
        self.finish = self.shared / "finish"
        cmd = train_command(
            "--steps",
            "1",
            "--interval",
            "0.1",
            "--until",
            str(self.finish),
            "--checkpoint",
            str(self.shared / "ckpt.json"),
            "--every",
            str(K),
        )
        hosts.write(
            command=cmd,
            hang_after=600,
            startup_grace=0,
            supervise={"dir": str(self.dir), "python": _python(), "mode": "tmux", "tmux_socket": self.socket},
        )
        fake_release(hosts.workdir)

    @property
    def sdir(self) -> Path:
        return self.dir / "sessions" / "dflash"

    def cli(self, *args: str, timeout: float = 300) -> t.Any:
        return self.hosts.cli(*args, timeout=timeout)

    def start(self) -> None:
        r = self.cli("start")
        assert r.exit_code == 0, r.output
        retry_until(lambda: len(self.steps(1)) >= 2, 30)

    def install(self, *args: str) -> t.Any:
        r = self.cli("supervise", "install", *FAST, *args)
        assert r.exit_code == 0, r.output
        return r

    def status(self) -> dict[str, t.Any]:
        r = self.cli("status", "--json")
        assert r.stdout.strip(), r.stderr
        return t.cast(dict[str, t.Any], json.loads(r.stdout))

    def log(self, n: int) -> str:
        p = self.hosts.run_dir / "dflash" / f"attempt-{n}" / "train.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def steps(self, n: int) -> list[int]:
        return [int(x) for x in re.findall(r"^step (\d+) \|", self.log(n), re.M)]

    def attempts(self) -> list[int]:
        return sorted(int(p.name.split("-")[1]) for p in (self.hosts.run_dir / "dflash").glob("attempt-*"))

    def run_json(self, n: int) -> dict[str, t.Any]:
        p = self.hosts.run_dir / "dflash" / f"attempt-{n}" / "run.json"
        return t.cast(dict[str, t.Any], retry_until(lambda: p.exists() and json.loads(p.read_text()), 30))

    def incidents(self) -> list[dict[str, t.Any]]:
        return [json.loads(p.read_text()) for p in sorted((self.sdir / "incidents").glob("*.json"))]

    def supervisor_pid(self) -> int | None:
        """The host's supervisor, by its lock (the kernel's flock: a dead one holds nothing)."""
        from ops.supervise.service import lock_holder

        holder = lock_holder(str(self.sdir / "supervise" / "pve.dflash.lock"))
        pid = (holder or {}).get("pid")
        return pid if isinstance(pid, int) else None

    def resumed(self, old: int, new: int) -> None:
        """The new attempt starts right after a checkpoint of the old one: nothing lost beyond K steps."""
        m = retry_until(lambda: re.search(r"^resumed from checkpoint at step (\d+)$", self.log(new), re.M), 60)
        ckpt = int(m.group(1))
        assert ckpt % K == 0 and ckpt in self.steps(old)
        retry_until(lambda: self.steps(new)[:1] == [ckpt + 1], 30)

    def close(self) -> None:
        self.finish.touch()
        reap_runs(self.hosts.run_dir)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _python() -> str:
    return sys.executable


def _outputs(proc: t.Any) -> tuple[str, str]:
    """A spawned command's stdout and stderr once it has ended (a few lines: no pipe fills meanwhile)."""
    return proc.stdout.read(), proc.stderr.read()


def _said(proc: t.Any) -> str:
    return "".join(_outputs(proc))


@pytest.fixture
def night(pve_hosts: PveHosts, tmux_servers: TmuxServers, tmp_path: Path) -> t.Iterator[Night]:
    n = Night(pve_hosts, tmux_servers, tmp_path)
    try:
        yield n
    finally:
        n.close()


def test_installed_supervisor_restarts_a_killed_run_and_recovers_the_container(night: Night) -> None:
    night.start()
    r = night.install("--start-container", "--notify", NOTIFY)
    # the operator's CLI has exited (subprocess.run returned): the supervisor lives on the host
    assert re.search(r"installed the supervisor of pve/dflash on pve: tmux session on socket \S+, pid \d+", r.stdout)
    assert "first probe: running: " in r.stdout, r.stdout
    pid = night.supervisor_pid()
    assert pid is not None and pid_alive(pid)
    service = json.loads((night.sdir / "service.json").read_text())
    assert (service["mode"], service["by"], service["options"]["interval"]) == ("tmux", "pve", 1.0)
    assert (night.sdir / "env.json").stat().st_mode & 0o777 == 0o600
    # a --notify URL (it may hold a token) is in the 0600 env.json only: never on a command line or in a message
    assert json.loads((night.sdir / "env.json").read_text())["notify"] == [NOTIFY]
    seen = [r.output, (night.sdir / "service.json").read_text(), (night.sdir / "hosts.toml").read_text()]
    seen += [Path(f"/proc/{p}/cmdline").read_bytes().decode() for p in (pid, _parent(pid))]
    assert not [s for s in seen if "s3cret" in s]
    # the host entry it watches through: the container as a local host, no ssh
    entry = (night.sdir / "hosts.toml").read_text()
    assert 'transport = "local"' in entry and "container = 200" in entry and "address" not in entry

    sv = retry_until(lambda: (s := night.status()["supervisor"])["state"] == "watching" and s, 30)
    assert (sv["by"], sv["mode"], sv["pid"], sv["interval"]) == ("pve", "tmux", pid, 1.0)
    assert re.search(r"  watch:     supervised by pve \(tmux, last probe \d+ s ago\)", night.cli("status").stdout)

    # 1. a SIGKILLed training run: restarted by the host's supervisor, from its checkpoint
    retry_until(lambda: len(night.steps(1)) >= K + 2, 30)
    assert night.pve.run_in(VMID, ["kill", "-KILL", str(night.run_json(1)["child_pid"])]).returncode == 0
    retry_until(lambda: night.attempts() == [1, 2], 60)
    night.resumed(1, 2)
    inc = retry_until(lambda: [i for i in night.incidents() if i.get("outcome") == "done"], 30)[-1]
    assert (inc["state"], inc["cause"], inc["signal"], inc["action"], inc["next_attempt"]) == (
        "crashed",
        "signal",
        9,
        "restart",
        2,
    )

    # 2. pct reboot 200: the run died with the container; restarted once it is up
    retry_until(lambda: len(night.steps(2)) >= K + 2, 30)
    night.pve.reboot(VMID)
    retry_until(lambda: night.attempts() == [1, 2, 3], 60)
    night.resumed(2, 3)

    # 3. pct stop 200: --start-container starts it (pct, local on the host), then the run is restarted
    retry_until(lambda: len(night.steps(3)) >= K + 2, 30)
    night.pve.stop(VMID)
    retry_until(lambda: night.attempts() == [1, 2, 3, 4], 90)
    assert night.pve.init_pid(VMID) is not None
    night.resumed(3, 4)
    kinds = [(i["state"], i["action"], i["outcome"]) for i in night.incidents()]
    assert ("container-down", "start-container", "done") in kinds, kinds
    assert night.supervisor_pid() == pid  # one supervisor did it all

    # what the laptop sees: supervise status and logs
    st = night.cli("supervise", "status")
    assert st.exit_code == 0, st.output
    assert re.search(rf"supervisor of pve/dflash on pve: running \(tmux, pid {pid}, since ", st.stdout), st.stdout
    assert re.search(r"  last probe:  \S+: running: step \d+", st.stdout), st.stdout
    assert re.search(
        r"  last action: \S+: restart \(done\) after lost \(container-restart\), attempt 3, attempt 4 started",
        st.stdout,
    ), st.stdout
    assert re.search(r"  incidents:   \d+ \(newest last\)", st.stdout)
    assert re.search(r"\n    \S+  container-down \(stopped\): start-container done\n", st.stdout), st.stdout
    logs = night.cli("supervise", "logs", "-n", "200")
    assert logs.exit_code == 0
    assert "restarted: attempt 2 started" in logs.stdout and "container 200 started; re-probing" in logs.stdout
    assert "restarted: attempt 4 started" in logs.stdout
    doc = json.loads(night.cli("supervise", "status", "--json").stdout)
    assert doc["running"] and doc["status"]["last_action"]["next_attempt"] == 4
    assert "s3cret" not in logs.output + st.output + json.dumps(doc)

    # the supervisor started again (an update here; systemd's or the loop's restart alike) still knows its
    # last action: the newest incident, from its state dir
    night.install("--start-container")
    again = night.cli("supervise", "status")
    assert night.supervisor_pid() not in (None, pid)
    assert "  last action: " in again.stdout and "attempt 3, attempt 4 started" in again.stdout, again.stdout


def test_the_installed_supervisor_restarts_without_a_failed_gpu_and_gives_up_on_a_second_fault(night: Night) -> None:
    """--on-gpu-fault exclude on the host: the Xid is in the host's kernel log, which the supervisor there
    reads; attempt 2 runs without the GPU, the same GPU faults again: a give-up, and it watches on. The
    excluded set outlives the supervisor's restart; `supervise gpus --include` puts the GPU back."""
    import time

    control = night.shared / "control"
    night.hosts.write(
        command=train_command(
            "--steps", "1", "--interval", "0.1", "--until", str(night.finish), "--control", str(control),
            "--gpus", "0000:3b:00.0,5e:00",
        )
    )  # fmt: skip
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime())
    night.pve.kernel_log(
        f"{stamp} pve kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=2841, name=python, GPU has fallen off the bus."
    )
    night.start()
    night.install("--on-gpu-fault", "exclude")
    # The host's journalctl is the fake one: its folder goes first on the supervisor's PATH, through env.json (the
    # environment the supervisor takes at its start; tmux gives a new session the PATH of the ssh login that asks)
    env_json = night.sdir / unit.ENV_JSON
    doc = json.loads(env_json.read_text())
    doc["env"]["PATH"] = f"{night.pve.bin}:{os.environ['PATH']}"
    env_json.write_text(json.dumps(doc))
    first = night.supervisor_pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)  # its tmux loop starts it again after 10 s, with that PATH
    retry_until(lambda: night.supervisor_pid() not in (None, first), 40, interval=0.5)  # the tmux loop waits 10 s

    control.write_text("always:cuda-launch\n")
    gave_up = retry_until(lambda: [i for i in night.incidents() if i["action"] == "give-up"], 60)
    assert gave_up[0]["reason"].startswith(
        "a second fault on GPU 0000:3b:00.0, which the run already leaves out (excluded after attempt 1)"
    )
    [restart] = [i for i in night.incidents() if i["action"] == "restart"]
    assert restart["excluded"] == "GPU 0000:3b:00.0 (Xid 79) excluded; attempt 2 runs without it"
    assert restart["excluded_gpus"] == ["0000:3b:00.0"] and restart["gpu_health"][0].startswith(
        "gpu-health: not checked"
    )
    assert night.run_json(2)["started_by"]["excluded_gpus"] == ["0000:3b:00.0"]
    assert "DFLASH_EXCLUDED_GPUS=0000:3b:00.0: 2 drafters -> 1 drafters" in night.log(2)
    assert night.status()["excluded_gpus"] == ["0000:3b:00.0"] and night.attempts() == [1, 2]
    assert night.supervisor_pid() is not None  # it watches on
    listed = night.cli("supervise", "gpus")
    assert "pve/dflash: the next attempt the supervisor starts runs without 1 GPU(s)" in listed.stdout, listed.output
    back = night.cli("supervise", "gpus", "--include", "3b:00", "--json")
    assert back.exit_code == 0 and [e["bus_id"] for e in back.json()["included"]] == ["0000:3b:00.0"], back.output
    assert back.json()["excluded"] == []


def test_a_killed_supervisor_is_stale_in_status_and_the_loop_starts_it_again(night: Night) -> None:
    night.start()
    night.install()
    first = night.supervisor_pid()
    assert first is not None
    # SIGKILL: no farewell. The tmux loop (Restart=always) starts it again after 10 s: meanwhile, stale.
    os.kill(first, signal.SIGKILL)
    # each look is `dflashctl status` over ssh (~0.3 s of CPU): once a second, for what takes 3 intervals
    sv = retry_until(
        lambda: (s := night.status()).get("supervisor", {}).get("state") == "stale" and s, 40, interval=1.0
    )
    assert sv["state"] == "running"  # the run's state is not the supervisor's fault
    assert any(e.startswith("supervisor: STALE: the supervisor pve (tmux, pid ") for e in sv["evidence"]), sv
    human = night.cli("status")
    assert human.exit_code == 0 and "  watch:     STALE: the supervisor pve (tmux, pid" in human.stdout
    second = retry_until(lambda: (p := night.supervisor_pid()) not in (None, first) and p, 30, interval=0.5)
    assert retry_until(lambda: night.status()["supervisor"]["state"] == "watching", 30, interval=0.5)
    assert night.status()["supervisor"]["pid"] == second  # the same installed supervisor took its lease back

    # killed for good (the loop too): stale, and it stays stale
    loop = _parent(second)  # the sh loop of the launcher
    os.kill(loop, signal.SIGKILL)
    os.kill(second, signal.SIGKILL)
    retry_until(lambda: night.status()["supervisor"]["state"] == "stale", 40, interval=1.0)
    st = night.cli("supervise", "status")
    assert st.exit_code == 8 and "supervisor of pve/dflash on pve: NOT running (tmux)" in st.stdout, st.output


def test_install_twice_is_one_supervisor_with_the_new_policy_and_stop_and_uninstall(night: Night) -> None:
    night.start()
    night.install()
    first = night.supervisor_pid()
    again = night.cli("supervise", "install", "--interval", "2", "--max-restarts", "3")
    assert again.exit_code == 0, again.output
    assert "updated the supervisor of pve/dflash" in again.stdout
    assert f"replaced:    the supervisor that ran before (pid {first})" in again.stdout
    second = night.supervisor_pid()
    assert second not in (None, first) and first is not None and not pid_alive(first)
    panes = subprocess.run(
        ["tmux", "-L", night.socket, "list-sessions", "-F", "#{session_name}"], capture_output=True, text=True
    )
    assert panes.stdout.split() == ["dflash"]  # one supervisor
    service = json.loads((night.sdir / "service.json").read_text())
    assert (service["options"]["interval"], service["options"]["max_restarts"]) == (2.0, 3)
    cmdline = Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")
    assert b"--interval" in cmdline and cmdline[cmdline.index(b"--interval") + 1] == b"2"

    stopped = night.cli("supervise", "stop")
    assert stopped.exit_code == 0, stopped.output
    assert f"stopped the supervisor of pve/dflash (tmux, pid {second}); the run is left as it is" in stopped.stdout
    assert night.supervisor_pid() is None and night.status()["state"] == "running"
    # it said goodbye: not supervised (not stale)
    sv = night.status()["supervisor"]
    assert sv["state"] == "stopped", sv
    assert "  watch:     not supervised (the supervisor pve (tmux) stopped" in night.cli("status").stdout

    gone = night.cli("supervise", "uninstall")
    assert gone.exit_code == 0, gone.output
    assert not (night.sdir / "env.json").exists() and not (night.dir / "current").exists()
    assert (night.sdir / "supervisor.log").exists()  # the incidents and the log stay
    none = night.cli("supervise", "status")
    assert none.exit_code == 7 and "no supervisor is installed for pve/dflash on pve" in none.stdout, none.output


def test_install_is_refused_while_another_supervisor_watches_and_so_is_a_laptop_one(night: Night) -> None:
    night.start()
    # restart-on-crash on the laptop, in the foreground
    argv = ["--hosts", str(night.hosts.path), "restart-on-crash", *FAST]
    argv += ["--state-dir", str(night.dir.parent / "laptop-state")]
    laptop = forkserver.shared("dflashctl").spawn(argv, env=night.hosts.env())  # the real command, forked
    try:
        retry_until(lambda: (night.status().get("supervisor") or {}).get("mode") == "foreground", 30, interval=0.5)
        r = night.cli("supervise", "install")
        assert r.exit_code == 1, r.output
        [line] = [x for x in r.stderr.splitlines() if x.strip()]
        assert re.fullmatch(
            r"dflashctl: another supervisor watches pve/dflash: \S+ \(foreground, pid \d+ on \S+\), last probe "
            r"[\d.]+s ago; stop it first \(Ctrl-C or kill <pid>\), or wait until it is stale \(3 of its intervals\)",
            line,
        ), line
        assert night.supervisor_pid() is None  # nothing started on the host
    finally:
        laptop.send_signal(signal.SIGTERM)
        laptop.wait(60)
        out = _said(laptop)
    assert laptop.returncode == 0, out
    # it stopped on purpose: its lease ended at once, the host's supervisor installs now
    night.install()
    again = night.cli("restart-on-crash", "--once", "--state-dir", str(night.dir.parent / "laptop-state"))
    assert again.exit_code == 1, again.output
    assert "dflashctl: another supervisor watches pve/dflash: pve (tmux, pid" in again.stderr
    assert "stop it first (`dflashctl supervise stop`)" in again.stderr


def test_install_refuses_a_host_python_too_old_or_missing_before_sending_anything(night: Night, tmp_path: Path) -> None:
    # A DOUBLE of Python 3.9 (Proxmox VE 7's python3; this machine has none): the real interpreter running
    # the -c program it is given, with 3.9's sys.version_info.
    old = tmp_path / "python3.9"
    old.write_text(
        f"#!{sys.executable} -S\n"
        "import sys\n"
        "args = sys.argv[1:]\n"
        "code = args[args.index('-c') + 1]\n"
        "sys.argv = ['-c', *args[args.index('-c') + 2:]]\n"
        "sys.version_info = (3, 9, 2, 'final', 0)\n"
        "exec(compile(code, '<string>', 'exec'), {'__name__': '__main__'})\n"
    )
    old.chmod(0o755)
    place = {"dir": str(night.dir), "mode": "tmux", "tmux_socket": night.socket}
    night.hosts.write(supervise={**place, "python": str(old)})
    r = night.cli("supervise", "install")
    assert r.exit_code == 1, r.output
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert line == (
        f"dflashctl: pve: {old} on the host is Python 3.9.2: the supervisor needs Python 3.11 or newer "
        "(Proxmox VE 8 has it); set hosts.pve.supervise.python"
    ), r.output
    assert not night.dir.exists()  # no release was sent

    night.hosts.write(supervise={**place, "python": str(tmp_path / "no-python")})
    r = night.cli("supervise", "install")
    assert r.exit_code == 1, r.output
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith(f"dflashctl: pve: cannot run '{tmp_path / 'no-python'}' there (") and line.endswith(
        "); set hosts.pve.supervise.python"
    ), r.output
    assert not night.dir.exists()


def test_the_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd): the unit text is not verified")
    root = tmp_path / "var lib" / "dflash%ctl"  # a space and a % : ExecStart's quoting and specifiers
    (root / "bin").mkdir(parents=True)
    launcher = root / unit.LAUNCHER
    launcher.write_text(unit.launcher_text(str(root), "/usr/bin/python3"))
    launcher.chmod(0o755)
    opts = Options(interval=30, start_container=True, retry_oom=True)
    path = tmp_path / unit.unit_name("dflash")
    path.write_text(unit.unit_text(str(root), "dflash", opts))
    r = subprocess.run([tool, "verify", str(path)], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in r.stderr.splitlines() if str(path.name) in ln or "ExecStart" in ln]
    assert r.returncode == 0 and not problems, r.stderr
    text = path.read_text()
    assert "Restart=always" in text and "RestartSec=10" in text and "KillMode=process" in text
    exec_start = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    assert "/var lib/dflash%%ctl/bin/" in exec_start
    assert exec_start.endswith('"--retry-oom" "--on-diverged" "give-up" "--on-gpu-fault" "give-up"')


def test_the_launcher_and_the_options_round_trip() -> None:
    from ops.supervise.service import options_parser

    opts = Options(
        interval=7.5, backoff=3, max_backoff=30, min_uptime=60, max_restarts=2, window=99, retry_oom=True,
        on_diverged="resume-from-last-finite",
    )  # fmt: skip
    argv = unit.options_argv(opts)
    assert argv == [
        "--interval", "7.5", "--backoff", "3", "--max-backoff", "30", "--min-uptime", "60",
        "--max-restarts", "2", "--window", "99", "--retry-oom", "--on-diverged", "resume-from-last-finite",
        "--on-gpu-fault", "give-up",
    ]  # fmt: skip
    assert Options(**vars(options_parser().parse_args(argv))) == opts
    sh = unit.launcher_text("/var/lib/it's", "/usr/bin/python3")
    r = subprocess.run(["sh", "-n", "-c", sh], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "dir='/var/lib/it'\"'\"'s'" in sh


def test_the_host_side_loads_nothing_but_the_stdlib_and_ops() -> None:
    """What the supervisor on the Proxmox host really loads, with no site-packages at all (-I -S): the
    host's python needs nothing installed (no click, no paramiko, no proxmoxer)."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1])\n"
        "import ops.supervise.service\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(repo)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    ours = [m for m in json.loads(p.stdout) if m.split(".")[0] not in sys.stdlib_module_names and m != "__main__"]
    assert (
        "ops.supervise.loop" in ours and "ops.wire" in ours and all(m == "ops" or m.startswith("ops.") for m in ours)
    ), ours


HF_TOKEN = "hf_Zq8secretTOKENvalue42"


def test_the_installed_supervisor_scrubs_the_host_entrys_env_like_restart_on_crash(night: Night) -> None:
    pytest.importorskip("apprise")
    from ops.notify import REDACTED
    from testkit.webhook import Webhook

    # the run prints a secret of its env as its last line (a careless script), then fails
    cmd = list(t.cast(list[str], night.hosts.pve_table["command"]))
    wrapped = ["sh", "-c", '"$@"; echo "HF_TOKEN=$HF_TOKEN"; exit 3', "sh", *cmd]
    night.hosts.write(env={"HF_TOKEN": HF_TOKEN}, command=wrapped)
    night.start()
    with Webhook() as hook:
        night.install("--notify", hook.url)
        retry_until(lambda: any("supervisor started" in x for x in hook.titles()), 60)
        night.finish.touch()  # the trainer ends; the script prints the secret and exits 3
        retry_until(lambda: any(": crashed (" in x for x in hook.titles()), 90)
        assert f"HF_TOKEN={HF_TOKEN}" in night.log(1), "the secret is in the log..."
        text = hook.texts()
        assert HF_TOKEN not in text, "... and in no message"
        assert f"HF_TOKEN={REDACTED}" in text


def test_the_installed_supervisor_says_no_form_of_a_secret_nor_its_head_anywhere(night: Night) -> None:
    """The run prints HF_TOKEN percent-encoded, JSON- and repr-escaped, and crashes with it straddling the
    evidence's cut: the webhook, supervisor.log, the incidents, status.json, the heartbeat in the run dir and
    `supervise status` carry no form of it, nor its head."""
    pytest.importorskip("apprise")
    from testkit.webhook import Webhook

    cmd = list(t.cast(list[str], night.hosts.pve_table["command"]))
    night.hosts.write(env={"HF_TOKEN": LEAKY_TOKEN}, command=leaky_command(cmd))
    night.start()
    with Webhook() as hook:
        night.install("--notify", hook.url)
        retry_until(lambda: any("supervisor started" in x for x in hook.titles()), 60)
        night.finish.touch()  # the trainer ends; the leak prints the token and raises
        retry_until(lambda: any(": crashed (" in x for x in hook.titles()), 90)
        retry_until(lambda: len(night.attempts()) >= 2, 60)
        assert "huggingface.co/api/whoami?token=hf_h5%2FSecret%2BToken%3DZq8%22w%5C9" in night.log(1)
        st = night.cli("supervise", "status", "--json")
        said = {
            "messages": hook.texts(),
            "supervisor.log": (night.sdir / unit.LOG).read_text(),
            "incidents": json.dumps(night.incidents()),
            "status.json": (night.sdir / unit.STATUS_JSON).read_text(),
            "heartbeat": (night.hosts.run_dir / "dflash" / "supervisor.json").read_text(),
            "supervise status": st.output,
        }
    assert {where: leaked(text) for where, text in said.items()} == dict.fromkeys(said, [])


def test_install_refuses_a_notify_url_apprise_does_not_understand_in_one_line(night: Night) -> None:
    pytest.importorskip("apprise")
    night.start()
    r = night.cli("supervise", "install", *FAST, "--notify", "notaurl")
    assert r.exit_code == 1, r.output
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert line == (
        "dflashctl: --notify #1 (?://...): apprise does not understand this URL "
        "(https://appriseit.com/services/ lists them) (on pve)"
    ), r.output
    assert night.supervisor_pid() is None and not (night.sdir / "service.json").exists()  # nothing started


def _tree_of(root: Path) -> dict[str, str]:
    """Every path under ``root`` with what it is: a file's text, a link's target, a folder."""
    out: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_text()
    return out


def test_install_and_uninstall_touch_only_what_they_wrote(night: Night, tmp_path: Path) -> None:
    place = {"python": _python(), "mode": "tmux", "tmux_socket": night.socket}
    # a folder of the user's: install refuses it, and changes nothing in it
    mine = tmp_path / "mine"
    (mine / "bin").mkdir(parents=True)
    (mine / "bin" / "backup.sh").write_text("#!/bin/sh\necho backup\n")
    (mine / "releases" / "myapp-1.0").mkdir(parents=True)
    (mine / "releases" / "myapp-1.0" / "app.py").write_text("print('mine')\n")
    (mine / "previous").write_text("the user's file called previous\n")
    os.symlink("releases/myapp-1.0", mine / "current")
    before = _tree_of(mine)
    night.hosts.write(supervise={**place, "dir": str(mine)})
    r = night.cli("supervise", "install", *FAST)
    assert r.exit_code == 1, r.output
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith(
        f"dflashctl: hosts.pve.supervise.dir: {mine} on pve holds files dflashctl did not write "
        "(bin, current, previous, releases): supervise installs only into a new or empty folder"
    ), line
    assert _tree_of(mine) == before

    # a system folder, a path that is not normalised or not absolute: refused where hosts.toml is read
    for bad in ("/", "/usr/local", "/root", "/tmp/../etc", "/var/lib/dflashctl/", "var/lib/dflashctl"):
        night.hosts.write(supervise={**place, "dir": bad})
        r = night.cli("supervise", "status")
        assert r.exit_code == 1, (bad, r.output)
        [line] = [x for x in r.stderr.splitlines() if x.strip()]
        assert line.startswith("dflashctl: hosts.pve.supervise.dir: "), (bad, line)

    # its own folder, with the user's files put in it later: uninstall removes its own only
    night.hosts.write(supervise={**place, "dir": str(night.dir)})
    night.start()
    night.install()
    assert (night.dir / unit.MARKER).is_file()
    (night.dir / "bin" / "backup.sh").write_text("#!/bin/sh\n")
    (night.dir / "releases" / "myapp-1.0").mkdir()
    (night.dir / "notes.txt").write_text("mine\n")
    gone = night.cli("supervise", "uninstall")
    assert gone.exit_code == 0, gone.output
    assert (
        f"  removed {night.dir / unit.LAUNCHER}\n" in gone.stdout and f"  removed {night.dir}/bin\n" not in gone.stdout
    )
    assert (night.dir / "bin" / "backup.sh").read_text() == "#!/bin/sh\n"
    assert (night.dir / "releases" / "myapp-1.0").is_dir() and (night.dir / "notes.txt").read_text() == "mine\n"
    assert not (night.dir / unit.LAUNCHER).exists() and not os.path.lexists(night.dir / "current")
    assert [p.name for p in (night.dir / "releases").iterdir()] == ["myapp-1.0"]  # deploy's releases went
    assert (night.sdir / "supervisor.log").exists() and (night.dir / unit.MARKER).is_file()


def test_a_dir_below_a_link_to_a_system_folder_is_refused_on_the_host_and_nothing_is_written(
    night: Night, tmp_path: Path
) -> None:
    """``dir = <link to /var>/local`` is /var/local on the host: refused where the host sees it (install's claim
    and every verb of the host's service), and /var/local is left as it was."""
    link = tmp_path / "x"
    link.symlink_to("/var")
    place = {"python": _python(), "mode": "tmux", "tmux_socket": night.socket, "dir": str(link / "local")}
    before = sorted(os.listdir("/var/local"))
    night.hosts.write(supervise=place)
    r = night.cli("supervise", "install", *FAST)
    assert r.exit_code == 1, r.output
    [line] = [x for x in r.stderr.splitlines() if x.strip()]
    assert line.startswith(
        f"dflashctl: hosts.pve.supervise.dir: {link}/local on pve is /var/local through a link: "
        "a folder of the system itself: supervise installs only into a new or empty folder"
    ), line
    assert sorted(os.listdir("/var/local")) == before
    repo = Path(__file__).resolve().parents[2]
    code = "import sys; sys.path.insert(0, sys.argv[1]); from ops.supervise import service; sys.exit(service.main(sys.argv[2:]))"
    req = json.dumps({"dir": str(link / "local"), "session": "dflash"})
    for verb in ("install", "uninstall", "status"):
        p = subprocess.run(
            [sys.executable, "-I", "-c", code, str(repo), verb], input=req, capture_output=True, text=True, timeout=60
        )
        a = json.loads(p.stdout)
        assert (p.returncode, a["error"]) == (2, "bad-request"), p.stdout
        assert a["message"] == (
            f"{verb}: bad request: dir: {link}/local is /var/local through a link: a folder of the system itself; "
            "give a folder of dflashctl's own"
        )
    assert sorted(os.listdir("/var/local")) == before


def test_two_installs_at_once_one_runs_and_says_so_the_other_is_refused(night: Night) -> None:
    night.start()
    night.install()  # deployed: the two below race on the host-side install only
    argv = ["--hosts", str(night.hosts.path), "supervise", "install", *FAST]
    server = forkserver.shared("dflashctl")  # each a fork of the real command, side by side
    procs = [
        server.spawn([*argv, "--max-restarts", str(n)], env=night.hosts.env(), cwd=night.hosts.root) for n in (3, 4)
    ]
    outs = [(p.wait(300), *_outputs(p)) for p in procs]
    ok = [o for o in outs if o[0] == 0]
    refused = [o for o in outs if o[0] != 0]
    service = json.loads((night.sdir / "service.json").read_text())
    pid = night.supervisor_pid()
    assert pid is not None
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    running = int(cmdline[cmdline.index(b"--max-restarts") + 1])
    assert service["options"]["max_restarts"] == running
    # the install whose policy runs reported the supervisor that runs
    [winner] = [out for _, out, _ in ok if f"--max-restarts {running}" in out]
    assert re.search(rf"on socket \S+, pid {pid}\n", winner), winner
    if refused:  # they overlapped on the host: the second was refused in one line, nothing changed
        [(_, _, err)] = refused
        assert re.search(r"another `supervise install` runs on this host now \(pid \d+\): nothing was changed", err)
        assert len(ok) == 1 and f"--max-restarts {running}" in ok[0][1], ok


def test_a_refused_install_names_the_holder_that_writes_its_pid_late_and_never_pid_none(tmp_path: Path) -> None:
    """The lock holder writes its pid just after taking the lock: a second install looking in between waited
    for nothing and said "(pid None)" (a CI run hit it). It now waits for the pid; with none, it names no pid."""
    import fcntl
    import threading

    from ops.supervise.service import Failed, _install_lock

    (tmp_path / unit.MARKER).write_text("{}\n")
    lock = tmp_path / unit.INSTALL_LOCK
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        late = threading.Timer(0.3, lambda: os.pwrite(fd, b'{"pid": 4242, "verb": "uninstall"}', 0))
        late.start()
        with pytest.raises(Failed) as e, _install_lock(str(tmp_path), "install"):
            pass
        late.join()
        assert "another `supervise uninstall` runs on this host now (pid 4242): nothing was changed" in str(e.value)
        os.ftruncate(fd, 0)  # a holder that never says who it is
        with pytest.raises(Failed) as e, _install_lock(str(tmp_path), "install"):
            pass
        assert "another `supervise install` runs on this host now: nothing was changed" in str(e.value)
        assert "None" not in str(e.value)
    finally:
        os.close(fd)


# unit.BOOT (argv 2) once per (file, text, verb, request) read as JSON from stdin, in this one interpreter: the
# record written, the request on stdin, the answer line from stdout and the exit code kept; prints them as JSON
_BOOTS = """
import contextlib, io, json, sys
repo, boot = sys.argv[1], sys.argv[2]
said = []
for path, text, verb, req in json.load(sys.stdin):
    with open(path, "w") as f:
        f.write(text)
    out = io.StringIO()
    sys.argv, sys.stdin = ["-c", repo, verb], io.StringIO(req)
    code = None
    with contextlib.redirect_stdout(out):
        try:
            exec(boot, {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code
    said.append([code, out.getvalue()])
print(json.dumps(said))
"""


def test_the_host_side_reads_its_own_files_checked_one_line_naming_file_and_key(tmp_path: Path) -> None:
    """service.json and env.json mangled (by hand, an older version, a crash): the host-side program and
    the supervisor itself say one line naming the file and the key, never a traceback."""
    repo = str(Path(__file__).resolve().parents[2])
    root = tmp_path / "host-dflashctl"
    sdir = root / "sessions" / "dflash"
    sdir.mkdir(parents=True)
    (root / unit.MARKER).write_text("{}\n")
    good = {"id": "ab12", "by": "pve", "mode": "tmux", "tmux_socket": "s", "container": 200, "options": {}}
    service = sdir / unit.SERVICE_JSON

    def host(verb: str) -> dict[str, t.Any]:
        req = json.dumps({"dir": str(root), "session": "dflash"})
        p = subprocess.run(
            [sys.executable, "-I", "-c", unit.BOOT, repo, verb], input=req, capture_output=True, text=True, timeout=60
        )
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
        [line] = p.stdout.splitlines()
        return t.cast(dict[str, t.Any], json.loads(line))

    cases = {
        json.dumps({k: v for k, v in good.items() if k != "by"}): "by: missing",
        json.dumps({**good, "mode": 5}): "mode: expected str, got int 5",
        json.dumps({**good, "container": "200"}): 'container: expected int, got str "200"',
        json.dumps({**good, "options": {"interval": "fast"}}): "options: ",
        json.dumps({**good, "options": {"bogus": 1}}): "options: ",
        '{"id": "ab12", "by": "pve", "mode": "tmux", "tmux_socket": "s", "options": {"interval": NaN}}': (
            "not JSON: NaN is not a number JSON allows"
        ),
        "[" * 100_000 + "]" * 100_000: "nested too deeply",
        "x" * (2 << 20): "bigger than 1 MiB",
    }
    verbs = ("status", "stop", "uninstall")
    first, *rest = cases.items()
    service.write_text(first[0])
    answers = [(verb, first[1], host(verb)) for verb in verbs]  # as the host runs it: a fresh interpreter
    # the other records through the same boot line, one interpreter for them all (each fresh one is ~0.15 s of
    # CPU): the verb's answer and exit code as the boot line's sys.exit gives them
    req = json.dumps({"dir": str(root), "session": "dflash"})
    todo = [(str(service), text, verb, req) for text, _ in rest for verb in verbs]
    p = subprocess.run(
        [sys.executable, "-I", "-c", _BOOTS, repo, unit.BOOT], input=json.dumps(todo), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    said = json.loads(p.stdout)
    assert len(said) == len(todo)
    for (code, line), (words, verb) in zip(said, [(w, v) for _, w in rest for v in verbs]):
        assert code == 0 and len(line.splitlines()) == 1, (code, line)
        answers.append((verb, words, json.loads(line)))
    for verb, words, answer in answers:
        assert answer["ok"] is False and answer["error"] == "bad-record", answer
        assert answer["message"].startswith(f"{verb}: {service}: ") and words in answer["message"], answer
    # the supervisor itself: one line on its stderr (the journal, the tmux pane), exit 1
    service.write_text(json.dumps(good))
    (sdir / unit.ENV_JSON).write_text(json.dumps({"env": {}, "notify": "json://127.0.0.1:9/hook"}))
    p = subprocess.run(
        [sys.executable, "-I", "-c", unit.BOOT, repo, "run", str(root), "dflash"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 1 and p.stderr == (
        f'{unit.MARK}: {sdir / unit.ENV_JSON}: notify: expected list, got str "json://127.0.0.1:9/hook"\n'
    ), p.stderr


def test_supervise_stop_ends_the_supervisor_while_a_webhook_trickles_its_answer(night: Night) -> None:
    pytest.importorskip("apprise")
    from testkit.webhook import Webhook

    night.start()
    with Webhook() as hook:
        hook.answer("trickle", every=2.0)  # 200, then one byte every 2 s, for ever
        night.install("--notify", hook.url)
        pid = night.supervisor_pid()
        assert pid is not None
        retry_until(lambda: hook.streaming >= 1, 60)  # "supervisor started" is being answered, byte by byte
        children = [
            int(c) for task in Path(f"/proc/{pid}/task").glob("*") for c in (task / "children").read_text().split()
        ]
        workers = [c for c in children if b"ops.courier" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(workers) == 1, "the delivery runs in a process of its own"
        stopped = night.cli("supervise", "stop")
        assert stopped.exit_code == 0, stopped.output
        assert f"stopped the supervisor of pve/dflash (tmux, pid {pid})" in stopped.stdout, stopped.stdout
        # its lock is let go just before it exits: it is gone right after (an orphan lived on for minutes)
        retry_until(lambda: not pid_alive(pid), 15)
        assert not [w for w in workers if pid_alive(w)], "no delivery process left behind"
        assert hook.streaming >= 1 or hook.cut >= 1  # the webhook still trickled (or saw us hang up)


def test_the_host_service_answers_one_json_line_for_bad_requests_as_the_agent_does(tmp_path: Path) -> None:
    """Both JSON verbs share one prelude (ops/far/request.py): a request nested past the parser, or a huge
    integer, is a bad-request answer (exit 2), never a traceback."""
    repo = Path(__file__).resolve().parents[2]
    code = "import sys, importlib; sys.path.insert(0, sys.argv[1]); sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))"
    service, agent = ["-c", code, str(repo), "ops.supervise.service"], ["-c", code, str(repo), "ops.far.agent"]
    for module_argv, stdin in (
        ([*service, "status"], "[" * 100_000),
        ([*service, "status"], '{"dir": 1' + "0" * 5000 + "}"),
        ([*agent, "probe", "--json"], "[" * 100_000),
    ):
        p = subprocess.run(
            [sys.executable, "-I", "-S", *module_argv],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=repo,
        )
        assert p.returncode == 2 and p.stderr == "", p.stderr[-300:]
        (line,) = p.stdout.splitlines()
        a = json.loads(line)
        assert a["ok"] is False and a["error"] == "bad-request", a
