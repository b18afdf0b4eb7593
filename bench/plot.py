"""`dflashctl plot` on a long run: first run (fetch + parse + draw), cached run, and after a little more.

    .venv/bin/python -m bench.plot [--mb 130] [--workers 8] [--slots 16]

Writes a metrics.jsonl of about ``--mb`` MB as `dflash train` writes it (every field of dflash/train/metrics.py,
``--workers`` workers, ``--slots`` acceptance slots; two attempts: the first crashed at 40 %, the second
running), on a local host with a fake release (the agent's real `read` verb). Then runs the real
`dflashctl plot` three times with one state dir: the first run (everything fetched and parsed), the
cached run (nothing new on the host), and after 1 % more was appended (a live run plotted again).
Prints, for each, the wall time, the CPU time (user + system, the agent calls included) and the peak
RSS of the dflashctl process (its largest process, os.wait4).
"""

from __future__ import annotations

if not __package__:  # `python bench/plot.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.plot")

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

from testkit.hostsfile import dflashctl_argv
from testkit.runkit import fake_release


def record(step: int, at: float, workers: int, slots: int, rnd: random.Random) -> dict[str, t.Any]:
    """One record as dflash/train/metrics.py writes it (the values drift and wobble like a run's)."""
    progress = min(1.0, step / 50_000)
    ws = []
    for i in range(workers):
        role = "target" if i < workers // 2 else "drafter"
        index = i if role == "target" else i - workers // 2
        busy = round(min(1.0, max(0.0, (0.5 if role == "target" else 0.97) + rnd.gauss(0, 0.03))), 4)
        wait = round(max(0.0, 1.0 - busy - 0.01), 4)
        ws.append(
            {
                "name": f"{role}-{index}",
                "role": role,
                "index": index,
                "device": f"cuda:{i}",
                "alive": True,
                "dead": False,
                "busy": busy,
                "wait": wait,
                "barrier": 0.0,
                "other": round(max(0.0, 1.0 - busy - wait), 4),
                "batches": 12,
                "batches_s": round(9.9 + rnd.gauss(0, 0.5), 4),
                "items": step * 12,
                "clock": "cuda-events",
                "error": None,
            }
        )
    acc = 0.03 + 0.8 * progress + rnd.gauss(0, 0.01)
    return {
        "step": step,
        "loss": round(5.0 - 4.3 * progress + rnd.gauss(0, 0.05), 6),
        "acc": round(acc, 6),
        "tau_tf": round(1.0 + 5.0 * progress + rnd.gauss(0, 0.1), 6),
        "ktok_s": round(6.0 + rnd.gauss(0, 0.4), 4),
        "tokens": 61440,
        "steps": 10,
        "interval_s": 1.0,
        "lr": 6e-4 * (1.0 - 0.9 * progress),
        "queue_depth": 8 if rnd.random() > 0.01 else 7,
        "queue_capacity": 8,
        "drafters_live": workers - workers // 2,
        "drafters_total": workers - workers // 2,
        "targets_live": workers // 2,
        "targets_total": workers // 2,
        "acc_per_slot": [round(max(0.0, acc - 0.04 * k), 4) for k in range(slots)],
        "workers": ws,
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)),
    }


def write_metrics(path: Path, first: int, count: int, workers: int, slots: int, mode: str = "w") -> int:
    rnd = random.Random(first)
    t0 = 1_780_000_000.0
    with path.open(mode) as f:
        for i in range(count):
            step = (first + i) * 10
            f.write(json.dumps(record(step, t0 + step / 10, workers, slots, rnd), separators=(",", ":")) + "\n")
    return path.stat().st_size


def run(argv: list[str]) -> tuple[float, float, float, str]:
    """(wall seconds, CPU seconds, peak RSS in MB: of the process and the children it waited for, output).
    CPU seconds say more than wall time on a machine that others share."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert p.stdout is not None
    out = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, out
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=130.0, help="size of metrics.jsonl, both attempts together")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the folder (its path is printed)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="dflash-bench-plot-", dir="/var/tmp"))
    try:
        wd = root / "wd"
        fake_release(wd)
        sdir = wd / "runs" / "s"
        one_kb = len(json.dumps(record(10, 0.0, args.workers, args.slots, random.Random(0)), separators=(",", ":")))
        total = int(args.mb * 1e6 / (one_kb + 1))
        first = int(total * 0.4)
        for n, (start, count) in ((1, (1, first)), (2, (first - 500, total - first))):
            adir = sdir / f"attempt-{n}"
            adir.mkdir(parents=True)
            started = 1_780_000_000 + start
            (adir / "run.json").write_text(json.dumps({"started_at": "x", "pid": 1000 + n, "started_ts": started}))
            write_metrics(adir / "metrics.jsonl", start, count, args.workers, args.slots)
        (sdir / "attempt-1" / "exit.json").write_text(
            json.dumps({"exit_code": 1, "signal": None, "ended_ts": 1_780_000_000 + first})
        )
        (sdir / "attempt-1" / "train.log").write_text("Traceback (most recent call last):\nRuntimeError: boom\n")
        (sdir / "current").symlink_to("attempt-2")
        size = sum((sdir / f"attempt-{n}" / "metrics.jsonl").stat().st_size for n in (1, 2))
        hosts = root / "hosts.toml"
        hosts.write_text(
            f'[hosts.l]\ntransport = "local"\nworkdir = "{wd}"\nrun_dir = "{wd / "runs"}"\n'
            f'python = "{sys.executable}"\nsession = "s"\ncommand = "true"\n'
        )
        ctl = [*dflashctl_argv(), "--hosts", str(hosts), "plot", "--state-dir", str(root / "state")]
        print(
            f"metrics.jsonl: {size / 1e6:.1f} MB, {total} records in 2 attempts "
            f"({args.workers} workers, {args.slots} slots: {one_kb} bytes a record)"
        )
        for what in ("first run", "cached run", "after +1 %"):
            if what == "after +1 %":
                grown = write_metrics(
                    sdir / "attempt-2" / "metrics.jsonl", first - 500 + total - first, total // 100, args.workers,
                    args.slots, mode="a",
                )  # fmt: skip
                print(f"  (appended to attempt 2: now {grown / 1e6:.1f} MB)")
            wall, cpu, rss, out = run([*ctl, "--out", str(root / "dash.png")])
            head = out.splitlines()[0] if out else ""
            tail = out.splitlines()[-1] if out else ""
            print(f"  {what:<12} {wall:7.2f} s wall {cpu:7.2f} s CPU  peak RSS {rss:6.0f} MB   {head} | {tail}")
        if args.keep:
            print(f"kept {root}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
