"""GPU smoke test: the real training pipeline on every visible GPU, its figures, and a real CUDA OOM classified.

    .venv/bin/python -m bench.gpu_smoke [--quick] [--steps 60] [--json] [--keep] ...
    .venv/bin/python -m bench.gpu_smoke --cpu        # the same path, tiny, on the CPU (< 60 s; tests use it)
    bench/device_check.sh                            # --quick on a lent GPU box, in one command (docs/gpu.md)

On a CUDA machine (``--quick``: at most ~6 minutes on one GPU, compile included):

1. builds a Qwen3-shaped target of a few hundred million parameters (default: Qwen3-0.6B's width with 16
   layers, untied head: ~0.56B) from a config written in code, random init, bf16, nothing downloaded, and
   saves it to a temp dir, so the real ``Run`` loads it as it would a user's checkpoint; writes random
   pre-tokenized data over Qwen3's vocabulary (151936 rows), never holding the MASK id the run's rule picks
   (the published 151669: ``dflash.models.default_rule_mask_id``); prints the vocabulary and MASK id;
2. trains it through the real pipeline (``dflash.train.run.Run`` from a ``RunConfig``): the visible GPUs split
   into targets (first half) and drafters (the rest, at least one each; one GPU is shared: the target then
   runs on its own CUDA stream, so its kernels are not inside the drafter's step events), with
   ``compile = true`` (inductor), activation checkpointing and the compiled flex_attention BlockMask;
   ``--quick`` warms up only the shape classes the smoke's data makes (``dflash.train.compile.shape_class``);
3. ``--quick``: the class check: a one-layer drafter of the same width is compiled for every shape class
   (``dflash.train.compile.warm_up_shapes``), then one batch of each class, in other sizes than its warm-up's, is
   trained under ``fail_on_recompile``: each must hit compiled code;
4. prints: the vocabulary and MASK id, Ktok/s, drafter step time, the drafter step's MFU, peak memory per
   GPU, compile time (train() start to the pipeline start: the warm-up), compiled cache entries per drafter
   device, recompiles after warm-up (must be 0), eager (unfused) flex calls (must be 0), and an averaging
   round of the drafter replicas (two on one drafter GPU: a copy is made) against the copy bound (bytes
   moved / measured D2H + H2D bandwidth), with the replicas checked bit-identical and equal to a CPU mean;
5. forces a real CUDA OOM in a drafter step on one GPU (the last drafter GPU) inside a real ``dflash train``
   subprocess under the real runner (``python -m ops.far.runner``) in a temp run dir: once its warm-up is
   done, that GPU's allocator is capped at what it holds plus ``--oom-margin-gib`` (room for the target's
   forward on a shared GPU, not for a drafter step's logits), then reads the run the way ``dflashctl status``
   does (the agent's probe facts -> ``ops.probe.classify``) and checks it says ``crashed`` / ``cuda-oom``
   with that GPU's index.

MFU of the drafter step: ``bench.mfu`` (its model FLOPs formula and the GPUs' peak table).

Without CUDA it prints "no CUDA device: nothing to measure" and exits 0, unless ``--cpu``: then the same
path runs tiny on the CPU (compile off, two drafter threads so a real averaging round happens; the class
check compiles with the ``eager`` backend and dense attention, whose only class is the rows) at Qwen3's
vocabulary and MASK rule, and the OOM step uses the injected OOM (``DFLASH_FAULT=oom-at-step:1``, the
allocator's text) under the same runner and probe, so the arguments, the data, the plumbing and the
printing are tested here.

Exit code: 0 when every check passed, 1 when one failed (the table says which), 2 for bad arguments.
"""

from __future__ import annotations

if not __package__:  # `python bench/gpu_smoke.py`: bench and testkit import only from the repo root, as a package
    raise SystemExit("run it from the repo root as: python -m bench.gpu_smoke")

import argparse
import copy
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
import typing as t
import warnings
from pathlib import Path

from bench import gpu_oom
from bench.mfu import drafter_step_flops, peak_flops

ROOT = Path(__file__).resolve().parents[1]

FLEX_WARNING = "flex_attention called without torch.compile"
QWEN3_VOCAB = 151936  # the GPU configuration's vocabulary: --cpu runs it too, at a tiny width


# --------------------------------------------------------------------------------------------
# Arguments


def parse_args(argv: t.Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="bench/gpu_smoke.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cpu", action="store_true", help="no GPU: run the same path tiny on the CPU (compile off)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="the lent-GPU check: 20 steps, warm-up of the data's shape classes only, then the class check",
    )
    ap.add_argument(
        "--class-budget",
        type=float,
        default=150.0,
        help="seconds the class check may spend compiling (default 150; classes past it are reported unchecked)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object (the figures and checks) on stdout")
    ap.add_argument(
        "--json-file",
        type=Path,
        default=None,
        help="write the figures so far to this file after each part (device_check: kept when a part fails)",
    )
    ap.add_argument("--steps", type=int, default=None, help="global training steps (default 60; --cpu 6)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 2048; --cpu 64)")
    ap.add_argument("--batch", type=int, default=None, help="samples per batch (default 4; --cpu 2)")
    ap.add_argument("--target-layers", type=int, default=None, help="target layers (default 16; --cpu 4)")
    ap.add_argument("--hidden", type=int, default=None, help="target width (default 1024; --cpu 64)")
    ap.add_argument("--drafter-layers", type=int, default=None, help="drafter layers (default 3; --cpu 2)")
    ap.add_argument("--anchors", type=int, default=None, help="anchors per sample (default 256; --cpu 8)")
    ap.add_argument("--block-size", type=int, default=None, help="drafter block size (default 16; --cpu 8)")
    ap.add_argument(
        "--targets",
        type=int,
        default=None,
        help="GPUs for targets (default: half of the visible ones, at least 1; the rest draft)",
    )
    ap.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 peak per GPU in TFLOP/s for MFU (default: known GPUs by name)",
    )
    ap.add_argument(
        "--oom-margin-gib",
        type=float,
        default=0.5,
        help="the OOM step caps the last drafter GPU after warm-up at what it holds + this (default 0.5 GiB)",
    )
    ap.add_argument("--no-oom", action="store_true", help="skip the forced OOM")
    ap.add_argument("--oom-timeout", type=float, default=180.0, help="seconds the OOM run may take (default 180)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (target, data, runs) and print it")
    args = ap.parse_args(argv)
    small = args.cpu
    defaults = {
        "steps": (20 if args.quick else 60, 6),
        "seq_len": (2048, 64),
        "batch": (4, 2),
        "target_layers": (16, 4),
        "hidden": (1024, 64),
        "drafter_layers": (3, 2),
        "anchors": (256, 8),
        "block_size": (16, 8),
    }
    for name, (gpu, cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, cpu if small else gpu)
        elif getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.hidden % 64:
        ap.error(f"--hidden must be a multiple of 64 (the head width), got {args.hidden}")
    if args.seq_len < 2 * args.block_size:
        ap.error(f"--seq-len must be at least twice --block-size ({2 * args.block_size}), got {args.seq_len}")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        ap.error(f"--peak-tflops must be positive, got {args.peak_tflops}")
    if args.oom_margin_gib < 0:
        ap.error(f"--oom-margin-gib must not be negative, got {args.oom_margin_gib}")
    return args


# --------------------------------------------------------------------------------------------
# What the run is made of


def target_shape(args: argparse.Namespace) -> dict[str, int]:
    """Qwen3-0.6B's proportions (head dim 128, 2x the width in query heads, 2 queries per kv head, MLP 3x)
    at --hidden / --target-layers."""
    head_dim = 128 if args.hidden >= 512 else 16
    heads = max(2, 2 * args.hidden // head_dim)
    return {
        "vocab_size": QWEN3_VOCAB,  # --cpu too: the data and MASK rule the GPU run meets
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.target_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": head_dim,
    }


def build_target(path: Path, shape: dict[str, int], *, cuda: bool) -> int:
    """A random-init Qwen3 saved like a downloaded checkpoint; returns its parameter count."""
    import torch
    from transformers import Qwen3ForCausalLM

    from dflash.model.target import tiny_target_config

    config = tiny_target_config(max_position_embeddings=32768, **shape)
    torch.manual_seed(0)
    with torch.device("cuda:0" if cuda else "cpu"):  # random init on the GPU: seconds, not a minute
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16 if cuda else torch.float32)
    count = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return count


def expected_mask_id(target_dir: Path) -> int:
    """The MASK id the run's rule picks for this target (no drafter.mask_token_id, no tokenizer): for Qwen3's
    151936 rows the published 151669, not the last row (``dflash.models.default_rule_mask_id``)."""
    from transformers import AutoConfig

    from dflash.models import default_rule_mask_id

    config = AutoConfig.from_pretrained(target_dir)
    return default_rule_mask_id(config, int(config.vocab_size), None)


def write_data(path: Path, *, rows: int, seq_len: int, vocab: int, mask_id: int) -> None:
    """Random token rows over the whole vocabulary except ``mask_id`` (the dataset refuses a sample holding it)."""
    rng = random.Random(0)
    prompt = min(16, seq_len // 4)
    with path.open("w") as f:
        for _ in range(rows):
            ids = [x + (x >= mask_id) for x in (rng.randrange(vocab - 1) for _ in range(seq_len))]
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (seq_len - prompt)}) + "\n")


def split_devices(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    import torch

    if args.cpu:
        return ["cpu"], ["cpu", "cpu"]
    n = torch.cuda.device_count()
    if n == 1:
        return ["cuda:0"], ["cuda:0"]
    k = args.targets if args.targets is not None else max(1, n // 2)
    if not 1 <= k < n:
        raise SystemExit(f"gpu_smoke: --targets must be between 1 and {n - 1} with {n} GPUs, got {k}")
    return [f"cuda:{i}" for i in range(k)], [f"cuda:{i}" for i in range(k, n)]


def raw_config(args: argparse.Namespace, tmp: Path, targets: list[str], drafters: list[str]) -> dict[str, t.Any]:
    dtype = "float32" if args.cpu else "bfloat16"
    return {
        "max_steps": args.steps,
        "log_every": max(1, args.steps // 8),
        "average_every": max(2, args.steps // 3),
        "seed": 0,
        "output_dir": str(tmp / "out"),
        "compile": not args.cpu,
        "compile_backend": "inductor",
        "activation_checkpointing": True,
        "target": {"path": str(tmp / "target"), "dtype": dtype},
        "drafter": {
            "layers": args.drafter_layers,
            "block_size": args.block_size,
            "num_anchors": args.anchors,
            "dtype": dtype,
        },
        "data": {
            "path": str(tmp / "data.jsonl"),
            "format": "tokens",
            "max_length": args.seq_len,
            "batch_size": args.batch,
        },
        "devices": {"targets": targets, "drafters": drafters},
        "optim": {"sequences_per_update": args.batch},  # one batch per update: the step time is a batch's
        "checkpoint": {"interval": 0, "dir": str(tmp / "ckpt"), "keep": 1, "resume": "never", "optimizer": False},
    }


def to_toml(raw: t.Mapping[str, t.Any]) -> str:
    """Enough TOML for raw_config: scalars, lists of scalars, one level of tables."""

    def value(v: t.Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        raise TypeError(f"no TOML for {v!r}")

    top = [f"{k} = {value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    tables = [
        f"\n[{k}]\n" + "\n".join(f"{kk} = {value(vv)}" for kk, vv in v.items())
        for k, v in raw.items()
        if isinstance(v, dict)
    ]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


# --------------------------------------------------------------------------------------------
# Watching the run: compile time, recompiles, flex warnings


class Watch(logging.Handler):
    """Counts dynamo's "Recompiling function" records and notes when the pipeline starts (after warm-up)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.recompiles: list[str] = []  # after warm-up: each one is a failure
        self.warmup_recompiles: list[str] = []  # during warm-up: expected (shapes marked dynamic there)
        self.started_at: float | None = None
        self.frames_at_start: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "Recompiling function" in msg:
            (self.recompiles if self.started_at is not None else self.warmup_recompiles).append(msg.splitlines()[0])
        elif record.name.startswith("dflash") and msg.startswith("training:") and self.started_at is None:
            self.started_at = time.perf_counter()
            self.frames_at_start = dynamo_frames()


def dynamo_frames() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(counters["frames"]["total"])
    except Exception:  # a torch without these counters: recompiles come from the log records alone
        return 0


def count_eager_flex() -> tuple[list[int], t.Callable[[], None]]:
    """Count every eager (unfused) flex_attention call: torch warns only once per process, so the count
    comes from its warn-once helper, wrapped for the run (behaviour unchanged)."""
    import torch

    count = [0]
    try:
        import torch.nn.attention.flex_attention as fa

        orig = fa._warn_once
        fa._WARNINGS_SHOWN.discard("flex_attention_performance")
    except (ImportError, AttributeError):  # another torch: the warnings caught are the count
        return count, lambda: None

    def counting(warning_id: str, message: str, category: type[Warning] = UserWarning) -> None:
        if warning_id == "flex_attention_performance" and not torch.compiler.is_dynamo_compiling():
            count[0] += 1
        orig(warning_id, message, category)

    fa._warn_once = counting

    def undo() -> None:
        fa._warn_once = orig

    return count, undo


def watch_logs() -> tuple[Watch, t.Callable[[], None]]:
    import torch

    watch = Watch()
    loggers = [logging.getLogger("dflash"), logging.getLogger("torch._dynamo")]
    old_levels = [lg.level for lg in loggers]
    try:
        torch._logging.set_logs(recompiles=True)
    except Exception:  # pragma: no cover - older torch
        pass
    for lg in loggers:
        lg.addHandler(watch)
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
    # The artifact logger propagates to torch._dynamo's handlers only through torch's own setup.
    artifact = logging.getLogger("torch._dynamo.guards.__recompiles")
    artifact.addHandler(watch)

    def undo() -> None:
        for lg, lvl in zip(loggers, old_levels):
            lg.removeHandler(watch)
            lg.setLevel(lvl)
        artifact.removeHandler(watch)
        try:  # the class check compiles on purpose: its recompiles are not logged
            torch._logging.set_logs()
        except Exception:  # pragma: no cover - older torch
            pass

    return watch, undo


# --------------------------------------------------------------------------------------------
# Figures


def interval_figures(records: list[dict[str, t.Any]]) -> dict[str, t.Any]:
    """Ktok/s and drafter step time from the run's own metrics records, the first interval (warm) left out."""
    steady = records[1:] or records
    if not steady:
        return {"ktok_s": None, "drafter_step_s": None}
    ktok = sum(r["ktok_s"] for r in steady) / len(steady)
    busy = items = 0.0
    prev: dict[str, int] = {w["name"]: w["items"] for w in (records[0]["workers"] if len(records) > 1 else [])}
    for r in steady:
        for w in r["workers"]:
            if w["role"] != "drafter":
                continue
            busy += w["busy"] * r["interval_s"]
            items += w["items"] - prev.get(w["name"], 0)
            prev[w["name"]] = w["items"]
    return {"ktok_s": ktok, "drafter_step_s": busy / items if items else None}


def averaging_round(run: t.Any) -> dict[str, t.Any]:
    """One averaging round of the trained replicas through the run's engine, vs the copy bound.

    With one drafter a second replica is made (a perturbed copy on the same device) so a round happens.
    The result is checked: replicas bit-identical, and equal to the mean computed on the CPU."""
    import torch

    from dflash.train.averaging import Averager, copy_bound_seconds, measure_copy_bandwidth

    reps = [r.trainable() for r in run.drafters]
    made = False
    if len(reps) < 2:
        with torch.no_grad():
            reps.append([p.detach().clone().add_(1e-3) for p in reps[0]])
        made = True
    k = max(range(len(reps[0])), key=lambda i: reps[0][i].numel())  # the largest tensor, for the check
    want = torch.stack([rep[k].detach().float().cpu() for rep in reps]).mean(0)
    avg = run.averager if not made else Averager.for_replicas(reps)
    avg.average(reps)  # first round: allocates the pinned buffers
    first = avg.last_round
    avg.average(reps)
    warm = avg.last_round
    bw = {d: measure_copy_bandwidth(d) for d in sorted({p.device for rep in reps for p in rep}, key=str)}
    bound = copy_bound_seconds(reps, bw)
    identical = all(torch.equal(reps[0][i].cpu(), rep[i].cpu()) for rep in reps[1:] for i in range(len(reps[0])))
    close = torch.allclose(reps[0][k].float().cpu(), want, rtol=1e-5, atol=1e-6)
    if made:
        avg.close()
    return {
        "replicas": len(reps),
        "copied_replica": made,
        "mb_per_replica": sum(p.numel() * p.element_size() for p in reps[0]) / 2**20,
        "first_round_s": first.seconds if first else None,
        "round_s": warm.seconds if warm else None,
        "bytes_moved": warm.bytes_moved if warm else None,
        "copy_bound_s": bound,
        "ratio": (warm.seconds / bound) if warm and bound else None,
        "bandwidth_gb_s": {str(d): [round(b.out / 1e9, 2), round(b.back / 1e9, 2)] for d, b in bw.items()},
        "bit_identical": identical,
        "equals_cpu_mean": close,
    }


def gpu_memory() -> list[dict[str, t.Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    return [
        {
            "gpu": i,
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated(i) / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved(i) / 2**30, 2),
            "total_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(torch.cuda.device_count())
    ]


# --------------------------------------------------------------------------------------------
# --quick: warm-up of the data's classes; the class check


def data_shapes(run: t.Any, args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """The warm-up shapes of the classes the run's own batches fall in (one epoch of its batch plan)."""
    from dflash.data.samples import collate
    from dflash.train.compile import batch_shape, shape_class, shapes_for, uses_flex

    flex = uses_flex(run.drafters[0].device)
    met = set()
    batches, _ = run.plan.batches_per_epoch()
    for g in range(batches):
        b = collate([run.dataset.read(i) for i in run.plan.batch(g)], index=g)
        met.add(shape_class(*batch_shape(b.loss_mask, num_anchors=args.anchors), block_size=args.block_size, flex=flex))
    return [s for s in shapes_for(run.drafters[0]) if shape_class(*s, block_size=args.block_size, flex=flex) in met]


def other_size(shape: tuple[int, int, int], *, block_size: int, flex: bool, max_length: int) -> tuple[int, int, int]:
    """A batch of the same class as ``shape`` in other sizes (so the check meets a size warm-up never ran)."""
    from dflash.train.compile import shape_class

    rows, seq, blocks = shape
    want = shape_class(*shape, block_size=block_size, flex=flex)
    more = rows if rows == 1 else rows + 1
    for cand in (
        (more, seq - 1, blocks),
        (more, seq - 1, blocks - 1),
        (more, seq - 2, blocks + 1),
        (more, seq, blocks),
    ):
        r, s_, b = cand
        if b >= 1 and b < s_ <= max_length and shape_class(*cand, block_size=block_size, flex=flex) == want:
            return cand
    return shape


def class_check(args: argparse.Namespace, run: t.Any) -> dict[str, t.Any]:
    """A one-layer drafter of the run's width on its drafter device, compiled for every shape class
    (``dflash.train.compile.warm_up_shapes``) within ``--class-budget`` seconds, then one batch of each warmed
    class in other sizes under ``fail_on_recompile``: each must run compiled code, and no cache entry may
    be added by the batches."""
    import torch

    from dflash.model.drafter import CompileMissError, DFlashDraftModel, draft_config_for
    from dflash.train.compile import (
        compiled_entries,
        prepare_drafter,
        set_recompile_limits,
        shape_class,
        shapes_for,
        uses_flex,
        warm_up,
    )
    from dflash.train.replicas import DrafterReplica, ReplicaConfig

    base = run.drafters[0]
    target = run.targets[0].model
    flex = uses_flex(base.device)
    config = draft_config_for(
        target.model.config,
        num_layers=1,
        block_size=args.block_size,
        mask_token_id=run.mask_token_id,
        target_layer_ids=target.layer_ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = DFlashDraftModel(config).to(device=base.device, dtype=base.model.dtype)
    prepare_drafter(
        model, activation_checkpointing=True, compile=True, backend="eager" if args.cpu else run.cfg.compile_backend
    )
    replica = DrafterReplica(
        model,
        base.head,
        device=base.device,
        cfg=ReplicaConfig.of(run.cfg),
        schedule=run.schedule,
        seed=0,
        index=len(run.drafters),
    )
    kw = dict(feature_size=target.feature_size, vocab_size=run.vocab_size, mask_token_id=run.mask_token_id)
    shapes = shapes_for(replica)
    set_recompile_limits(len(shapes) + compiled_entries(), 1)  # room beside the run's own entries
    t0 = time.perf_counter()
    warmed: list[tuple[int, int, int]] = []
    unchecked: list[tuple[int, int, int]] = []
    failed: list[dict[str, t.Any]] = []
    for shape in shapes:
        if time.perf_counter() - t0 > args.class_budget:
            unchecked.append(shape)
            continue
        try:
            warm_up(replica, shapes=[shape], **kw)
        except Exception as e:  # a class the backend cannot compile is this check's finding, not the smoke's end
            failed.append({"shape": shape, "error": first_line(e)})
            continue
        warmed.append(shape)
    compile_s = time.perf_counter() - t0
    entries = compiled_entries()
    fed: list[dict[str, t.Any]] = []
    torch.compiler.set_stance("fail_on_recompile")
    try:
        for shape in warmed:
            probe = other_size(shape, block_size=args.block_size, flex=flex, max_length=args.seq_len)
            try:  # warm_up's own batch maker, now under fail_on_recompile: a miss raises CompileMissError
                warm_up(replica, shapes=[probe], **kw)
                miss = None
            except CompileMissError as e:
                miss = str(e)
            fed.append(
                {
                    "class": shape_class(*probe, block_size=args.block_size, flex=flex),
                    "warmed": shape,
                    "fed": probe,
                    "ok": miss is None,
                    "miss": miss,
                }
            )
    finally:
        torch.compiler.set_stance("default")
    return {
        "classes": len(shapes),
        "warmed": len(warmed),
        "unchecked": unchecked,
        "compile_s": round(compile_s, 1),
        "entries_after_warm_up": entries,
        "entries_added_by_feed": compiled_entries() - entries,
        "batches": fed,
        "failed": failed,
        "ok": not failed and all(f["ok"] for f in fed) and compiled_entries() == entries,
    }


def first_line(e: BaseException) -> str:
    """The exception's type and the first line of its message that names an error (inductor's wrap the cause:
    "backend='inductor' raised:" comes first)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln]
    return f"{type(e).__name__}: {(named or lines or [''])[0]}"[:300]


# --------------------------------------------------------------------------------------------
# The forced OOM (bench/gpu_oom.py runs it): its config


def oom_config(raw: dict[str, t.Any], tmp: Path, drafters: list[str]) -> Path:
    """The smoke's config for the OOM run: 4 steps, no compile, only the capped GPU drafting (with drafters
    left elsewhere the run would go on without it, by design)."""
    cfg = copy.deepcopy(raw)
    cfg["max_steps"] = 4
    cfg["compile"] = False  # the OOM comes before compiling would pay off; keep the run short
    cfg["checkpoint"] = {**cfg["checkpoint"], "dir": str(tmp / "oom-ckpt")}
    cfg["devices"] = {**cfg["devices"], "drafters": [drafters[-1]]}
    path = tmp / "oom.toml"
    path.write_text(to_toml(cfg))
    return path


# --------------------------------------------------------------------------------------------
# Parts: each one's figures kept even when a later one fails or the time runs out


class Parts:
    """Runs the smoke's parts in turn: a part that raises is a failed part (its first line kept), not the
    smoke's end; after each, one line on the log and the figures so far in ``--json-file``."""

    def __init__(self, result: dict[str, t.Any], path: Path | None, say: t.Callable[[str], None]) -> None:
        self.result, self.path, self.say = result, path, say
        self.write()

    def run(self, name: str, fn: t.Callable[[], t.Any]) -> t.Any:
        t0 = time.perf_counter()
        value, why = None, None
        try:
            value = fn()
        except Exception as e:  # the smoke's finding: the next parts still run
            why = first_line(e)
            logging.getLogger("bench.gpu_smoke").debug("part %s failed", name, exc_info=True)
        seconds = round(time.perf_counter() - t0, 1)
        self.result["parts"].append({"name": name, "ok": why is None, "why": why, "s": seconds})
        self.say(f"part {name}: {'ok' if why is None else 'FAILED: ' + why} ({seconds:.1f}s)")
        self.write()
        return value

    def write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.result, default=str))
        os.replace(tmp, self.path)


# --------------------------------------------------------------------------------------------
# Main


def main(argv: t.Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    t_start = time.perf_counter()
    out = sys.stderr if args.json else sys.stdout

    def say(msg: str) -> None:
        print(f"[gpu_smoke {time.perf_counter() - t_start:6.1f}s] {msg}", file=out, flush=True)

    from dflash.config import parse_config
    from dflash.train.run import Run

    tmp = Path(tempfile.mkdtemp(prefix="dflash-smoke-"))
    try:
        shape = target_shape(args)
        t0 = time.perf_counter()
        n_params = build_target(tmp / "target", shape, cuda=not args.cpu)
        build_s = time.perf_counter() - t0
        say(
            f"target: Qwen3 {shape['num_hidden_layers']} layers x {shape['hidden_size']}, vocab {shape['vocab_size']}: "
            f"{n_params / 1e6:.0f}M params, built and saved in {build_s:.1f}s"
        )
        mask_id = expected_mask_id(tmp / "target")
        write_data(
            tmp / "data.jsonl",
            rows=max(8, args.steps * args.batch * 2),
            seq_len=args.seq_len,
            vocab=shape["vocab_size"],
            mask_id=mask_id,
        )
        say(f"vocabulary {shape['vocab_size']}, MASK id {mask_id} (the run's rule); the data never holds it")
        targets, drafters = split_devices(args)
        raw = raw_config(args, tmp, targets, drafters)
        cfg = parse_config(raw, base=tmp)
        say(
            f"devices: targets {targets}, drafters {drafters}; compile {cfg.compile} ({cfg.compile_backend}), "
            f"activation checkpointing {cfg.activation_checkpointing}; {args.steps} steps of {args.batch} x {args.seq_len} tokens"
        )
        result: dict[str, t.Any] = {
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
            "gpus": 0 if args.cpu else torch.cuda.device_count(),
            "targets": targets,
            "drafters": drafters,
            "target_params_m": round(n_params / 1e6, 1),
            "vocab_size": shape["vocab_size"],
            "mask_token_id_expected": mask_id,
            "quick": args.quick,
            "target_build_s": round(build_s, 2),
            "steps": args.steps,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "parts": [],
        }
        parts = Parts(result, args.json_file, say)

        def train() -> t.Any:
            if torch.cuda.is_available() and not args.cpu:
                for i in range(torch.cuda.device_count()):
                    torch.cuda.reset_peak_memory_stats(i)
            watch, undo = watch_logs()
            eager_flex, undo_flex = count_eager_flex()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")  # every flex warning, not the first per call site
                try:
                    run = Run(cfg, environ={**os.environ, "DFLASH_RUN_DIR": str(tmp / "run")}, stream=out)
                    if args.quick:  # compile only what the smoke's own batches need
                        run.warm_up_shapes = data_shapes(run, args)
                        say(f"warm-up shapes (the data's classes): {run.warm_up_shapes}")
                    t_train = time.perf_counter()
                    rc = run.train()
                    train_s = time.perf_counter() - t_train
                finally:
                    undo()
                    undo_flex()
            flex = max(eager_flex[0], sum(FLEX_WARNING in str(w.message) for w in caught))
            records = list(run.metrics.records) if run.metrics is not None else []
            figures = interval_figures(records)
            flops = drafter_step_flops(args, shape, run.draft_config, len(run.targets[0].model.layer_ids))
            peak, peak_from = peak_flops(args)
            step_s = figures["drafter_step_s"]
            result.update(
                mask_token_id=run.mask_token_id,
                warm_up_shapes=run.warmed.shapes if run.warmed is not None else None,
                compiled_entries=run.warmed.entries if run.warmed is not None else None,
                recompile_limit=run.warmed.limit if run.warmed is not None else None,
                train_exit=rc,
                train_s=round(train_s, 2),
                ktok_s=figures["ktok_s"],
                drafter_step_s=step_s,
                drafter_step_tflop=flops / 1e12,
                mfu=flops / step_s / peak if (peak and step_s) else None,
                peak_tflops=peak / 1e12 if peak else None,
                peak_from=peak_from,
                compile_s=(watch.started_at - t_train) if watch.started_at is not None else None,
                recompiles_after_warmup=len(watch.recompiles),
                recompiles_in_warmup=len(watch.warmup_recompiles),
                recompile_messages=watch.recompiles[:5],
                dynamo_frames_after_warmup=(
                    dynamo_frames() - watch.frames_at_start if watch.frames_at_start is not None else None
                ),
                flex_eager_warnings=flex,
                memory=gpu_memory(),
            )
            say(f"trained: exit {rc} in {train_s:.1f}s")
            if rc != 0:
                raise RuntimeError(f"training exited {rc}")
            return run

        def classes() -> None:
            say("class check: a one-layer drafter compiled for every shape class, then one batch of each")
            class_flex, undo_class_flex = count_eager_flex()
            try:
                c = class_check(args, run)
            finally:
                undo_class_flex()
            c["eager_flex_calls"] = class_flex[0]
            result["class_check"] = c

        run = parts.run("training", train)
        if run is not None:
            parts.run("averaging", lambda: result.update(averaging=averaging_round(run)))
            if not args.no_oom:  # before the class check: bounded by its own timeout, the class check by its budget
                say("forcing an OOM under the runner")
                cfg_oom = oom_config(raw, tmp, drafters)
                parts.run(
                    "forced OOM",
                    lambda: result.update(oom=gpu_oom.forced_oom(args, tmp, cfg_oom, drafters, run.warm_up_shapes)),
                )
            if args.quick:
                parts.run("class check", classes)
        result["total_s"] = round(time.perf_counter() - t_start, 1)
        result["checks"] = checks(args, result)
        if args.keep:
            result["temp_dir"] = str(tmp)
        parts.write()
        if args.json:
            print(json.dumps(result, default=str))
        else:
            print_report(result)
        return 0 if all(c["ok"] for c in result["checks"]) else 1
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def checks(args: argparse.Namespace, r: dict[str, t.Any]) -> list[dict[str, t.Any]]:
    """One line per check from the figures there are; a part that failed is a failed check of its own."""
    out = [{"name": f"part {p['name']} ran: {p['why']}", "ok": False} for p in r.get("parts", []) if not p["ok"]]
    if "train_exit" in r:
        out.append({"name": "training exited 0", "ok": r["train_exit"] == 0})
        out.append(
            {
                "name": "no (re)compile after warm-up",
                "ok": r["recompiles_after_warmup"] == 0 and not r["dynamo_frames_after_warmup"],
            }
        )
        out.append(
            {
                "name": f"MASK id {r['mask_token_id']} is the rule's and not in the data",
                "ok": r["mask_token_id"] == r["mask_token_id_expected"],
            }
        )
        if not args.cpu:  # eager flex is the CPU path; on CUDA it is the OOM the issue is about
            out.append({"name": "no eager flex_attention warning", "ok": r["flex_eager_warnings"] == 0})
    else:
        out.append({"name": "training ran", "ok": False})
    if r.get("averaging") is not None:
        out.append({"name": "averaged replicas bit-identical", "ok": r["averaging"]["bit_identical"]})
        out.append({"name": "averaged replicas equal the CPU mean", "ok": r["averaging"]["equals_cpu_mean"]})
    c = r.get("class_check")
    if c is not None:
        out.append(
            {
                "name": f"class check: {c['warmed']} of {c['classes']} shape classes fed after warm-up, all compiled"
                + "".join(f"; compile failed for {f['shape']}: {f['error']}" for f in c.get("failed", [])),
                "ok": c["ok"] and (args.cpu or c["eager_flex_calls"] == 0),
            }
        )
    if r.get("oom") is not None:
        o = r["oom"]
        out.append(
            {
                "name": f"status: crashed / cuda-oom on GPU {o['gpu_expected']}",
                "ok": (o["state"], o["cause"], o["gpu"]) == ("crashed", "cuda-oom", o["gpu_expected"]),
            }
        )
    return out


def _fmt(v: t.Any, spec: str = ".2f", none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def _training_lines(r: dict[str, t.Any]) -> list[str]:
    mfu = r["mfu"]
    lines = [
        f"throughput          {_fmt(r['ktok_s'], '.1f')} Ktok/s (steady intervals)",
        f"drafter step        {_fmt(r['drafter_step_s'], '.4f')} s, {r['drafter_step_tflop']:.2f} TFLOP/step "
        f"-> MFU {_fmt(mfu * 100, '.1f') + '%' if mfu is not None else 'n/a'} "
        f"(peak {_fmt(r['peak_tflops'], '.0f')} TFLOP/s, {r['peak_from']})",
        f"compile (warm-up)   {_fmt(r['compile_s'], '.1f')} s",
        f"recompiles          {r['recompiles_after_warmup']} after warm-up (dynamo frames compiled after: "
        f"{r['dynamo_frames_after_warmup']}; {r['recompiles_in_warmup']} during warm-up)",
        f'eager flex calls    {r["flex_eager_warnings"]} ("flex_attention called without torch.compile")',
        f"compiled entries    {r['compiled_entries']} (recompile limit {r['recompile_limit']}; "
        f"warm-up shapes {r['warm_up_shapes']})",
    ]
    for m in r["memory"]:
        lines.append(
            f"gpu {m['gpu']} memory        peak {m['peak_allocated_gib']} GiB allocated, "
            f"{m['peak_reserved_gib']} GiB reserved of {m['total_gib']} GiB"
        )
    return lines


def print_report(r: dict[str, t.Any]) -> None:
    lines = [
        f"device              {r['device']} x {r['gpus']}   targets {r['targets']}  drafters {r['drafters']}",
        f"target              {r['target_params_m']}M params (built + saved {r['target_build_s']}s); "
        f"vocabulary {r['vocab_size']}, MASK id {r.get('mask_token_id')}",
    ]
    lines += [f"part {p['name']:<15} {'ok' if p['ok'] else 'FAILED: ' + str(p['why'])} ({p['s']}s)" for p in r["parts"]]
    if "train_exit" in r:
        lines += _training_lines(r)
    c = r.get("class_check")
    if c is not None:
        lines.append(
            f"class check         {c['warmed']}/{c['classes']} classes compiled in {c['compile_s']} s, "
            f"{sum(b['ok'] for b in c['batches'])} fed batches hit compiled code, {c['entries_added_by_feed']} entries "
            f"added, {c['eager_flex_calls']} eager flex calls; unchecked (budget) {c['unchecked']}"
        )
        lines += [f"                    MISS {b['fed']} ({b['miss']})" for b in c["batches"] if not b["ok"]]
        lines += [f"                    COMPILE FAILED {f['shape']} ({f['error']})" for f in c.get("failed", [])]
    a = r.get("averaging")
    if a is not None:
        lines.append(
            f"averaging           {a['replicas']} replicas x {a['mb_per_replica']:.0f} MB"
            f"{' (one a copy)' if a['copied_replica'] else ''}: round {_fmt(a['round_s'], '.3f')} s "
            f"(first {_fmt(a['first_round_s'], '.3f')} s), copy bound {a['copy_bound_s']:.3f} s, "
            f"ratio {_fmt(a['ratio'], '.2f')}; bandwidth GB/s out/back {a['bandwidth_gb_s']}"
        )
    o = r.get("oom")
    if o is not None:
        lines.append(
            f"forced OOM          {o['how']}: status {o['state']} / {o['cause']} / gpu {o['gpu']} "
            f"(runner exit {o['runner_exit']}, {o['seconds']:.1f}s)"
        )
        lines.append(f"                    {o['detail'][:160]}")
    lines.append(f"total               {r['total_s']} s")
    lines += [f"{'ok  ' if c['ok'] else 'FAIL'} {c['name']}" for c in r["checks"]]
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
