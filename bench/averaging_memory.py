"""Averaging drafter replicas: seconds per round vs the copy bound, and peak extra memory.

    .venv/bin/python -m bench.averaging_memory [--replicas 3] [--width 2048] [--layers 6] [--chunk 4194304]
        [--threads N] [--rounds 3] [--device cpu|cuda] [--engine OLD_AVERAGING_PY]

Builds ``--replicas`` replicas of a model of ``--layers`` square fp32 linears (2048 wide x 6 = 25M params,
100 MB per replica: 300 MB for 3) -- on the CPU, or with ``--device cuda`` one replica per visible GPU
(round-robin) -- then measures in separate child processes (so peaks do not mix):

- ``averager``: ``dflash.train.averaging.Averager`` (bounded slice buffers, pipelined, host threads);
- ``engine``: with ``--engine FILE``, the ``Averager`` of another version of dflash/train/averaging.py, e.g. the
  one before a change (``git show REV:dflash/train/averaging.py > /tmp/old.py``), for a before/after table;
- ``naive``: what averaging usually looks like, ``{k: mean(sd[k] for sd in state_dicts)}`` and
  ``load_state_dict`` into every replica (a model-sized temporary, and more).

Figures per method: seconds per round (best of ``--rounds``, the first round allocates the buffers and is
reported apart), seconds per GB of one replica, peak extra host memory, and the copy bound: every replica's
bytes copied out once and back once at the bandwidth measured here for one big copy (host memcpy on the
CPU; pinned D2H + H2D per GPU, GPUs in parallel) -- ``ratio`` = round / bound (goal: within 2x).
``--threads`` sets torch's threads (and so the measured memcpy) and the averager's host threads alike.

Peak RSS is the kernel's VmHWM, reset to the current RSS right before averaging (``/proc/self/clear_refs``).
"""

from __future__ import annotations

if (
    not __package__
):  # `python bench/averaging_memory.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.averaging_memory")

import argparse
import json
import os
import subprocess
import sys
import time
import typing as t
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def load_engine(path: str) -> type:
    import importlib.util

    spec = importlib.util.spec_from_file_location("averaging_engine", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Averager


def child(method: str, a: argparse.Namespace) -> dict[str, t.Any]:
    import torch

    from dflash.train.averaging import Averager, copy_bound_seconds, measure_copy_bandwidth

    torch.set_num_threads(a.threads)
    devices = [torch.device("cpu")] * a.replicas
    if a.device == "cuda":
        devices = [torch.device("cuda", r % torch.cuda.device_count()) for r in range(a.replicas)]
    models = []
    for r in range(a.replicas):
        torch.manual_seed(r)  # diverged replicas
        models.append(
            torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width, bias=False) for _ in range(a.layers)]).to(
                devices[r]
            )
        )
    params = [list(m.parameters()) for m in models]
    model_bytes = sum(p.numel() * p.element_size() for p in params[0])
    bw = {d: measure_copy_bandwidth(d) for d in set(devices)}
    bound = copy_bound_seconds(params, bw)
    kw: dict[str, t.Any] = {"chunk_numel": a.chunk}
    if method == "averager":
        avg: t.Any = Averager.for_replicas(params, threads=a.threads, **kw)
    elif method == "engine":
        avg = load_engine(a.engine).for_replicas(params, **kw)
    before = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    times = []
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        if method == "naive":
            with torch.no_grad():
                sds = [m.state_dict() for m in models]
                mean = {k: sum(sd[k].float().cpu() for sd in sds) / len(sds) for k in sds[0]}
                for m in models:
                    m.load_state_dict(mean)
                del sds, mean
        else:
            avg.average(params)
        if a.device == "cuda":
            torch.cuda.synchronize()  # the old engine and naive leave nothing queued; this is for fairness
        times.append(time.perf_counter() - t0)
    peak = rss_kib("VmHWM")
    buffers = avg.buffer_bytes if method != "naive" else model_bytes
    first = [p.detach() for p in models[0].parameters()]
    assert all(torch.equal(x, y.detach().to(x.device)) for m in models[1:] for x, y in zip(first, m.parameters()))
    best = min(times[1:]) if len(times) > 1 else times[0]
    return {
        "method": method,
        "replicas": a.replicas,
        "device": a.device,
        "threads": a.threads,
        "model_mb": model_bytes / 2**20,
        "rss_before_mb": before / 1024,
        "peak_mb": peak / 1024,
        "extra_mb": (peak - before) / 1024,
        "buffers_mb": buffers / 2**20,
        "first_s": times[0],
        "seconds": best,
        "s_per_gb": best / (model_bytes / 1e9),
        "bound_s": bound,
        "ratio": best / bound,
        "bandwidth_gb_s": {str(d): [round(b.out / 1e9, 2), round(b.back / 1e9, 2)] for d, b in bw.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=1 << 22, help="averager slice, elements (default 4M = 16 MiB)")
    ap.add_argument(
        "--threads",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="torch threads and averager host threads (default: min(8, cores))",
    )
    ap.add_argument("--rounds", type=int, default=3, help="rounds per method; the best after the first is reported")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the replicas live")
    ap.add_argument("--engine", default=None, help="another dflash/train/averaging.py to compare (e.g. the one before)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines instead of the table")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing to measure")
            return 0
    methods = ["averager"] + (["engine"] if args.engine else []) + ["naive"]
    rows = []
    for method in methods:
        argv = [
            sys.executable,
            "-m",
            "bench.averaging_memory",
            "--child",
            method,
            "--replicas",
            str(args.replicas),
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
            "--chunk",
            str(args.chunk),
            "--threads",
            str(args.threads),
            "--rounds",
            str(args.rounds),
            "--device",
            args.device,
        ]
        if args.engine:
            argv += ["--engine", str(Path(args.engine).resolve())]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    r0 = rows[0]
    print(
        f"{args.replicas} replicas x {r0['model_mb']:.0f} MB fp32 on {args.device} "
        f"({args.replicas * r0['model_mb']:.0f} MB of replicas), RSS before averaging ~{r0['rss_before_mb']:.0f} MB, "
        f"{args.threads} threads, chunk {args.chunk} elements"
    )
    print(
        "copy bandwidth GB/s (out, back): "
        + ", ".join(f"{d} {v[0]:.1f}/{v[1]:.1f}" for d, v in r0["bandwidth_gb_s"].items())
    )
    print(
        f"{'method':<10} {'peak RSS MB':>12} {'extra MB':>9} {'buffers MB':>11} {'1st s':>7} {'round s':>8} "
        f"{'s/GB':>6} {'bound s':>8} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['method']:<10} {r['peak_mb']:12.1f} {r['extra_mb']:9.1f} {r['buffers_mb']:11.1f} {r['first_s']:7.3f} "
            f"{r['seconds']:8.3f} {r['s_per_gb']:6.2f} {r['bound_s']:8.3f} {r['ratio']:6.2f}"
        )
    a, n = rows[0], rows[-1]
    print(
        f"extra memory: averager {a['extra_mb']:.1f} MB = {a['extra_mb'] / a['model_mb']:.2f} x one replica; "
        f"naive {n['extra_mb']:.1f} MB = {n['extra_mb'] / n['model_mb']:.2f} x one replica "
        f"(ratio naive/averager {n['extra_mb'] / max(a['extra_mb'], 1e-9):.1f})"
    )
    print(f"averager round {a['seconds']:.3f} s = {a['ratio']:.2f} x the copy bound ({a['bound_s']:.3f} s; goal <= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
