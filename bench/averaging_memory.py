"""Peak RSS of averaging drafter replicas on CPU: our one-slice buffers vs a whole-model average.

    .venv/bin/python bench/averaging_memory.py [--replicas 3] [--width 2048] [--layers 6] [--chunk 4194304]

Builds ``--replicas`` replicas of a model of ``--layers`` square fp32 linears (2048 wide x 6 = 25M params,
100 MB per replica: 300 MB for 3), then measures in separate child processes (so peaks do not mix):

- ``averager``: ``dflash.averaging.Averager`` (three fp32 buffers of one slice, preallocated);
- ``naive``: what averaging usually looks like, ``{k: mean(sd[k] for sd in state_dicts)}`` and
  ``load_state_dict`` into every replica (a model-sized temporary, and more).

Peak RSS is the kernel's VmHWM, reset to the current RSS right before averaging (``/proc/self/clear_refs``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(method: str, replicas: int, width: int, layers: int, chunk: int) -> dict[str, float]:
    import torch

    sys.path.insert(0, str(ROOT))
    from dflash.averaging import Averager

    torch.set_num_threads(1)
    models = []
    for r in range(replicas):
        torch.manual_seed(r)  # diverged replicas
        models.append(torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)]))
    model_bytes = sum(p.numel() * p.element_size() for p in models[0].parameters())
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    if method == "averager":
        params = [list(m.parameters()) for m in models]
        avg = Averager.for_replicas(params, chunk_numel=chunk, pin=False)
        avg.average(params)
        buffers = avg.buffer_bytes
    else:
        with torch.no_grad():
            sds = [m.state_dict() for m in models]
            mean = {k: sum(sd[k].float() for sd in sds) / len(sds) for k in sds[0]}
            for m in models:
                m.load_state_dict(mean)
        buffers = model_bytes
    seconds = time.perf_counter() - t0
    peak = rss_kib("VmHWM")
    first = [p.detach() for p in models[0].parameters()]
    assert all(torch.equal(a, b.detach()) for m in models[1:] for a, b in zip(first, m.parameters()))
    return {"method": method, "replicas": replicas, "model_mb": model_bytes / 2**20, "rss_before_mb": before / 1024,
            "peak_mb": peak / 1024, "extra_mb": (peak - before) / 1024, "buffers_mb": buffers / 2**20, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=1 << 22, help="averager slice, elements (default 4M = 16 MiB)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.replicas, args.width, args.layers, args.chunk)))
        return 0
    rows = []
    for method in ("averager", "naive"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", method, "--replicas", str(args.replicas), "--width", str(args.width),
             "--layers", str(args.layers), "--chunk", str(args.chunk)],
            check=True, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    r0 = rows[0]
    print(f"{args.replicas} replicas x {r0['model_mb']:.0f} MB fp32 ({args.replicas * r0['model_mb']:.0f} MB of replicas), "
          f"RSS before averaging ~{r0['rss_before_mb']:.0f} MB")
    print(f"{'method':<10} {'peak RSS MB':>12} {'extra MB':>9} {'buffers MB':>11} {'seconds':>8}")
    for r in rows:
        print(f"{r['method']:<10} {r['peak_mb']:12.1f} {r['extra_mb']:9.1f} {r['buffers_mb']:11.1f} {r['seconds']:8.2f}")
    a, n = rows
    print(f"extra memory: averager {a['extra_mb']:.1f} MB = {a['extra_mb'] / a['model_mb']:.2f} x one replica; "
          f"naive {n['extra_mb']:.1f} MB = {n['extra_mb'] / n['model_mb']:.2f} x one replica "
          f"(ratio naive/averager {n['extra_mb'] / max(a['extra_mb'], 1e-9):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
