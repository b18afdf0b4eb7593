"""`dflashctl status --json` vs the raw one-liner a user would type, against the same sshd + fake
Proxmox container + live tmux session (all on 127.0.0.1).

    .venv/bin/python -m bench.status_vs_raw [--rounds 15]

raw:    ssh ... 'pct exec 200 -- tmux -L <sock> capture-pane -t =dflash: -p -S -30'   (30 lines, no state;
        `-t =dflash` without the colon fails: "can't find pane: =dflash")
status: dflashctl status --json   (a fresh CLI process: one ssh connection, one agent call, the full state)

Prints the median wall time of each (rounds interleaved, so both see the same machine load), and the
ratio of medians. Goal: ratio <= 1.5.
"""

from __future__ import annotations

if not __package__:  # `python bench/status_vs_raw.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.status_vs_raw")

import argparse
import json
import shlex
import statistics
import sys

from testkit import retry_until
from testkit.runkit import bench_box, fake_release, timed, train_command


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

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

        status = [*dflashctl_argv(), "--hosts", str(hosts.path), "status", "--json"]
        env = hosts.env()
        # warm-up: page cache, sshd's first fork
        for _ in range(2):
            timed(raw)
            timed(status, env)
        t_raw, t_status = [], []
        for _ in range(args.rounds):
            dt, p = timed(raw)
            assert p.returncode == 0 and "step" in p.stdout, p.stderr
            t_raw.append(dt)
            dt, p = timed(status, env)
            assert p.returncode == 0 and json.loads(p.stdout)["state"] == "running", p.stderr
            t_status.append(dt)
        finish.touch()

    m_raw, m_status = statistics.median(t_raw), statistics.median(t_status)
    print(f"rounds: {args.rounds} (interleaved)")
    print(
        f"raw ssh+pct+capture-pane : median {m_raw * 1000:7.1f} ms  (min {min(t_raw) * 1000:.1f}, max {max(t_raw) * 1000:.1f})"
    )
    print(
        f"dflashctl status --json  : median {m_status * 1000:7.1f} ms  (min {min(t_status) * 1000:.1f}, max {max(t_status) * 1000:.1f})"
    )
    print(f"ratio of medians          : {m_status / m_raw:.2f}x  (goal <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
