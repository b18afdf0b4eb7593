"""N remote `true` calls: one reused SSHTransport (a channel per call) vs N fresh `ssh` processes.

Both go to the same real sshd on 127.0.0.1 (started by testkit with throwaway keys).
Usage: .venv/bin/python -m bench.ssh_reuse [-n 50]
"""

from __future__ import annotations

if not __package__:  # `python bench/ssh_reuse.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.ssh_reuse")

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ops.hosts import parse_inventory
from ops.transport import SSHTransport
from testkit import Sshd, missing_requirement
from testkit.hostsfile import dump_hosts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=50, help="calls per side (default 50)")
    args = ap.parse_args()
    if reason := missing_requirement("sshd"):
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        home = Path(tmp) / "home"
        (home / ".ssh").mkdir(parents=True)
        os.environ["HOME"] = str(home)  # never the user's ~/.ssh
        os.environ.pop("SSH_AUTH_SOCK", None)
        with Sshd(Path(tmp) / "sshd") as sshd:
            host = parse_inventory(
                dump_hosts(
                    None,
                    {
                        "bench": {
                            "address": "127.0.0.1",
                            "port": sshd.port,
                            "user": "root",
                            "identity_file": str(sshd.client_key),
                            "known_hosts": str(sshd.known_hosts),
                            "command": "true",
                        }
                    },
                ),
                path=None,
                base=Path(tmp),
            ).get()

            t0 = time.perf_counter()
            transport = SSHTransport.connect(host)
            connect_s = time.perf_counter() - t0
            reused = []
            with transport:
                for _ in range(args.n):
                    t = time.perf_counter()
                    assert transport.run(["true"]).ok
                    reused.append(time.perf_counter() - t)

            fresh = []
            argv = sshd.ssh_argv("true")
            for _ in range(args.n):
                t = time.perf_counter()
                subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, capture_output=True)
                fresh.append(time.perf_counter() - t)

    reused_total = connect_s + sum(reused)
    fresh_total = sum(fresh)
    print(f"N = {args.n} remote `true` calls to sshd on 127.0.0.1")
    print(
        f"reused SSHTransport : total {reused_total:.3f} s (connect {connect_s:.3f} s + calls), median per call {statistics.median(reused) * 1000:.1f} ms"
    )
    print(f"fresh ssh processes : total {fresh_total:.3f} s, median per call {statistics.median(fresh) * 1000:.1f} ms")
    print(
        f"ratio fresh/reused  : {fresh_total / reused_total:.2f}x total, {statistics.median(fresh) / statistics.median(reused):.2f}x per-call median"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
