"""One real drafter step on the CPU: its peak RSS against ``dflash plan``'s figures for it (test_plan.py runs
this in a process of its own, with large blocks mmapped so that freed memory leaves the RSS).

Prints one JSON line: measured (the peak over the RSS before the step) and planned (optimizer state,
gradients and activations: what the step allocates; the parameters exist before it).
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

from dflash.config import load_config
from dflash.dtypes import torch_dtype
from dflash.models import drafter_spec, initial_drafter, load_target
from dflash.train.compile import prepare_drafter
from dflash.train.plan import make_plan, read_shapes
from dflash.train.replicas import DrafterReplica, FeatureBatch, LRSchedule, ReplicaConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-random.toml"
# wide enough that a step's activations (~200 MB) dwarf the allocator's noise, small enough for ~2 s of compute
SHAPE = [
    "target.tiny.vocab_size=2048",
    "target.tiny.hidden_size=256",
    "target.tiny.intermediate_size=512",
    "target.tiny.num_layers=6",
    "target.tiny.head_dim=64",
    "drafter.num_anchors=128",
    "data.max_length=1024",
    "data.batch_size=2",
    "devices.targets=cpu",
    "devices.drafters=cpu",
]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> None:
    cfg = load_config(TINY, SHAPE)
    torch.set_num_threads(1)
    target = load_target(cfg, "cpu")
    spec = drafter_spec(cfg, target)
    rows, seq = cfg.data.batch_size, cfg.data.max_length
    ids = torch.randint(0, 500, (rows, seq), generator=torch.Generator().manual_seed(0))
    feats = target.features(ids)
    assert isinstance(feats, torch.Tensor)
    head = target.head()
    cpu = make_plan(cfg, read_shapes(cfg), gpu_memory=lambda _d: None, host_memory=None).gpus[0]
    planned = sum(cpu.get(k) for k in ("optimizer", "gradients", "activations"))
    model = initial_drafter(spec.config, seed=0).to(dtype=torch_dtype(cfg.drafter.dtype))
    prepare_drafter(model, activation_checkpointing=cfg.activation_checkpointing, compile=False)
    schedule = LRSchedule(lr=1e-3, total_steps=10, warmup_ratio=0, schedule="cosine", min_lr_ratio=0)
    replica = DrafterReplica(model, head, device="cpu", cfg=ReplicaConfig.of(cfg), schedule=schedule, seed=0, index=0)
    batch = FeatureBatch(ids, torch.ones(rows, seq, dtype=torch.long), feats, 0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from here
    start = rss()
    replica.step(batch, step=1)
    print(json.dumps({"measured": peak_rss() - start, "planned": planned}))


if __name__ == "__main__":
    main()
