"""How long a checkpoint keeps the drafters at the barrier: before (write everything there) and after
(a CPU snapshot; a background thread writes it).

    .venv/bin/python -m bench.checkpoint_barrier [--replicas 3] [--hidden 1024] [--layers 4] [--dtype float32]
        [--device cpu|cuda:0] [--dir /var/tmp/ckpt-bench]

Builds a DFlash drafter (``--layers`` draft layers over a Qwen3-shaped target of width ``--hidden``) and
``--replicas`` AdamW optimizers with their moments filled (one step), then times:

- ``before``: what the barrier did until now: every replica's AdamW state (and the fp32 masters when the
  drafter is not fp32) pulled to CPU and written + fsynced by ``save_checkpoint`` while the drafters wait
  (now also with sha256 sums, which the old code did not compute: the old barrier was a little shorter);
- ``after``: the barrier's part now: ``snapshot`` of ONE replica (weights, moments, masters) to CPU; and,
  apart, the background write of that snapshot (the drafters train meanwhile). Twice: the first
  checkpoint of a run allocates its snapshot, later ones write over the previous one (already on disk).

Prints bytes, seconds and GB/s. On CUDA the snapshot is a device-to-host copy; on the CPU a memcpy.
"""

from __future__ import annotations

if (
    not __package__
):  # `python bench/checkpoint_barrier.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.checkpoint_barrier")

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.dtypes import NAMES, torch_dtype
from dflash.model.drafter import DFlashDraftModel, draft_config_for
from dflash.model.target import tiny_target_config


def nbytes(obj: object) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", choices=NAMES, default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dir", default=None, help="Where to write (default: a temp dir under /var/tmp).")
    args = ap.parse_args()

    h = args.hidden
    tc = tiny_target_config(
        vocab_size=1024,
        hidden_size=h,
        intermediate_size=3 * h,
        num_hidden_layers=8,
        num_attention_heads=max(1, h // 128),
        num_key_value_heads=max(1, h // 512),
        head_dim=128,
    )
    torch.manual_seed(0)
    model = DFlashDraftModel(draft_config_for(tc, num_layers=args.layers, block_size=16, mask_token_id=1023))
    model.to(device=args.device, dtype=torch_dtype(args.dtype))
    params = [p for p in model.parameters() if p.requires_grad]
    separate = torch_dtype(args.dtype) != torch.float32
    opts, masters = [], []
    for _ in range(args.replicas):  # each replica's masters and moments (the model is shared: same bytes)
        m = [torch.nn.Parameter(p.detach().float().clone()) for p in params] if separate else params
        opt = torch.optim.AdamW(m, lr=1e-4)
        for x in m:
            x.grad = torch.randn_like(x)
        opt.step()
        opts.append(opt)
        masters.append(m)
    n_params = sum(p.numel() for p in params)
    state = {"step": 1, "note": "bench"}
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir="/var/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    try:
        print(
            f"drafter: {n_params / 1e6:.1f}M params ({args.dtype}) on {args.device}; {args.replicas} replicas; "
            f"writing to {root}"
        )
        # before: everything at the barrier
        sync()
        t0 = time.perf_counter()
        before_opt = {
            "replicas": [o.state_dict() for o in opts],
            "masters": [x.detach().cpu() for x in masters[0]] if separate else None,
        }
        path = ckpt.save_checkpoint(
            root / "before", step=1, drafter=model, trainer_state=state, optimizer_state=before_opt, keep=None
        )
        t_before = time.perf_counter() - t0
        size_before = sum(f.stat().st_size for f in path.iterdir())
        # after: the barrier takes a snapshot of one replica; the writer thread writes it
        print(
            f"before: barrier {t_before:7.3f} s  ({size_before / 1e9:.3f} GB written and fsynced at the barrier, "
            f"{size_before / 1e9 / t_before:.2f} GB/s)"
        )
        # after: the barrier takes a snapshot of one replica; the writer thread writes it. The first
        # checkpoint of a run allocates the snapshot; later ones write over the previous (written) one.
        writer = ckpt.CheckpointWriter(root / "after", keep=None)
        run_id = ckpt.new_run_id()
        barriers = []
        for step, label in ((1, "first"), (2, "later")):
            writer.wait()
            spare = writer.spare()
            sync()
            t0 = time.perf_counter()
            snap = ckpt.snapshot(
                model,
                step=step,
                trainer_state=state,
                run_id=run_id,
                reuse=spare,
                optimizer_state={"replicas": [opts[0].state_dict()], "masters": list(masters[0]) if separate else None},
            )
            sync()
            t_barrier = time.perf_counter() - t0
            barriers.append(t_barrier)
            writer.submit(snap)
            t1 = time.perf_counter()
            out = writer.wait()
            t_write = time.perf_counter() - t1
            assert out is not None
            size_after = sum(f.stat().st_size for f in out.iterdir())
            snap_bytes = nbytes(snap.weights) + nbytes(snap.optimizer_state)
            print(
                f"after:  barrier {t_barrier:7.3f} s  ({label} checkpoint: snapshot {snap_bytes / 1e9:.3f} GB to CPU, "
                f"{snap_bytes / 1e9 / max(t_barrier, 1e-9):.2f} GB/s); background write {t_write:.3f} s "
                f"({size_after / 1e9:.3f} GB)"
            )
        print(
            f"barrier: {t_before / max(barriers[0], 1e-9):.1f}x shorter (first checkpoint), "
            f"{t_before / max(barriers[1], 1e-9):.1f}x (later ones)"
        )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
