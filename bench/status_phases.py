"""One `dflashctl status --json` in this process, its time split by phase (bench/status_vs_raw.py runs it).

    .venv/bin/python -m bench.status_phases HOSTS_TOML            (this checkout's dflashctl)
    <python> -I bench/status_phases.py HOSTS_TOML T_SPAWN           (that interpreter's installed dflashctl)

status_vs_raw runs the second form with the interpreter of the dflashctl it measures, in a fresh process:
``T_SPAWN`` is its time.time() just before it started this process, so the first phase is the interpreter's
own start (without it: 0). Prints one
JSON object: ``phases`` (name -> seconds, in order), ``beside`` (what ran in a thread of its own meanwhile,
not in the sum), then ``agent`` (the agent's own work, timed inside the
container by a second connection, after the status call: it does not count in ``phases``).

Wrapped, never changed: the functions each phase runs are timed by replacing them with a timing wrapper in
this process (and in the agent's process, for ``agent``); the answer bytes and the output are as usual.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import sys
import threading
import time
import typing as t

T_ENTER = time.time()
SPAWN = float(sys.argv[2]) if len(sys.argv) > 2 else T_ENTER
HOSTS = sys.argv[1]

phases: dict[str, float] = {"interpreter start": T_ENTER - SPAWN}
_clock = [time.perf_counter()]


def mark(name: str) -> None:
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - _clock[0]
    _clock[0] = now


def wrap(owner: t.Any, attr: str, name: str | t.Callable[..., str]) -> None:
    """``owner.attr`` timed as phase ``name`` (what ran before it since the last mark goes to ``between``)."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def timed(*a: t.Any, **kw: t.Any) -> t.Any:
        label = name if isinstance(name, str) else name(*a, **kw)
        mark(f"between: before {label}")
        try:
            return fn(*a, **kw)
        finally:
            mark(label)

    setattr(owner, attr, timed)


import ops.cli  # noqa: E402

mark("imports: ops.cli (click, the CLI)")
from ops import session  # noqa: E402

mark("imports: ops.session")
import ops.far_call  # noqa: E402
import ops.remote  # noqa: E402
from ops.transport import ssh  # noqa: E402

mark("imports: ops.transport.ssh (paramiko)")

wrap(ssh, "resolve_target", "ssh: resolve the target (ssh_config)")
wrap(ssh.socket, "create_connection", "ssh: TCP connect")
wrap(ssh.paramiko.Transport, "start_client", "ssh: banner + key exchange + host key check")
wrap(ssh.paramiko.Transport, "auth_publickey", "ssh: public-key auth")
wrap(ssh.paramiko.Transport, "open_session", "ssh: open a channel")
wrap(
    ssh.SSHTransport,
    "run",
    lambda self, argv, **kw: f"ssh: remote exec of {' '.join([str(argv[0]).rsplit('/', 1)[-1], *map(str, argv[1:3])])}",
)
wrap(ops.far_call, "last_answer", "parse the agent's answer")

# status imports ops.probe (classify) in a thread while the remote exec runs: timed there, not in the sum
beside: dict[str, float] = {}


def import_beside(name: str) -> threading.Thread:
    def load() -> None:
        t0 = time.perf_counter()
        importlib.import_module(name)
        beside[f"import {name} in a thread (during the remote exec)"] = time.perf_counter() - t0

    th = threading.Thread(target=load, daemon=True)
    th.start()
    return th


session.import_beside = import_beside

out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        ops.cli.main(["--hosts", HOSTS, "status", "--json"])
    except SystemExit as e:
        code = e.code
mark("the rest (classify, click, output, close)")
status = json.loads(out.getvalue())
timed_phases = dict(phases)  # the second connection below goes through the same wrappers: not counted

# The agent's own work, inside the container: a second connection (not timed above).
host = ops.cli.load_inventory(HOSTS).get(None)
remote = ops.remote.connect(host)
# the agent's own boot (session.BOOT: the release first on the path), then the probe with its parts timed
BOOT_PATH = session.BOOT.split("; from ")[0]
PROFILE = r"""
import time
t0 = time.perf_counter()
BOOT_PATH
from ops.far import agent, members
t1 = time.perf_counter()
times = {"imports": t1 - t0}
def timed(owner, attr, name):
    fn = getattr(owner, attr)
    def w(*a, **kw):
        s = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            times[name] = times.get(name, 0.0) + time.perf_counter() - s
    setattr(owner, attr, w)
for attr in ("tmux_facts", "attempt_facts", "pid1_start", "disk_facts", "oom_kill_count"):
    timed(agent, attr, attr)
timed(agent.members, "scan", "members.scan (/proc)")
timed(agent, "process_facts", "process_facts (/proc)")
timed(agent.nvidia_smi, "start", "nvidia_smi")
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    agent.main(["probe", "--json"])
times["probe in all"] = time.perf_counter() - t1
import json
print(json.dumps(times))
""".replace("BOOT_PATH", BOOT_PATH)
req = json.dumps(session.request(host, None)).encode()
base = [host.python, "-I", "-S", "-c"]
cur = f"{host.workdir}/current"
t0 = time.perf_counter()
remote.run([*base, "pass"])
empty = time.perf_counter() - t0
t0 = time.perf_counter()
remote.run(session.agent_argv(host.workdir, host.python, "probe"), stdin=req)
agent_exec = time.perf_counter() - t0
prof = remote.run([*base, PROFILE, cur], stdin=req)
remote.close()
inside = json.loads(prof.out.strip().splitlines()[-1]) if prof.exit_code == 0 else {"error": prof.err[-300:]}
print(
    json.dumps(
        {
            "state": status.get("state"),
            "exit": code,
            "total": sum(timed_phases.values()),
            "phases": timed_phases,
            "beside": beside,
            "agent": {"exec of python -I -S -c pass": empty, "exec of the agent's probe": agent_exec, **inside},
        }
    )
)
