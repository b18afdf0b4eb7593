"""Record the fact sets that tests/ops/test_probe.py classifies (one JSON file per scenario).

    .venv/bin/python tests/ops/facts/record.py [NAME ...]

Each scenario is played for real (sshd on 127.0.0.1 + the fake Proxmox container + tmux + the fake
trainer), then `dflashctl status --facts` is saved together with the expectation written HERE, by
hand (never computed by ops.probe). A few rows cannot be produced on this machine (a cgroup OOM kill,
an NCCL error, DNS and connect timeouts); they are derived from a recorded set by a small, named
edit (``"edited": ...`` in the file).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import tempfile
import time
import typing as t
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repo

from testkit import FakePve, PveHosts, Sshd, retry_until  # noqa: E402
from testkit.runkit import fake_release, train_command  # noqa: E402

VMID = 200


class Player:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"
        (self.home / ".ssh").mkdir(parents=True)
        self.sshd = Sshd(root / "sshd").start()
        self.pve = FakePve()
        self.pve.create(VMID, start=True)
        self.hosts = PveHosts(root / "inv", sshd=self.sshd, pve=self.pve, home=self.home, tmux_socket="dflash-rec")
        self.finish = self.hosts.workdir.parent / "finish"
        self.finish.parent.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        self.finish.touch()
        self.sshd.stop()
        self.pve.close()

    def reset(self, *train: str, **table: t.Any) -> None:
        """A fresh container (its tmux dies with it) and empty run records."""
        import shutil

        self.finish.touch()
        if self.pve.init_pid(VMID) is None:
            if not (self.pve.state / "nodes" / "pve" / "lxc" / f"{VMID}.conf").exists():
                self.pve.create(VMID)
            self.pve.start(VMID)
        else:
            self.pve.reboot(VMID)
        shutil.rmtree(self.hosts.run_dir, ignore_errors=True)
        self.finish.unlink(missing_ok=True)
        if not self.sshd.running:
            self.sshd.start()
        table.setdefault("known_hosts", str(self.sshd.known_hosts))
        table.setdefault("identity_file", str(self.sshd.client_key))
        table.setdefault("python", sys.executable)
        table.setdefault("hang_after", 600)
        table.setdefault("startup_grace", 0)
        self.hosts.write(command=train_command(*train), **table)
        fake_release(self.hosts.workdir)

    def forever(self) -> tuple[str, ...]:
        return ("--steps", "1", "--interval", "0.1", "--until", str(self.finish))

    def cli(self, *args: str) -> t.Any:
        return self.hosts.cli(*args, timeout=120)

    def start(self) -> None:
        r = self.cli("start")
        assert r.exit_code == 0, r.output

    def inside(self, *argv: str) -> t.Any:
        return self.pve.run_in(VMID, list(argv))

    def tmux(self, *args: str) -> t.Any:
        return self.inside("tmux", "-L", "dflash-rec", *args)

    def server_pid(self) -> int:
        return int(self.tmux("display-message", "-p", "#{pid}").stdout.decode().strip())

    def run_json(self) -> dict[str, t.Any]:
        p = self.hosts.run_dir / "dflash" / "current" / "run.json"
        return retry_until(lambda: p.exists() and json.loads(p.read_text()), 20)

    def steps(self) -> int:
        p = self.hosts.run_dir / "dflash" / "current" / "train.log"
        return p.read_text(errors="replace").count("step ") if p.exists() else 0

    def facts(self) -> dict[str, t.Any]:
        r = self.cli("status", "--facts")
        return json.loads(r.stdout)

    def wait_state(self, state: str) -> dict[str, t.Any]:
        def check() -> t.Any:
            r = self.cli("status", "--json")
            return r.stdout and json.loads(r.stdout)["state"] == state

        retry_until(check, 30, interval=0.2)
        return self.facts()


# --------------------------------------------------------------------------------------------
# Scenarios: name -> (description, play, expectation). ``play`` returns the facts.

Play = t.Callable[[Player], dict[str, t.Any]]
SCENARIOS: dict[str, tuple[str, Play, dict[str, t.Any]]] = {}


def scenario(name: str, description: str, **expect: t.Any) -> t.Callable[[Play], Play]:
    def deco(fn: Play) -> Play:
        SCENARIOS[name] = (description, fn, expect)
        return fn

    return deco


@scenario("not-started", "fresh container, nothing ever started", state="not-started", cause=None)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    return p.facts()


@scenario("running", "the fake trainer steps", state="running", cause=None, progress_step_min=1)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 2, 20)
    return p.facts()


@scenario(
    "running-startup-grace",
    "no progress for longer than hang_after, but inside startup_grace",
    state="running",
    cause=None,
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "0", "--then", "forever", hang_after=1, startup_grace=3600)
    p.start()
    time.sleep(2.5)
    return p.facts()


@scenario("stalled", "SIGSTOP on the trainer, hang_after 1", state="stalled", cause=None)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever(), hang_after=1)
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    p.inside("kill", "-STOP", str(p.run_json()["child_pid"]))
    facts = p.wait_state("stalled")
    p.inside("kill", "-CONT", str(p.run_json()["child_pid"]))
    return facts


@scenario("succeeded", "exit 0", state="succeeded", cause=None, exit_code=0)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "2", "--then", "exit:0")
    p.start()
    return p.wait_state("succeeded")


@scenario(
    "crashed-cuda-oom", "torch.OutOfMemoryError naming GPU 5", state="crashed", cause="cuda-oom", gpu=5, exit_code=1
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "2", "--then", "oom")
    p.start()
    return p.wait_state("crashed")


@scenario(
    "crashed-cuda-oom-old",
    "old torch: RuntimeError: CUDA out of memory (GPU 3; ...)",
    state="crashed",
    cause="cuda-oom",
    gpu=3,
    exit_code=1,
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "1", "--then", "oom-old")
    p.start()
    return p.wait_state("crashed")


@scenario(
    "crashed-python-exception",
    "KeyError raised",
    state="crashed",
    cause="python-exception",
    detail="KeyError: 'bad_key'",
    exit_code=1,
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "1", "--then", "exception:bad_key")
    p.start()
    return p.wait_state("crashed")


@scenario(
    "crashed-nonzero-exit",
    "exit 3 with no traceback",
    state="crashed",
    cause="nonzero-exit",
    exit_code=3,
    detail="done after 1 steps",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "1", "--then", "exit:3")
    p.start()
    return p.wait_state("crashed")


@scenario(
    "crashed-diverged",
    "dflash train's diverged line (a NaN loss), exit 3",
    state="crashed",
    cause="diverged",
    exit_code=3,
    detail="diverged at step 3: loss not finite; last finite checkpoint: none",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "2", "--then", "diverged")
    p.start()
    return p.wait_state("crashed")


@scenario("crashed-signal", "SIGKILL on the trainer", state="crashed", cause="signal", signal=9, exit_code=None)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    p.inside("kill", "-KILL", str(p.run_json()["child_pid"]))
    return p.wait_state("crashed")


@scenario("crashed-nccl-timeout", "watchdog line, then SIGABRT", state="crashed", cause="nccl-timeout", signal=6)
def _(p: Player) -> dict[str, t.Any]:
    p.reset("--steps", "1", "--then", "nccl-timeout")
    p.start()
    return p.wait_state("crashed")


@scenario(
    "running-tmux-server-killed",
    "tmux server SIGKILLed, training alive",
    state="running",
    cause=None,
    tmux_server="dead",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    p.inside("kill", "-KILL", str(p.server_pid()))
    return p.facts()


@scenario(
    "running-session-killed",
    "kill-session, training alive",
    state="running",
    cause=None,
    tmux_server="alive",
    tmux_session="missing",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    p.tmux("kill-session", "-t", "=dflash")
    return p.facts()


@scenario(
    "lost-tmux-server-killed", "runner, trainer and tmux server all SIGKILLed", state="lost", cause="tmux-server-killed"
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    run = p.run_json()
    p.inside("kill", "-KILL", str(run["pid"]), str(run["child_pid"]), str(p.server_pid()))
    return p.wait_state("lost")


@scenario(
    "lost-session-killed", "runner and trainer SIGKILLed, then kill-session", state="lost", cause="session-killed"
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    run = p.run_json()
    p.inside("kill", "-KILL", str(run["pid"]), str(run["child_pid"]))
    p.tmux("kill-session", "-t", "=dflash")
    return p.wait_state("lost")


@scenario(
    "lost-unknown", "runner and trainer SIGKILLed, tmux alive (pane dead, signal 9)", state="lost", cause="unknown"
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    run = p.run_json()
    # the keeper too: it would otherwise record the command's end (signal 9, `crashed`)
    p.inside("kill", "-KILL", str(run["child_pid"]), str(run["keeper_pid"]), str(run["pid"]))
    return p.wait_state("lost")


@scenario(
    "crashed-orphans-left",
    "a start script runs the trainer as its child; the keeper, then the script, SIGKILLed: the trainer lives on",
    state="crashed",
    cause="orphans-left",
    exit_code=None,
    signal=None,
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    script = p.hosts.workdir.parent / "start_training.sh"
    script.write_text("#!/bin/sh\n" + " ".join(train_command(*p.forever())) + "\necho the trainer ended\n")
    script.chmod(0o755)
    p.hosts.write(command=[str(script)])
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    run = p.run_json()
    p.inside("kill", "-KILL", str(run["keeper_pid"]))
    p.inside("kill", "-KILL", str(run["child_pid"]))
    return p.wait_state("crashed")


@scenario("lost-container-restart", "container rebooted under the run", state="lost", cause="container-restart")
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    p.pve.reboot(VMID)
    return p.facts()


@scenario("hand-running", "a session started by hand (no runner)", state="running", cause=None)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.tmux("new-session", "-d", "-s", "dflash", "echo step 4 '|' loss 1.5; sleep 600")
    time.sleep(0.5)
    return p.facts()


@scenario("hand-lost-server-killed", "hand-started session, tmux server SIGKILLed", state="lost", cause="unknown")
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.tmux("new-session", "-d", "-s", "dflash", "sleep 600")
    p.inside("kill", "-KILL", str(p.server_pid()))
    return p.wait_state("lost")


@scenario(
    "hand-lost-command-exited",
    "hand-started session whose command exited (the server exited with it)",
    state="lost",
    cause="unknown",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.tmux("new-session", "-d", "-s", "dflash", "sleep 0.2; exit 3")
    return p.wait_state("lost")


@scenario(
    "hand-crashed-pane-dead",
    "hand-started session with remain-on-exit, python raised",
    state="crashed",
    cause="python-exception",
    exit_code=1,
    detail="ValueError: 42",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.tmux(
        "start-server",
        ";",
        "set",
        "-g",
        "remain-on-exit",
        "on",
        ";",
        "new-session",
        "-d",
        "-s",
        "dflash",
        "sleep 0.3; python3 -c 'raise ValueError(42)'",
    )
    return p.wait_state("crashed")


@scenario("stopped", "dflashctl stop", state="stopped", cause=None)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.start()
    retry_until(lambda: p.steps() >= 1, 20)
    r = p.cli("stop", "--grace", "10")
    assert r.exit_code == 0, r.output
    return p.facts()


@scenario("container-down-stopped", "pct stop 200", state="container-down", cause="stopped")
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.pve.stop(VMID)
    return p.facts()


@scenario("container-down-missing", "pct destroy 200", state="container-down", cause="missing")
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.pve.destroy(VMID)
    return p.facts()


@scenario("unreachable-refused", "sshd stopped", state="unreachable", cause="refused")
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever())
    p.sshd.stop()
    return p.facts()


@scenario("unreachable-host-key", "known_hosts without the server's key", state="unreachable", cause="host-key")
def _(p: Player) -> dict[str, t.Any]:
    empty = p.root / "empty_known_hosts"
    empty.write_text("")
    p.reset(*p.forever(), known_hosts=str(empty))
    return p.facts()


@scenario("unreachable-auth", "a client key the server does not know", state="unreachable", cause="auth")
def _(p: Player) -> dict[str, t.Any]:
    from testkit.sshd import keygen

    other = p.root / "other_key"
    if not other.exists():
        keygen(other, "stranger")
    p.reset(*p.forever(), identity_file=str(other))
    return p.facts()


@scenario(
    "fallback-hand-running",
    "python missing in the container: raw tmux only",
    state="running",
    cause=None,
    mode="fallback",
)
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever(), python="/nonexistent/python3")
    p.tmux("new-session", "-d", "-s", "dflash", "sleep 600")
    return p.facts()


@scenario("fallback-not-started", "python missing, no tmux server", state="not-started", cause=None, mode="fallback")
def _(p: Player) -> dict[str, t.Any]:
    p.reset(*p.forever(), python="/nonexistent/python3")
    return p.facts()


# Rows this machine cannot produce: a named edit of a recorded set.
EDITS: dict[str, tuple[str, str, t.Callable[[dict[str, t.Any]], None], dict[str, t.Any]]] = {}


def edit(name: str, base: str, what: str, **expect: t.Any) -> t.Callable[[t.Callable[[dict[str, t.Any]], None]], None]:
    def deco(fn: t.Callable[[dict[str, t.Any]], None]) -> None:
        EDITS[name] = (base, what, fn, expect)

    return deco


@edit(
    "crashed-host-oom",
    "crashed-signal",
    "the cgroup's oom_kill count rose from 0 to 1 during the run",
    state="crashed",
    cause="host-oom",
    signal=9,
)
def _(f: dict[str, t.Any]) -> None:
    att = f["agent"]["attempt"]
    att["run"]["oom_kill"] = 0
    att["exit"]["oom_kill_before"] = 0
    att["exit"]["oom_kill"] = 1


@edit(
    "crashed-nccl-error",
    "crashed-python-exception",
    "the traceback ends in a DistBackendError (NCCL error)",
    state="crashed",
    cause="nccl-error",
)
def _(f: dict[str, t.Any]) -> None:
    tail = f["agent"]["attempt"]["log"]["tail"]
    tail[-1] = (
        "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
        "unhandled system error, NCCL version 2.21.5"
    )


@edit(
    "crashed-disk-full",
    "crashed-nonzero-exit",
    "the run filled its disk: exit.json and the probe say 0 bytes free "
    "(as the runner records it; played for real in tests/ops/test_hostile_far.py with a 1 MiB tmpfs)",
    state="crashed",
    cause="disk-full",
    exit_code=3,
    detail="0 bytes were free where the run writes when the command ended",
)
def _(f: dict[str, t.Any]) -> None:
    att = f["agent"]["attempt"]
    att["exit"].update(disk_free=0, disk_full=True)
    f["agent"]["disk"] = {"path": os.path.dirname(os.path.dirname(att["dir"])), "free": 0, "full": True}


@edit(
    "lost-disk-full",
    "lost-unknown",
    "no exit record, no live process, and the run's disk is full",
    state="lost",
    cause="disk-full",
)
def _(f: dict[str, t.Any]) -> None:
    att = f["agent"]["attempt"]
    f["agent"]["disk"] = {"path": os.path.dirname(os.path.dirname(att["dir"])), "free": 0, "full": True}


@edit(
    "unreachable-dns",
    "unreachable-refused",
    "socket.gaierror as the transport reports it",
    state="unreachable",
    cause="dns",
)
def _(f: dict[str, t.Any]) -> None:
    f["unreachable"] = {
        "cause": "dns",
        "detail": "pve: cannot resolve gpu-box.invalid: [Errno -2] Name or service not known",
    }


@edit(
    "unreachable-timeout",
    "unreachable-refused",
    "connect timed out as the transport reports it",
    state="unreachable",
    cause="timeout",
)
def _(f: dict[str, t.Any]) -> None:
    f["unreachable"] = {"cause": "timeout", "detail": "pve: no answer from 10.0.0.9:22 within 5s"}


@edit(
    "unreachable-agent-timeout", "running", "the agent call outlived its timeout", state="unreachable", cause="timeout"
)
def _(f: dict[str, t.Any]) -> None:
    f.pop("agent")
    f["agent_timeout"] = "the agent did not answer within 30s"


def save(
    name: str, description: str, facts: dict[str, t.Any], expect: dict[str, t.Any], edited: str | None = None
) -> None:
    doc = {
        "scenario": description,
        "recorded": "dflashctl status --facts (tests/ops/facts/record.py)",
        "edited": edited,
        "expect": expect,
        "facts": facts,
    }
    (HERE / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"recorded {name}")


def main(names: list[str]) -> int:
    wanted = names or list(SCENARIOS) + list(EDITS)
    root = Path(tempfile.mkdtemp(prefix="dflash-facts-", dir="/var/tmp"))
    os.environ["HOME"] = str(root / "home")
    player = None
    try:
        for name in wanted:
            if name in SCENARIOS:
                player = player or Player(root)
                description, play, expect = SCENARIOS[name]
                save(name, description, play(player), expect)
        for name in wanted:
            if name in EDITS:
                base, what, fn, expect = EDITS[name]
                doc = json.loads((HERE / f"{base}.json").read_text())
                facts = copy.deepcopy(doc["facts"])
                fn(facts)
                save(name, f"{doc['scenario']}, edited: {what}", facts, expect, edited=f"from {base}: {what}")
    finally:
        if player is not None:
            player.close()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
