"""`dflashctl status --json` vs the raw one-liner a user would type, against the same sshd + fake
Proxmox container + live tmux session (all on 127.0.0.1).

    .venv/bin/python -m bench.status_vs_raw [--rounds 15] [--dflashctl PATH] [--compare PATH] [--keeper]
        [--load N] [--no-phases]

raw:    ssh ... 'pct exec 200 -- tmux -L <sock> capture-pane -t =dflash: -p -S -30'   (30 lines, no state;
        `-t =dflash` without the colon fails: "can't find pane: =dflash")
status: dflashctl status --json   (a fresh CLI process: one ssh connection, one agent call, the full state)

The dflashctl measured is the operator's install, .venv-base's (scripts/floor-venv base), when it is there,
else this interpreter's (an editable install's finder adds its own start-up); --dflashctl picks one.
--compare times a second one in the same rounds (before/after a change: another commit's install).
--keeper times a third command in the same rounds: status --json of the same host with `keep_connection`
set (ops/transport/keeper.py), its keeper started before the rounds. --load N adds N busy loops (one process
group of this bench's, each bounded by a deadline, killed by pid at the end) and waits --settle seconds for
the load average to climb before the rounds.

Prints the median wall time of each (rounds interleaved, so both see the same machine load), the ratio of
medians (goal: <= 1.25), then where status's time goes: each round also runs bench/status_phases.py (one
status in a process of the same interpreter, its phases timed) and the agent's own work inside the
container; the medians of each phase are printed.
"""

from __future__ import annotations

if not __package__:  # `python bench/status_vs_raw.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.status_vs_raw")

import argparse
import contextlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
import typing as t
from pathlib import Path

from testkit import retry_until
from testkit.runkit import bench_box, fake_release, timed, train_command

REPO = Path(__file__).resolve().parents[1]
PHASES = Path(__file__).with_name("status_phases.py")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--dflashctl", default=None, help="the dflashctl to measure (default: .venv-base's, else ours)")
    ap.add_argument(
        "--compare",
        metavar="PATH",
        default=None,
        help="a second dflashctl (e.g. another commit's install) timed in the same rounds, interleaved",
    )
    ap.add_argument("--keeper", action="store_true", help="also time status --json through a connection keeper")
    ap.add_argument("--load", type=int, default=0, metavar="N", help="N busy loops beside the rounds")
    ap.add_argument("--settle", type=float, default=60.0, metavar="S", help="seconds for --load to show (60)")
    ap.add_argument(
        "--hook",
        action="store_true",
        help="run the measured status (and --keeper's) through the console entry's hook: session.quick_status "
        "first, the CLI when it declines (HOOK), with the measured dflashctl's interpreter",
    )
    ap.add_argument("--no-phases", action="store_true", help="skip the per-round phase split (quicker rounds)")
    args = ap.parse_args()
    with busy_loops(args.load, settle=args.settle):
        return measure(args)


# What the console entry runs when it has the click-free hook (the lead's entry module; see docs/status.md).
HOOK = (
    "import sys\nfrom ops.session import quick_status\ncode = quick_status(sys.argv[1:])\nif code is not None:\n"
    "    from ops.exit_codes import end_process\n    end_process(code)\nfrom ops.cli import main\nsys.exit(main())\n"
)
BUSY = "import sys, time\nend = float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


@contextlib.contextmanager
def busy_loops(n: int, *, settle: float) -> t.Iterator[None]:
    """``n`` CPU-bound loops in one process group of ours, each ending by itself within the hour; killed by
    the group's id (the first loop's pid) and each by its pid on the way out, never by name."""
    if n <= 0:
        yield
        return
    end = repr(time.time() + 3600)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            group = procs[0].pid if procs else 0  # 0: the first one leads a group of its own
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY, end], process_group=group))
        time.sleep(settle)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            if procs:
                os.killpg(procs[0].pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()


def measure(args: argparse.Namespace) -> int:
    base = REPO / ".venv-base" / "bin" / "dflashctl"
    dflashctl = args.dflashctl or (str(base) if base.exists() else None)

    with bench_box("dflash-bench") as hosts:
        finish = hosts.workdir.parent / "finish"
        hosts.write(
            command=train_command("--steps", "1", "--interval", "0.5", "--until", str(finish)),
            hang_after=600,
            startup_grace=0,
        )
        fake_release(hosts.workdir)
        r = hosts.cli("start")
        assert r.exit_code == 0, r.output
        retry_until(lambda: json.loads(hosts.cli("status", "--json").stdout)["state"] == "running", 30)

        raw = hosts.sshd.ssh_argv(
            shlex.join(
                [
                    str(hosts.pve.pct),
                    "exec",
                    "200",
                    "--",
                    "tmux",
                    "-L",
                    "dflash-bench",
                    "capture-pane",
                    "-t",
                    "=dflash:",
                    "-p",
                    "-S",
                    "-30",
                ]
            )
        )
        from testkit.hostsfile import dflashctl_argv

        ctl = [dflashctl] if dflashctl else dflashctl_argv()
        python = _python_of(ctl)
        if args.hook:
            ctl = [python, "-c", HOOK]
        status = [*ctl, "--hosts", str(hosts.path), "status", "--json"]
        env = hosts.env()
        other = [args.compare, "--hosts", str(hosts.path), "status", "--json"] if args.compare else None
        kept = None
        if args.keeper:
            # the same host, with a keeper: a second hosts.toml, the keeper's folder inside the bench's
            plain = hosts.path.read_text()
            hosts.write(keep_connection=600)
            kept_path = hosts.path.with_name("kept.toml")
            kept_path.write_text(hosts.path.read_text())
            hosts.path.write_text(plain)
            hosts.write(keep_connection=None)
            run_dir = hosts.root / "run"
            run_dir.mkdir(mode=0o700)
            env = {**env, "XDG_RUNTIME_DIR": str(run_dir)}
            kept = [*ctl, "--hosts", str(kept_path), "status", "--json"]
        # warm-up: page cache, sshd's first fork
        for _ in range(2):
            timed(raw)
            timed(status, env)
            if other:
                timed(other, env)
            if kept:
                timed(kept, env)
                time.sleep(3)  # the first one started the keeper: let it connect
        t_raw, t_status, t_other, t_kept = [], [], [], []
        c_raw, c_status, c_other, c_kept = [], [], [], []  # CPU seconds of the command's own process
        phases: dict[str, list[float]] = {}
        agent: dict[str, list[float]] = {}
        beside: dict[str, list[float]] = {}
        load_before = os.getloadavg()
        for n in range(args.rounds):
            dt, p, cpu = timed_cpu(raw)
            assert p.returncode == 0 and "step" in p.stdout, p.stderr
            t_raw.append(dt)
            c_raw.append(cpu)
            # with --compare, the two dflashctls take turns going first
            turns = [(status, t_status, c_status), (other, t_other, c_other), (kept, t_kept, c_kept)]
            for argv, times, cpus in turns[:: -1 if n % 2 else 1]:
                if argv is None:
                    continue
                dt, p, cpu = timed_cpu(argv, env)
                assert p.returncode == 0 and json.loads(p.stdout)["state"] == "running", p.stderr
                times.append(dt)
                cpus.append(cpu)
            if args.no_phases:
                continue
            p = timed([python, "-I", str(PHASES), str(hosts.path), repr(time.time())], env)[1]
            assert p.returncode == 0, p.stderr[-2000:]
            split = json.loads(p.stdout.strip().splitlines()[-1])
            assert split["state"] == "running", split
            for k, v in split["phases"].items():
                phases.setdefault(k, []).append(v)
            for k, v in split["agent"].items():
                agent.setdefault(k, []).append(v)
            for k, v in split.get("beside", {}).items():
                beside.setdefault(k, []).append(v)
        finish.touch()
        if kept:
            end_keepers(hosts.root / "run" / "dflashctl-keeper")

    m_raw, m_status = statistics.median(t_raw), statistics.median(t_status)
    print(f"rounds: {args.rounds} (interleaved)")
    print(
        f"raw ssh+pct+capture-pane : median {m_raw * 1000:7.1f} ms  (min {min(t_raw) * 1000:.1f}, max {max(t_raw) * 1000:.1f})"
    )
    print(
        f"dflashctl status --json  : median {m_status * 1000:7.1f} ms  (min {min(t_status) * 1000:.1f}, max {max(t_status) * 1000:.1f})"
    )
    print(f"ratio of medians          : {m_status / m_raw:.2f}x  (goal <= 1.25x)")
    print(
        f"CPU of the command's own process (user+sys, median ms): raw {statistics.median(c_raw) * 1000:.0f}, "
        f"status {statistics.median(c_status) * 1000:.0f}"
        + (f", --compare {statistics.median(c_other) * 1000:.0f}" if c_other else "")
    )
    if t_kept:
        m_kept = statistics.median(t_kept)
        print(
            f"status --json, keeper    : median {m_kept * 1000:7.1f} ms  (min {min(t_kept) * 1000:.1f}, max {max(t_kept) * 1000:.1f})"
            f"  {m_kept / m_raw:.2f}x  (CPU {statistics.median(c_kept) * 1000:.0f} ms)"
        )
    print(f"dflashctl: {' '.join(ctl[:2] + ['HOOK'] if args.hook else ctl)}")
    if t_other:
        m_other = statistics.median(t_other)
        print(
            f"--compare status --json   : median {m_other * 1000:7.1f} ms  (min {min(t_other) * 1000:.1f}, max {max(t_other) * 1000:.1f})"
            f"  {m_other / m_raw:.2f}x  ({args.compare})"
        )
    print(
        f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in load_before)} before the rounds, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after"
    )
    if not phases:
        return 0
    print(f"\nstatus --json by phase (bench/status_phases.py, {python}; median ms of {args.rounds} rounds):")
    for k, v in phases.items():
        if len(v) == args.rounds and statistics.median(v) >= 0.0005:
            print(f"  {statistics.median(v) * 1000:7.1f}  {k}")
    print(f"  {sum(statistics.median(v) for v in phases.values()) * 1000:7.1f}  sum of the medians")
    for k, v in beside.items():
        print(f"  ({statistics.median(v) * 1000:5.1f}  {k}: not in the sum)")
    print("the agent inside the container (a second connection, after the status; median ms):")
    for k, v in agent.items():
        if isinstance(v[0], (int, float)):
            print(f"  {statistics.median(v) * 1000:7.1f}  {k}")
    return 0


def end_keepers(folder: Path) -> None:
    """SIGTERM the keepers the rounds started (their lock files hold their pids): the box's sshd going away does
    not end a connection it already serves, so a keeper would idle on for its keep_connection."""
    from ops.transport.keeper import _lock_free

    for lock in folder.glob("*.lock"):
        pid = lock.read_text().strip()
        if pid.isdigit() and not _lock_free(lock):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)


def timed_cpu(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, t.Any, float]:
    """timed(), and the CPU seconds (user + sys) the finished command used: its own process and what it
    reaped, not the far side's (sshd's children are sshd's)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    dt, p = timed(argv, env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return dt, p, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _python_of(argv: list[str]) -> str:
    """The interpreter behind a dflashctl command line (a console script's shebang, or argv[0])."""
    first = Path(argv[0])
    if len(argv) > 1:
        return argv[0]
    line = first.read_text().splitlines()[0]
    return line[2:].strip() if line.startswith("#!") else sys.executable


if __name__ == "__main__":
    sys.exit(main())
