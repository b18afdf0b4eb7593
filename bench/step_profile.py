"""Host time and host syncs of the hot loop: one target forward, one drafter step, one flex BlockMask.

    .venv/bin/python -m bench.step_profile                         # hidden 128, 4 x 512 tokens, 32 anchors x 16
    .venv/bin/python -m bench.step_profile --seq 1024 --steps 20 --json

What it measures (one torch thread, CPU unless --device names another):

- ``target fwd``: ``TargetReplica.produce`` on one batch (the target thread's work per item);
- ``drafter step``: ``DrafterReplica.step`` (loss, backward, clip, AdamW, master copies) plus
  ``Metrics.record`` (log_every steps per line), i.e. the drafter thread's work per item;
- ``block mask``: ``training_block_mask`` alone at ``--mask-seq`` x ``--mask-anchors`` blocks (the flex
  mask the GPU path builds every step), with the bytes its ops allocate (sum of op outputs).

Host syncs are counted with a ``TorchDispatchMode``: ``aten._local_scalar_dense`` (``item()``, ``int()``,
``float()``, ``bool()`` of a tensor) and the ops whose output shape depends on data (``nonzero``,
``masked_select``, ``unique``...), which wait for the device on CUDA; on a GPU also every copy to the host
and every host-to-GPU copy without ``non_blocking`` (on the CPU there are no such copies to see).
``tolist()`` and ``numpy()`` of a CPU tensor read host memory without an op: the code uses them for
host-side data only (token ids, loss masks), so they are rightly not counted.
Prints a small table (median ms per call, syncs per call); ``--json`` prints one JSON object instead.
"""

from __future__ import annotations

if not __package__:  # `python bench/step_profile.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.step_profile")

import argparse
import collections
import io
import json
import statistics
import time
import types
import typing as t
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]

# ops that read a device value on the host (a sync on CUDA)
SYNC_OPS = {
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "repeat_interleave",
    "nonzero_static",
    "argwhere",
    "is_nonzero",
    "_assert_async",
}


def _crosses_to_host_or_blocks(name: str, args: t.Any, kwargs: dict[str, t.Any]) -> bool:
    """A copy from a GPU to the host, or a host-to-GPU copy without non_blocking: the host waits (GPU only)."""
    if name == "_to_copy":
        src, dst = args[0].device, kwargs.get("device") or args[0].device
    else:
        src, dst = args[1].device, args[0].device
    non_blocking = kwargs.get("non_blocking", args[2] if name == "copy_" and len(args) > 2 else False)
    if src.type != "cpu" and dst.type == "cpu":
        return True
    return src.type == "cpu" and dst.type != "cpu" and not non_blocking


class OpCounter(TorchDispatchMode):
    """Counts sync ops by name and sums the bytes of every op's tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: t.Any, types_: t.Any, args: t.Any = (), kwargs: t.Any = None) -> t.Any:
        name = func._schema.name.split("::")[-1]
        kwargs = kwargs or {}
        if name in SYNC_OPS:
            # repeat_interleave with output_size known is no sync
            if not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
                self.syncs[name] += 1
        elif name in ("_to_copy", "copy_") and _crosses_to_host_or_blocks(name, args, kwargs):
            self.syncs[f"{name} (blocking copy)"] += 1
        out = func(*args, **kwargs)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.bytes += o.numel() * o.element_size()
        return out


def build(args: argparse.Namespace) -> tuple[t.Any, t.Any, t.Any, t.Any]:
    from dflash.config import load_config
    from dflash.model.drafter import DFlashDraftModel, draft_config_for
    from dflash.model.target import TargetModel, tiny_target_config
    from dflash.train.metrics import Metrics
    from dflash.train.replicas import DrafterReplica, LRSchedule, TargetReplica

    heads = max(1, args.hidden // 32)
    tcfg = tiny_target_config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=8,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        intermediate_size=3 * args.hidden,
    )
    target = TargetModel.from_config(tcfg, seed=0, device=args.device, num_draft_layers=args.layers)
    cfg = load_config(
        REPO / "configs" / "tiny-random.toml",
        [
            f"drafter.layers={args.layers}",
            f"drafter.block_size={args.block}",
            f"drafter.num_anchors={args.anchors}",
            "optim.lr=1e-4",
            "max_steps=1000000",
        ],
    )
    draft = DFlashDraftModel(
        draft_config_for(
            tcfg,
            num_layers=args.layers,
            block_size=args.block,
            mask_token_id=args.vocab - 1,
            target_layer_ids=target.layer_ids,
        )
    )
    draft.to(args.device)
    schedule = LRSchedule(lr=1e-4, total_steps=1_000_000, warmup_ratio=0.0, schedule="constant", min_lr_ratio=0.0)
    replica = DrafterReplica(
        draft, target.head().to(args.device), device=args.device, cfg=cfg, schedule=schedule, seed=0, index=0
    )
    producer = TargetReplica(target, args.device, args.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=gen)
    att = torch.ones_like(ids)
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : args.seq // 4] = 0  # a prompt
    batch = types.SimpleNamespace(
        input_ids=ids, attention_mask=att, loss_mask=loss_mask, index=0, n_tokens=int(att.sum())
    )
    metrics = Metrics(log_every=args.log_every, stream=io.StringIO())
    return producer, replica, batch, metrics


def timed(fn: t.Callable[[], t.Any], n: int, warm: int) -> tuple[float, dict[str, float], float]:
    """Median ms per call, syncs per call by op, op-output MB per call (counted on separate calls)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    counter = OpCounter()
    with counter:
        for _ in range(n):
            fn()
    per = {k: v / n for k, v in sorted(counter.syncs.items())}
    return statistics.median(times), per, counter.bytes / n / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--mask-seq", type=int, default=4096)
    p.add_argument("--mask-anchors", type=int, default=64)
    p.add_argument("--mask-batch", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    from dflash.model.loss import sample_anchors, training_block_mask
    from dflash.train.replicas import FeatureBatch

    producer, replica, batch, metrics = build(args)
    payload: FeatureBatch = producer.produce(batch)
    step_no = [0]

    def drafter_step() -> None:
        step_no[0] += 1
        stats = replica.step(payload, step=step_no[0])
        metrics.record(step_no[0], stats, int(batch.n_tokens))

    lm = torch.ones(args.mask_batch, args.mask_seq, dtype=torch.long, device=args.device)
    anchors = sample_anchors(
        lm,
        num_anchors=args.mask_anchors,
        block_size=args.block,
        generator=torch.Generator(device=args.device).manual_seed(0),
    )

    def block_mask() -> None:
        training_block_mask(anchors, seq_len=args.mask_seq, block_size=args.block)

    rows = [
        ("target fwd", *timed(lambda: producer.produce(batch), args.steps, 1)),
        ("drafter step", *timed(drafter_step, args.steps, 2)),
        ("block mask", *timed(block_mask, max(3, args.steps // 2), 1)),
    ]
    shape = (
        f"hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x {args.seq}, anchors {args.anchors} x "
        f"block {args.block}; mask {args.mask_batch} x {args.mask_seq} with {args.mask_anchors} blocks; "
        f"device {args.device}, torch {torch.__version__}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "shape": shape,
                    "rows": [
                        {
                            "what": w,
                            "ms": round(ms, 3),
                            "syncs": round(sum(s.values()), 2),
                            "sync_ops": s,
                            "op_mb": round(mb, 2),
                        }
                        for w, ms, s, mb in rows
                    ],
                }
            )
        )
        return 0
    print(shape)
    print(f"{'':14} {'ms/call':>9} {'syncs/call':>11} {'op MB/call':>11}  sync ops")
    for what, ms, syncs, mb in rows:
        ops = ", ".join(f"{k} {v:g}" for k, v in syncs.items()) or "-"
        print(f"{what:14} {ms:9.2f} {sum(syncs.values()):11.2f} {mb:11.1f}  {ops}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
