"""restart-on-crash: time from a crash to the restarted run's first log line, against the poll interval.

    .venv/bin/python -m bench.restart_latency [--intervals 1,2,5] [--trials 5] [--backoff 0.2]

Real sshd on 127.0.0.1 + fake Proxmox container (a real pid+mount namespace) + real tmux + the
resuming fake trainer (testkit/fake_train.py); the supervisor is the real `dflashctl
restart-on-crash`, one per interval. Each trial makes the trainer raise at a random moment of the
poll cycle (control file `once:exception`). The crash time is exit.json's `ended_ts`; the restart's
first line is seen by polling the new attempt's train.log every 10 ms (same clock: one machine).

What one restart costs: up to one interval until the next probe sees the crash, --backoff, one
re-probe (a restart is never done on an old probe), `start --replace` through the agent, the runner's
start and the trainer's first line. Goal: at most interval + 3 s on loopback.
"""

from __future__ import annotations

if not __package__:  # `python bench/restart_latency.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.restart_latency")

import argparse
import functools
import json
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from testkit import retry_until
from testkit.hostsfile import dflashctl_argv
from testkit.runkit import bench_box, fake_release, reap_runs, train_command


def attempts(run_dir: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run_dir / "dflash").glob("attempt-*"))


def ended_ts(exit_json: Path) -> float:
    """When the attempt's exit record says it ended; 0 (falsy: retry) until the record is there."""
    return float(json.loads(exit_json.read_text()).get("ended_ts") or 0) if exit_json.exists() else 0.0


def first_line_seen(log: Path, deadline: float) -> float | None:
    while time.time() < deadline:
        try:
            if log.stat().st_size > 0 and b"\n" in log.read_bytes():
                return time.time()
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", default="1,2,5", help="poll intervals to try, seconds, comma-separated")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--backoff", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    rng = random.Random(args.seed)

    sup: subprocess.Popen[bytes] | None = None
    with bench_box("dflash-bench-restart") as hosts:
        try:
            shared = hosts.workdir.parent
            finish, control = shared / "finish", shared / "control"
            hosts.write(
                command=train_command(
                    "--steps",
                    "1",
                    "--interval",
                    "0.1",
                    "--until",
                    str(finish),
                    "--checkpoint",
                    str(shared / "ckpt.json"),
                    "--every",
                    "5",
                    "--control",
                    str(control),
                ),
                hang_after=600,
                startup_grace=0,
            )
            fake_release(hosts.workdir)
            r = hosts.cli("start")
            assert r.exit_code == 0, r.output
            run_dir = hosts.run_dir

            print(
                f"restart latency: crash -> first log line of the restarted run (backoff {args.backoff:g}s, "
                f"{args.trials} trials per interval)"
            )
            print(f"{'interval':>8} {'min':>6} {'median':>6} {'max':>6} {'goal':>6}  {'max - interval':>14}  trials")
            ok = True
            for interval in intervals:
                sup = proc = subprocess.Popen(
                    [
                        *dflashctl_argv(),
                        "--hosts",
                        str(hosts.path),
                        "restart-on-crash",
                        "--interval",
                        str(interval),
                        "--backoff",
                        str(args.backoff),
                        "--max-backoff",
                        str(args.backoff),
                        "--min-uptime",
                        "0",
                        "--max-restarts",
                        "1000",
                        "--state-dir",
                        str(hosts.root / "state"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=hosts.env(),
                    cwd=hosts.root,
                )
                time.sleep(interval)  # the first probe is done
                lat = []
                for _ in range(args.trials):
                    n = attempts(run_dir)[-1]
                    log = run_dir / "dflash" / f"attempt-{n}" / "train.log"
                    retry_until(log.exists, 30)
                    time.sleep(rng.uniform(0.5, 0.5 + interval))  # a random phase of the poll cycle
                    tmp = control.with_name("control.tmp")
                    tmp.write_text("once:exception")
                    tmp.replace(control)
                    exit_json = run_dir / "dflash" / f"attempt-{n}" / "exit.json"
                    ended = retry_until(functools.partial(ended_ts, exit_json), 30)
                    nxt = run_dir / "dflash" / f"attempt-{n + 1}" / "train.log"
                    seen = first_line_seen(nxt, time.time() + interval + 60)
                    assert seen is not None, f"attempt {n + 1} never logged (interval {interval})"
                    lat.append(seen - ended)
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
                sup = None
                goal = interval + 3.0
                ok &= max(lat) <= goal
                print(
                    f"{interval:>7g}s {min(lat):>5.2f}s {statistics.median(lat):>5.2f}s {max(lat):>5.2f}s "
                    f"{goal:>5.1f}s  {max(lat) - interval:>13.2f}s  " + " ".join(f"{x:.2f}" for x in lat)
                )
            print(
                "goal met (max <= interval + 3 s)"
                if ok
                else "GOAL MISSED: some restart took longer than interval + 3 s"
            )
            return 0 if ok else 1
        finally:
            if sup is not None and sup.poll() is None:
                sup.kill()
                sup.wait(timeout=10)
            (hosts.workdir.parent / "finish").touch()
            reap_runs(hosts.run_dir)
            subprocess.run(["tmux", "-L", "dflash-bench-restart", "kill-server"], capture_output=True, timeout=10)


if __name__ == "__main__":
    sys.exit(main())
