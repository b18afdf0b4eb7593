"""MFU of the drafter step, as ``python -m bench.gpu_smoke`` reports it: its model FLOPs and the GPUs' peaks.

    .venv/bin/python -m bench.mfu        # the peak table, and the peak this machine's GPU 0 gets from it

MFU = model FLOPs of one step / step time / (peak bf16 FLOP/s x drafter GPUs in
parallel; ``--peak-tflops`` or a table of known GPUs). Per row of a batch (S context positions, A anchors,
block size B, so Q = A*B query tokens; drafter: L layers, width H, heads h, kv heads g, head dim d, MLP
width I; n target layers read; vocabulary V)::

    forward = 2*S*(n*H)*H                                 fc over the context features
            + L*2*S*(2*H*g*d)                             k/v projections of the context, every layer
            + L*2*Q*(H*h*d + 2*H*g*d + h*d*H + 3*H*I)     q/k/v/o + MLP of the block tokens
            + L*4*h*d*sum_over_queries(visible keys)      QK^T and PV, only what the mask lets a query see
            + 2*Q*H*V                                     the frozen lm_head over the block tokens
    step    = 3 * (forward - lm_head) + 2 * lm_head       backward: 2x, no weight gradient for the frozen head

with anchors spread evenly over the row (visible keys of a block at anchor a: a context + B block keys).
Activation-checkpointing recompute is not counted (model FLOPs, not hardware FLOPs). The step time is the
CUDA events around each drafter step on the drafter's stream; on one shared GPU the target's kernels run
on the target's own stream beside it (not inside the events, but sharing the SMs): one-GPU figures.
"""

from __future__ import annotations

if not __package__:  # `python bench/mfu.py`: bench imports only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.mfu")

import argparse
import typing as t

# Dense bf16 tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name() (first match wins).
PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("A6000", 155e12),
    ("4090", 165e12),
    ("3090", 71e12),
)


def drafter_step_flops(args: argparse.Namespace, shape: dict[str, int], draft: t.Any, n_target_layers: int) -> float:
    """Model FLOPs of one drafter step on one batch (the formula in the module docstring)."""
    S, B = args.seq_len, args.block_size
    A = min(args.anchors, S - B)
    H, V = int(draft.hidden_size), shape["vocab_size"]
    h, g, d, inter = (
        int(draft.num_attention_heads),
        int(draft.num_key_value_heads),
        int(draft.head_dim),
        int(draft.intermediate_size),
    )
    L = int(draft.num_hidden_layers)
    Q = A * B
    anchors = [int((i + 0.5) * (S - B) / A) for i in range(A)]
    visible = sum((a + B) * B for a in anchors)
    fwd_train = (
        2 * S * (n_target_layers * H) * H
        + L * 2 * S * (2 * H * g * d)
        + L * 2 * Q * (H * h * d + 2 * H * g * d + h * d * H + 3 * H * inter)
        + L * 4 * h * d * visible
    )
    head = 2 * Q * H * V
    return args.batch * (3 * fwd_train + 2 * head)


def peak_flops(args: argparse.Namespace) -> tuple[float | None, str]:
    import torch

    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if not torch.cuda.is_available() or args.cpu:
        return None, "cpu"
    name = torch.cuda.get_device_name(0)
    for key, value in PEAK_BF16:
        if key in name:
            return value, name
    return None, name


def main() -> int:
    for key, value in PEAK_BF16:
        print(f"{key:8} {value / 1e12:7.0f} TFLOP/s bf16")
    peak, name = peak_flops(argparse.Namespace(peak_tflops=None, cpu=False))
    print(f"this machine: {name}: " + (f"{peak / 1e12:.0f} TFLOP/s" if peak else "no peak known (--peak-tflops)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
