"""`dflashctl status --all` over 8 hosts vs the same 8 `dflashctl status --host X` one after another.

    .venv/bin/python -m bench.status_all [--hosts 8] [--rounds 5]

Every host is a name for the same test sshd + fake Proxmox container 200 (all on 127.0.0.1) with its
own session running, so each status is a real SSH connection, `pct exec` and agent call. `status --all`
asks them all at once (a thread and a connection each): its wall time should be about the slowest
host's, not the sum. Prints the medians, the ratio, and one host alone for scale.
"""

from __future__ import annotations

if not __package__:  # `python bench/status_all.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.status_all")

import argparse
import statistics
import subprocess
import sys
import time

from testkit.hostsfile import dflashctl_argv, dump_hosts
from testkit.runkit import bench_box, fake_release, timed, train_command


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    with bench_box("dflash-bench") as hosts:
        finish = hosts.workdir.parent / "finish"
        try:
            fake_release(hosts.workdir)
            names = [f"pve{i}" for i in range(1, args.hosts + 1)]
            command = train_command("--steps", "1", "--interval", "0.5", "--until", str(finish))
            tables = {
                n: dict(hosts.pve_table, session=f"run{i}", command=command, hang_after=600, startup_grace=0)
                for i, n in enumerate(names, 1)
            }
            hosts.path.write_text(dump_hosts(names[0], tables))
            env = hosts.env()
            ctl = [*dflashctl_argv(), "--hosts", str(hosts.path)]
            for n in names:
                p = subprocess.run([*ctl, "--host", n, "start"], capture_output=True, text=True, env=env, timeout=120)
                assert p.returncode == 0, p.stdout + p.stderr
            timed([*ctl, "status", "--all"], env)  # warm-up
            t_all, t_seq, t_one = [], [], []
            for _ in range(args.rounds):
                dt, p = timed([*ctl, "status", "--all"], env)
                assert p.returncode == 0 and p.stdout.splitlines()[-1] == "all: running", p.stdout + p.stderr
                t_all.append(dt)
                t0 = time.perf_counter()
                for n in names:
                    dt1, p = timed([*ctl, "--host", n, "status"], env)
                    assert p.returncode == 0, p.stdout + p.stderr
                    if n == names[0]:
                        t_one.append(dt1)
                t_seq.append(time.perf_counter() - t0)
            a, s, o = statistics.median(t_all), statistics.median(t_seq), statistics.median(t_one)
            print(f"{args.hosts} hosts, {args.rounds} rounds (medians, wall time of fresh dflashctl processes):")
            print(f"  status --host (one host):         {o:6.2f} s")
            print(f"  {args.hosts} x status --host, one by one:  {s:6.2f} s")
            print(
                f"  status --all ({args.hosts} at once):        {a:6.2f} s   ({s / a:.1f}x faster; {a / o:.2f}x one host)"
            )
            return 0
        finally:
            finish.touch()


if __name__ == "__main__":
    sys.exit(main())
