"""Helpers for the start/stop/status/tail tests and the ops benches: a fake release and the fake trainer."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
import time
import typing as t
from pathlib import Path

from ops.far import members
from testkit import FakePve, PveHosts, Sshd

REPO = Path(__file__).resolve().parents[1]
FAKE_TRAIN = str(Path(__file__).with_name("fake_train.py"))


def fake_release(workdir: Path, release_id: str = "r0000000000000001") -> Path:
    """What `dflashctl deploy` leaves behind, cut short: ops/ copied into releases/<id>, and
    ``current -> releases/<id>`` as a relative symlink."""
    rel = workdir / "releases" / release_id
    rel.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "ops", rel / "ops", ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    link = workdir / "current"
    if link.is_symlink():
        link.unlink()
    link.symlink_to(f"releases/{release_id}")
    return rel


def train_command(*args: str) -> list[str]:
    """The fake trainer, run by `python` found on PATH (the runner puts the venv's bin first)."""
    return ["python", FAKE_TRAIN, *args]


def timed(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Run a command to its end: (wall seconds, the finished process, its output as text)."""
    t0 = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    return time.perf_counter() - t0, p


@contextlib.contextmanager
def bench_box(tmux_socket: str) -> t.Iterator[PveHosts]:
    """The benches' box, outside pytest: a test sshd on 127.0.0.1 and a fake Proxmox host with container
    200 running, in a fresh folder under /var/tmp. Yields the PveHosts whose hosts.toml the bench writes (its
    ``pve`` and ``sshd`` are the box's); removes them all on the way out, the bench's runs with their container."""
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-", dir="/var/tmp"))
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    sshd = Sshd(root / "sshd").start()
    pve = FakePve()
    try:
        pve.create(200, start=True)
        hosts = PveHosts(root / "inv", sshd=sshd, pve=pve, home=home, tmux_socket=tmux_socket)
        hosts.workdir.parent.mkdir(parents=True, exist_ok=True)
        yield hosts
    finally:
        pve.close()
        sshd.stop()
        shutil.rmtree(root, ignore_errors=True)


def reap_runs(run_dir: Path) -> list[int]:
    """SIGKILL the runners, keepers and commands recorded under ``run_dir`` that still live, and every
    process their commands started (found by the run's tag: ops/far/members.py), each by pid AND start
    time: never a stranger that reused the pid. Local runs survive their tmux server by design, so a
    test that started one must end it. Returns the pids it killed."""
    killed = []
    for record in Path(run_dir).glob("*/attempt-*/run.json"):
        try:
            run = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        procs = [(run.get(k), run.get(s)) for k, s in (("child_pid", "child_start"), ("pid", "pid_start"))]
        if run.get("tag"):
            procs = [(m.pid, m.start) for m in members.scan(tag=run["tag"])] + procs
            procs.append((run.get("keeper_pid"), run.get("keeper_start")))
        for pid, start in procs:
            if isinstance(pid, int) and members.send(pid, start if isinstance(start, int) else -1, signal.SIGKILL):
                killed.append(pid)
    return killed


# A ProxyCommand: relays stdin/stdout to HOST PORT (argv 1, 2); with argv 4, first writes argv 1..3 there
# (what %h %p %r expanded to).
RELAY = """
import os, socket, sys, threading
if len(sys.argv) > 4:
    open(sys.argv[4], "w").write(" ".join(sys.argv[1:4]))
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while True:
        d = os.read(0, 65536)
        if not d:
            s.shutdown(socket.SHUT_WR)
            return
        s.sendall(d)
threading.Thread(target=up, daemon=True).start()
while True:
    d = s.recv(65536)
    if not d:
        break
    os.write(1, d)
"""


# A token with what each encoding changes: "/" "+" "=" (percent), '"' and "\\" (JSON, repr). 26 characters.
LEAKY_TOKEN = 'hf_h5/Secret+Token=Zq8"w\\9'
# The run prints it percent-encoded (a URL's query, as requests prints it), JSON- and repr-escaped, then
# crashes with it in the exception's last line, placed to straddle the 200th character (the evidence's cut).
_LEAK = (
    "import json, os, sys, urllib.parse; t = os.environ['HF_TOKEN']\n"
    "print('GET https://huggingface.co/api/whoami?token=' + urllib.parse.quote_plus(t), flush=True)\n"
    "print('config: ' + json.dumps({'token': t}), flush=True)\n"
    "print('args: ' + repr({'token': t}), flush=True)\n"
    "raise ValueError('x' * 168 + t + ' was refused by the hub')\n"
)


def leaky_command(cmd: t.Sequence[str]) -> list[str]:
    """``cmd``, then the leak above once it ends (``$HF_TOKEN`` from the host entry's env): it exits 1."""
    return ["sh", "-c", '"$@"; exec python -c "$0"', _LEAK, *cmd]


def leaked(text: str) -> list[str]:
    """Each form of ``LEAKY_TOKEN`` whose first 10 characters (or more) are in ``text``: [] when none leaked."""
    from ops.redaction import forms

    return sorted(f for f in forms(LEAKY_TOKEN) if f[:10] in text)
