"""tests/slow.txt from full runs' test times: the tests ``scripts/test --quick`` leaves out.

    DFLASH_TEST_TIMES=run.times .venv/bin/python -m pytest -n 4 --dist loadgroup
    DFLASH_TEST_TIMES=quick.times scripts/test --quick
    .venv/bin/python -m testkit.slowlist run.times quick.times > tests/slow.txt

A test's cost is its setup, call and teardown added up, in CPU seconds (``# cpu`` lines: what the test
costs whatever the machine's load) and in wall seconds (its worker's clock: what it waits). It is slow when
either is over its limit in any report given: a module fixture's cost lands on the first test that uses
it, so a quick run's own times (where another test of the module comes first) name the tests that were
cheap only behind a slow one. Also reads a ``--durations=0`` report (wall seconds only).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(?P<nodeid>\S.*?)\s*$")
CPU = re.compile(r"^# cpu (?P<seconds>\d+(?:\.\d+)?) (?:setup|call|teardown) (?P<nodeid>\S.*?)\s*$")


def durations(text: str, line: re.Pattern[str] = LINE) -> dict[str, float]:
    """Seconds per node id, from pytest's ``slowest durations`` lines (or, with ``line=CPU``, the CPU
    seconds of a DFLASH_TEST_TIMES file)."""
    total: dict[str, float] = defaultdict(float)
    for text_line in text.splitlines():
        m = line.match(text_line)
        if m:
            total[m["nodeid"]] += float(m["seconds"])
    return dict(total)


def listed(path: Path) -> frozenset[str]:
    """The node ids that ``path`` (tests/slow.txt) lists: a test, a test without its parameters, or a file;
    tests/conftest.py marks them ``slow``."""
    lines = path.read_text().splitlines() if path.exists() else []
    return frozenset(line.split("#")[0].strip() for line in lines if line.split("#")[0].strip())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testkit.slowlist", description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="DFLASH_TEST_TIMES files or pytest outputs with --durations=0")
    ap.add_argument("--cpu-over", type=float, default=0.5, help="CPU seconds a test took to be listed (default 0.5)")
    ap.add_argument("--over", type=float, default=2.0, help="wall seconds a test took to be listed (default 2)")
    a = ap.parse_args(argv)
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for report in a.reports:
        with open(report, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for n, sec in durations(text).items():
            wall[n] = max(wall.get(n, 0.0), sec)
        for n, sec in durations(text, CPU).items():
            cpu[n] = max(cpu.get(n, 0.0), sec)
    slow = sorted(n for n in wall.keys() | cpu.keys() if wall.get(n, 0.0) >= a.over or cpu.get(n, 0.0) >= a.cpu_over)
    everyone = wall.keys() | cpu.keys()
    print(f"# tests that took >= {a.cpu_over:g} s of CPU or >= {a.over:g} s on their worker's clock (setup + call +")
    print("# teardown, the most in any run read): marked `slow`, left out by scripts/test --quick.")
    print("# Regenerate: python -m testkit.slowlist (DEVELOPING.md).")
    for nodeid in slow:
        print(f"{nodeid}  # {cpu.get(nodeid, 0.0):.1f} s CPU, {wall.get(nodeid, 0.0):.1f} s")
    print(
        f"# {len(slow)} of {len(everyone)} tests; {sum(cpu.get(n, 0.0) for n in slow):.0f} of"
        f" {sum(cpu.values()):.0f} CPU seconds",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
