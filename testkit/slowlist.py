"""tests/slow.txt from a full run's ``--durations=0`` report: the tests ``scripts/test --quick`` leaves out.

    .venv/bin/python -m pytest -n 4 --dist loadgroup --durations=0 -q > run.txt
    .venv/bin/python -m testkit.slowlist run.txt --over 2 > tests/slow.txt

A test's time is its setup, call and teardown added up (under xdist, as its worker measured them).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*(?P<seconds>\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(?P<nodeid>\S.*?)\s*$")


def durations(text: str) -> dict[str, float]:
    """Seconds per node id, from pytest's ``slowest durations`` lines."""
    total: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        m = LINE.match(line)
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
    ap.add_argument("report", help="a pytest run's output with --durations=0")
    ap.add_argument("--over", type=float, default=2.0, help="seconds a test took to be listed (default 2)")
    a = ap.parse_args(argv)
    with open(a.report, encoding="utf-8", errors="replace") as f:
        took = durations(f.read())
    slow = sorted((s, n) for n, s in took.items() if s >= a.over)
    print(f"# tests that took >= {a.over:g} s (setup + call + teardown) in a parallel run: marked `slow`,")
    print("# left out by scripts/test --quick. Regenerate: python -m testkit.slowlist (DEVELOPING.md).")
    for seconds, nodeid in sorted(slow, key=lambda p: p[1]):
        print(f"{nodeid}  # {seconds:.1f} s")
    print(
        f"# {len(slow)} of {len(took)} tests, {sum(s for s, _ in slow):.0f} of {sum(took.values()):.0f} test-seconds",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
