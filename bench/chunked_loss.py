"""Drafter training step on CPU: chunked (checkpointed) lm_head + cross-entropy vs all at once.

    .venv/bin/python -m bench.chunked_loss                      # 64 anchors x 16 slots x 32K vocab, hidden 64
    .venv/bin/python -m bench.chunked_loss --anchors 128 --vocab 65536

Each variant runs in fresh processes, twice: once for time (the median step, forward + backward of
``drafter_loss``, default allocator) and once for memory: the peak resident memory the step adds over
the set-up (``ru_maxrss`` after the steps minus the RSS just before the first step), measured with
``MALLOC_MMAP_THRESHOLD_`` fixed so that glibc hands every large freed tensor back to the OS and RSS
follows the live tensors (its default dynamic threshold keeps freed chunks, and RSS would show the
allocator's high-water mark instead; that setting slows large allocations, hence the separate run).
One torch thread, so that figures are comparable on a shared machine. Prints figures and ratios only.
"""

from __future__ import annotations

if not __package__:  # `python bench/chunked_loss.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.chunked_loss")

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import typing as t
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the children run as `-m bench.chunked_loss` from here


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_variant(args: argparse.Namespace, chunk: int | None) -> dict[str, float]:
    import torch

    from dflash.model.drafter import DFlashDraftModel, draft_config_for
    from dflash.model.loss import drafter_loss
    from dflash.model.target import TargetModel, tiny_target_config

    torch.set_num_threads(1)
    heads = max(1, args.hidden // 16)
    tcfg = tiny_target_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=8,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=16,
        intermediate_size=2 * args.hidden,
    )
    target = TargetModel.from_config(tcfg, seed=0, num_draft_layers=args.layers)
    drafter = DFlashDraftModel(
        draft_config_for(tcfg, num_layers=args.layers, block_size=args.block, mask_token_id=args.vocab - 1)
    )
    head = target.head()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab - 1, (1, args.seq), generator=gen)
    loss_mask = torch.ones_like(ids)
    feats = target.features(ids)
    opt = torch.optim.SGD(drafter.parameters(), lr=1e-3)

    def step() -> float:
        out = drafter_loss(
            drafter, head, ids, loss_mask, feats, num_anchors=args.anchors, generator=gen, chunk_size=chunk
        )
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        return float(out.loss.detach())

    before = _rss_bytes()
    step()  # warm-up; its peak counts (it is the same work as every step)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"step_s": statistics.median(times), "peak_added_mb": max(0, peak - before) / 2**20}


def _child(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    return t.cast(dict[str, float], json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchors", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=8, help="blocks per chunk for the chunked variant")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variant", choices=["chunked", "unchunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.variant:
        print(json.dumps(run_variant(args, args.chunk if args.variant == "chunked" else None)))
        return

    results: dict[str, dict[str, float]] = {}
    for variant in ("unchunked", "chunked"):
        cmd = [sys.executable, "-m", "bench.chunked_loss", "--variant", variant] + [
            f"--{k}={v}" for k, v in vars(args).items() if k != "variant"
        ]
        timed = _child(cmd, dict(os.environ, OMP_NUM_THREADS="1"))
        sized = _child(cmd, dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072"))
        results[variant] = {"step_s": timed["step_s"], "peak_added_mb": sized["peak_added_mb"]}

    slots = args.anchors * args.block
    logits_mb = slots * args.vocab * 4 / 2**20
    print(
        f"shape: {args.anchors} anchors x {args.block} slots x vocab {args.vocab}, hidden {args.hidden}, "
        f"seq {args.seq}, {args.layers} drafter layers; fp32 logits of one step = {logits_mb:.0f} MB"
    )
    for variant in ("unchunked", "chunked"):
        r = results[variant]
        label = (
            variant if variant == "unchunked" else f"chunked ({args.chunk} blocks = {args.chunk * args.block} slots)"
        )
        print(f"{label:34s} step {r['step_s'] * 1000:8.1f} ms   peak added {r['peak_added_mb']:8.1f} MB")
    u, c = results["unchunked"], results["chunked"]
    print(f"time ratio chunked/unchunked: {c['step_s'] / u['step_s']:.2f}")
    if c["peak_added_mb"] > 0:
        print(f"memory ratio unchunked/chunked: {u['peak_added_mb'] / c['peak_added_mb']:.1f}")


if __name__ == "__main__":
    main()
