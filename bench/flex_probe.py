"""The first minute on a GPU box: does inductor compile flex attention for a one-row batch of short queries?

    python -m bench.flex_probe [--json PATH] [--cpu]

The shape of the warm-up's short-query class on one row (q [1, 16, 112, 128], k/v [1, 8, 2160, 128], bf16,
GQA 2, ``dynamic=True``), compiled twice: with torch's own template choice (on CUDA the decode template,
whose default block leaves no config at 112 x 2 queries: NoValidChoicesError in torch 2.11, a ValueError
in 2.14) and with ``BACKEND=TRITON``, forward and backward (what dflash's training calls pass). Prints
one line per case and the device's capability and shared memory per block (flex's configs must fit it:
99 KB on sm_120 against 227 KB on sm_90/sm_100). ``--cpu``: the same calls on the CPU with the eager
backend, forward only (the plumbing, for tests). Exit 0 when the BACKEND=TRITON case passed.
"""

from __future__ import annotations

if not __package__:  # `python bench/flex_probe.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.flex_probe")

import argparse
import json
import sys
import time
import typing as t
from pathlib import Path

SHAPE_Q = (1, 16, 112, 128)
SHAPE_KV = (1, 8, 2160, 128)


def first_line(e: BaseException) -> str:
    """The exception's type and the first line of its message that names an error."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln]
    return f"{type(e).__name__}: {(named or lines or [''])[0]}"[:300]


def device_facts(cpu: bool) -> dict[str, t.Any]:
    import torch

    if cpu:
        return {"device": "cpu", "capability": None, "shared_memory_per_block_optin": None}
    p = torch.cuda.get_device_properties(0)
    return {
        "device": p.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "shared_memory_per_block_optin": getattr(p, "shared_memory_per_block_optin", None),
        "torch": torch.__version__,
    }


def probe(name: str, kernel_options: dict[str, t.Any] | None, *, backward: bool, cpu: bool) -> dict[str, t.Any]:
    """One compile of flex attention at the probe's shape: ok, or the error's first line."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.reset()
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    fn = torch.compile(flex_attention, dynamic=True, fullgraph=True, backend="eager" if cpu else "inductor")
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(SHAPE_Q, device=device, dtype=dtype, generator=gen, requires_grad=backward)
    k, v = (torch.randn(SHAPE_KV, device=device, dtype=dtype, generator=gen, requires_grad=backward) for _ in "kv")
    ctx = SHAPE_KV[2] - SHAPE_Q[2]
    bm = create_block_mask(lambda b, h, qi, ki: ki <= qi + ctx, 1, 1, SHAPE_Q[2], SHAPE_KV[2], device=device)
    t0 = time.perf_counter()
    try:
        out = fn(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=kernel_options)
        if backward:
            out.float().sum().backward()
        if not cpu:
            torch.cuda.synchronize()
        why = None
    except Exception as e:  # the finding: printed, the next case still runs
        why = first_line(e)
    return {"name": name, "ok": why is None, "why": why, "backward": backward, "s": round(time.perf_counter() - t0, 1)}


def main(argv: t.Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/flex_probe.py", description=__doc__)
    ap.add_argument("--json", type=Path, default=None, help="write the facts and the cases to this file")
    ap.add_argument("--cpu", action="store_true", help="the same calls on the CPU, eager backend, forward only")
    args = ap.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("flex_probe: no CUDA device: nothing to probe")
        return 0
    facts = device_facts(args.cpu)
    print(
        f"flex_probe: {facts['device']}, capability {facts['capability']}, "
        f"shared memory per block (opt-in) {facts['shared_memory_per_block_optin']} bytes",
        flush=True,
    )
    cases = []
    for label, opts, backward in (
        ("torch's template choice (AUTO)", None, False),
        ("BACKEND=TRITON", {"BACKEND": "TRITON"}, not args.cpu),
    ):
        name = f"{label}, {'forward + backward' if backward else 'forward'}"
        c = probe(name, opts, backward=backward, cpu=args.cpu)
        cases.append(c)
        print(f"flex_probe: {'ok  ' if c['ok'] else 'FAIL'} {name} ({c['s']}s){': ' + c['why'] if c['why'] else ''}")
        if args.json is not None:
            args.json.write_text(json.dumps({**facts, "cases": cases}))
    return 0 if cases[-1]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
