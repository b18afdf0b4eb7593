"""torch.compile and activation checkpointing of the drafter, and the warm-up that compiles it up front.

``prepare_drafter`` sets activation checkpointing inside each layer and compiles each layer; ``warm_up``
runs forward and backward once for every batch shape a run can meet (``warm_up_shapes``), serially, before
the drafter threads exist: torch.compile is not thread-safe, and a compile in a thread would stall the
others. After the warm-up a recompile is an error (``Run.train`` sets ``fail_on_recompile``).
"""

from __future__ import annotations

import dataclasses
import typing as t

import torch

from dflash.model.drafter import DFlashDraftModel, flex_attention
from dflash.model.loss import candidate_counts, drafter_loss
from dflash.train.replicas import DrafterReplica


def prepare_drafter(
    model: DFlashDraftModel,
    *,
    activation_checkpointing: bool,
    compile: bool,
    backend: str | t.Callable[..., t.Any] = "inductor",
    dynamic: bool | None = True,
) -> None:
    """Activation checkpointing inside each layer, then compile per layer (the order that works).

    The layer checkpoints its own forward (``Qwen3DFlashDecoderLayer``, non-reentrant), and
    ``Module.compile`` compiles that forward, so each compiled region contains its checkpoint whatever
    the transformers version. ``fullgraph``: a graph break would leave flex attention outside the
    graph. Compilation happens at the first call: ``warm_up`` makes it, serially, before any thread.
    """
    model.set_activation_checkpointing(activation_checkpointing)
    if compile:
        for layer in model.layers:
            layer.compile(backend=backend, dynamic=dynamic, fullgraph=True)


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """What ``warm_up_replicas`` compiled: the shapes, the recompile limit it set, and per replica's guard key
    (``"cuda:1 bfloat16"``) the dynamo cache entries its warm-up added (the compiled layer and flex)."""

    shapes: list[tuple[int, int, int]]
    limit: int
    entries: dict[str, int]


def warm_up_replicas(
    replicas: t.Sequence[DrafterReplica],
    *,
    feature_size: int,
    vocab_size: int,
    mask_token_id: int,
    attention: str = "auto",
    shapes: t.Sequence[tuple[int, int, int]] | None = None,
) -> WarmUp:
    """``warm_up`` every replica, serially, under ONE recompile limit set before the first (``recompile_limits``).

    dynamo's cache of a compiled layer is shared by every layer of every replica (the code object is
    ``Qwen3DFlashDecoderLayer.forward``), and each entry is guarded on its tensors' device and dtype, so
    each distinct (device, dtype) of the replicas adds its own entries: the limit counts them.
    ``shapes``: warm these only (default: ``warm_up_shapes`` for the replicas' config).
    """
    if not replicas:
        return WarmUp([], 0, {})
    set_flex_block_options(replicas)
    todo = list(shapes) if shapes is not None else shapes_for(replicas[0], attention=attention)
    limit = set_recompile_limits(len(todo), guard_keys(replicas))
    entries: dict[str, int] = {}
    for r in replicas:
        before = compiled_entries()
        warm_up(
            r,
            feature_size=feature_size,
            vocab_size=vocab_size,
            mask_token_id=mask_token_id,
            attention=attention,
            shapes=todo,
        )
        key = f"{_device_key(r.device)} {str(r.model.dtype).removeprefix('torch.')}"
        entries[key] = entries.get(key, 0) + compiled_entries() - before
    return WarmUp(todo, limit, entries)


def compiled_entries() -> int:
    """dynamo cache entries of the compiled drafter layer and of ``compiled_flex`` (0 where torch has no
    such debug hook): a warm-up adds them, and after it nothing may."""
    from torch._dynamo import eval_frame  # dynamo is heavy to import: only a compiled run gets here

    from dflash.model.drafter import Qwen3DFlashDecoderLayer

    try:
        codes = [Qwen3DFlashDecoderLayer.forward.__code__]
        if flex_attention is not None:
            codes.append(flex_attention.__code__)
        return sum(len(eval_frame._debug_get_cache_entry_list(c)) for c in codes)
    except (AttributeError, RuntimeError):  # another torch: no count
        return 0


def guard_keys(replicas: t.Sequence[DrafterReplica]) -> int:
    """How many distinct sets of cache entries the replicas need: one per (device, dtype).

    dynamo's tensor guards check device (with its index) and dtype, so two replicas on two GPUs are two
    keys; replicas on one device in one dtype share their entries (tests stand another dtype in for a GPU).
    """
    return len({(_device_key(r.device), r.model.dtype) for r in replicas})


def recompile_limits(shapes: int, keys: int) -> int:
    """Cache entries one compiled code object may hold: per shape and per guard key, one entry for each
    layer input kind (the first layer's input needs no grad, the others' do; ``compiled_flex`` has one),
    doubled as margin. The fail-on-limit stance stays the safety net."""
    return 2 * (2 * max(1, shapes) * max(1, keys))


def set_recompile_limits(shapes: int, keys: int) -> int:
    """Raise dynamo's per-code-object and accumulated limits to ``recompile_limits`` (never lower them)."""
    import torch._dynamo.config as dynamo_config  # dynamo is heavy to import: only a compiled run gets here

    need = recompile_limits(shapes, keys)
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, need)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, need)
    return need


def _device_key(device: str | torch.device) -> torch.device:
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d


def uses_flex(device: str | torch.device, attention: str = "auto") -> bool:
    """Whether a drafter on ``device`` trains with flex attention (``loss.training_masks``' choice)."""
    return attention == "flex" or (attention == "auto" and torch.device(device).type == "cuda")


def shapes_for(replica: DrafterReplica, *, attention: str = "auto") -> list[tuple[int, int, int]]:
    """``warm_up_shapes`` for a replica's config and model."""
    d = replica.cfg.drafter
    return warm_up_shapes(
        rows=replica.cfg.data.batch_size,
        max_length=replica.cfg.data.max_length,
        num_anchors=d.num_anchors,
        block_size=d.block_size,
        flex=uses_flex(replica.device, attention),
        taken=_model_sizes(replica.model),
        max_batch_tokens=replica.cfg.data.max_batch_tokens,
    )


def warm_up(
    replica: DrafterReplica,
    *,
    feature_size: int,
    vocab_size: int,
    mask_token_id: int,
    attention: str = "auto",
    shapes: t.Sequence[tuple[int, int, int]] | None = None,
) -> list[tuple[int, int, int]]:
    """Compile forward and backward for every shape a run can meet, serially, before threads exist.

    Returns the ``(rows, seq, blocks)`` it ran (``shapes``, default ``warm_up_shapes``). Throwaway data; the
    replica's weights and optimizer are untouched (gradients are dropped). A drafter whose parameters need
    no gradient (tests) runs forward only. Several replicas: ``warm_up_replicas`` (it sets the recompile
    limit for all of them first); alone, this sets it for one guard key.
    """
    import torch._dynamo.config as dynamo_config  # dynamo is heavy to import: only a compiled run gets here

    d = replica.cfg.drafter
    todo = list(shapes) if shapes is not None else shapes_for(replica, attention=attention)
    gen = torch.Generator().manual_seed(0)
    # Past the limit dynamo would run the layer eager; hitting it anyway is an error (never lowered here).
    set_recompile_limits(len(todo), 1)
    # No duck sizing: a warm-up size equal to a model size (hidden 64 = 8 blocks x 8) would be tied to
    # it and specialised, and real batches would miss the cache.
    with (
        torch.fx.experimental._config.patch(use_duck_shape=False),  # type: ignore[attr-defined]  # set up by install_config_module
        dynamo_config.patch(fail_on_recompile_limit_hit=True),
    ):
        for rows, seq, blocks in todo:
            ids = torch.randint(0, vocab_size, (rows, seq), generator=gen)
            ids[ids == mask_token_id] = 0
            mask = torch.zeros(rows, seq, dtype=torch.long)
            mask[:, seq - blocks - 1 :] = 1  # exactly `blocks` anchor candidates per row
            feats = torch.randn(rows, seq, feature_size, generator=gen).to(replica.device, replica.model.dtype)
            out = drafter_loss(
                replica.model,
                replica.head,
                ids,
                mask,
                feats,
                num_anchors=blocks,
                gamma=d.loss_gamma,
                generator=torch.Generator(device=replica.device).manual_seed(0),
                chunk_size=d.loss_chunk,
                attention=attention,
                position_weight=replica.cfg.loss.position_weight,
                dpace_alpha=replica.cfg.loss.dpace_alpha,
            )
            if out.loss.requires_grad:
                out.loss.backward()
    replica.model.zero_grad(set_to_none=True)
    return todo


# flex_attention's tile: the BlockMask has ceil(Q/128) query and ceil(K/128) key tiles.
_TILE = 128
# flex_decoding's short-query bound: inductor picks the decode kernel below it (see shape_class).
_SHORT_QUERY = 128

# What decides which compiled code a batch needs: the guards dynamo and inductor's CUDA flex lowering put
# on a compiled drafter layer, read in torch 2.13's torch/_inductor/kernel/flex/{flex_attention,
# flex_decoding}.py (the same in pytorch main; torch 2.11-2.14 keep this logic; the CPU lowering, flex_cpu.py,
# has other guards, so CPU tests cannot meet these):
#   dynamo: every size of 0 or 1 is a constant (its own graph): rows (batch 1), blocks (one anchor: the
#     anchor tensors' width), and the BlockMask's query and key tile counts (one tile: Q <= 128, K <= 128);
#   flex_decoding._use_flex_decoding (called from the forward lowering for every graph, before it decides):
#     evaluate_expr(Lt(q_len, 128)) -> a guard on the query length, whatever kernel it then picks;
#     Gt(q_len, 0) (always true for a size >= 2); Eq(block-mask heads, 1) (ours: 1, a constant); the GQA
#     ratio a power of two and static batch / heads (isinstance checks on constants: no guard); the decode
#     kernel itself (rows == 1 and q_len < 128) adds guard_int of constants only, but is never used:
#     BACKEND=TRITON (drafter.FLEX_KERNEL_OPTIONS) picks the main template after these guards (flex_template);
#   flex_attention lowering: head dims < 16 and Hq != Hkv (constants), guard_int of the sparse block
#     sizes and kernel options (constants), Eq(Bq, Bkv) (one symbol), Gt(q_len, 0), Gt(kv_len, 0) (true);
#     IS_DIVISIBLE by 128 and TMA use are statically_known_* (decided without a guard: False for a symbol);
#   the backward lowering: the same constants, no length guard.
# So with flex the classes are: rows == 1, blocks == 1, Q < 128, Q <= 128 (one query tile), K <= 128.


def shape_class(rows: int, seq: int, blocks: int, *, block_size: int, flex: bool) -> tuple[bool, ...]:
    """The guard outcomes of a ``(rows, seq, blocks)`` batch: two batches of one class run the same
    compiled code (pure; the guards are listed above). Dense attention: only the rows can be 1."""
    if not flex:
        return (rows == 1,)
    q = blocks * block_size
    kv = seq + q
    return (rows == 1, blocks == 1, q < _SHORT_QUERY, q <= _TILE, kv <= _TILE)


def flex_template(rows: int, q_len: int, *, heads: int, kv_heads: int, kernel_options: t.Mapping[str, t.Any]) -> str:
    """The template inductor's CUDA flex forward lowering picks for a batch: ``"decode"`` or ``"main"``
    (pure: torch's flex_attention.py ``use_decode`` over flex_decoding.py ``_use_flex_decoding``). The
    batch size is static only as the constant 1 (``dynamic=True``); our BlockMask has one head."""
    backend = kernel_options.get("BACKEND", "AUTO")
    if backend != "AUTO":
        return "decode" if backend == "TRITON_DECODE" else "main"
    ratio = heads // kv_heads
    power_of_two = ratio > 0 and ratio & (ratio - 1) == 0
    forced = bool(kernel_options.get("FORCE_USE_FLEX_ATTENTION", False))
    return "decode" if not forced and rows == 1 and 0 < q_len < _SHORT_QUERY and power_of_two else "main"


def decode_has_config(q_len: int, *, gqa: int) -> bool:
    """Whether the decode template keeps a config at its default block: ``BLOCK_M = max(next_pow2(q_len *
    gqa), 16)`` must divide the sparse query block (128), or no choice is left (torch 2.11's
    NoValidChoicesError, 2.14's ValueError; flex_decoding.py ``create_flex_decoding_kernel``)."""
    block_m = max(1 << max(q_len * gqa - 1, 0).bit_length(), 16)
    return _TILE % block_m == 0


# Shared memory per block: devices below this get flex tiles chosen to fit (sm_120 and sm_86/89: 99 KB;
# sm_80: 163 KB and sm_90/sm_100: 227 KB keep torch's own, tuned per capability).
_SMALL_SMEM = 160 * 1024
# Tiles to try, largest first: forward (BLOCK_M, BLOCK_N, num_stages, num_warps); backward (BLOCK_M, BLOCK_N
# for both passes, num_stages, num_warps). The first forward is torch 2.13's own for sm_120 at head dim 128.
_FWD_TILES = ((128, 64, 2, 8), (64, 64, 2, 4), (64, 32, 2, 4), (32, 32, 1, 4), (32, 16, 1, 4))
_BWD_TILES = ((64, 64, 1, 4), (32, 64, 1, 4), (32, 32, 1, 4), (16, 16, 1, 4))


def flex_fwd_smem(block_m: int, block_n: int, stages: int, head_dim: int, itemsize: int = 2) -> int:
    """An upper estimate of the forward kernel's shared memory: the Q tile and, per pipeline stage, a K and
    a V tile (Triton buffers each load feeding a dot per stage)."""
    return itemsize * head_dim * (block_m + 2 * stages * block_n)


def flex_bwd_smem(block_m: int, block_n: int, stages: int, head_dim: int, itemsize: int = 2) -> int:
    """The same for the backward kernel: K and V tiles held, Q and dO tiles per stage."""
    return itemsize * head_dim * (2 * block_n + 2 * stages * block_m)


def flex_block_options(smem_optin: int, head_dim: int) -> dict[str, int]:
    """flex kernel options with tiles that fit ``smem_optin`` bytes per block ({}: torch's own choice).

    torch's defaults are tuned for each capability it knows, and on a 99 KB device some exceed it
    (Triton's "OutOfResources: shared memory"), depending on the torch version's tables; so there the
    tiles are ours, the largest that fit the estimate."""
    if smem_optin >= _SMALL_SMEM:
        return {}
    fwd = next((c for c in _FWD_TILES if flex_fwd_smem(*c[:3], head_dim) <= smem_optin), _FWD_TILES[-1])
    bwd = next((c for c in _BWD_TILES if flex_bwd_smem(*c[:3], head_dim) <= smem_optin), _BWD_TILES[-1])
    return {
        "fwd_BLOCK_M": fwd[0],
        "fwd_BLOCK_N": fwd[1],
        "fwd_num_stages": fwd[2],
        "fwd_num_warps": fwd[3],
        "bwd_BLOCK_M1": bwd[0],
        "bwd_BLOCK_N1": bwd[1],
        "bwd_BLOCK_M2": bwd[1],
        "bwd_BLOCK_N2": bwd[0],
        "bwd_num_stages": bwd[2],
        "bwd_num_warps": bwd[3],
    }


def set_flex_block_options(replicas: t.Sequence[DrafterReplica]) -> dict[str, int]:
    """Before anything compiles: the flex tiles every training call passes, for the CUDA drafter device with
    the least shared memory per block (process-wide, as the compiled code is)."""
    from dflash.model import drafter

    optins = [
        int(getattr(torch.cuda.get_device_properties(torch.device(r.device)), "shared_memory_per_block_optin", 0))
        for r in replicas
        if torch.device(r.device).type == "cuda"
    ]
    cfg = replicas[0].model.config if replicas else None
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads) if cfg else 0
    opts = flex_block_options(min(optins), head_dim) if optins and head_dim and min(optins) else {}
    for key in [k for k in drafter.FLEX_KERNEL_OPTIONS if k != "BACKEND"]:
        del drafter.FLEX_KERNEL_OPTIONS[key]  # type: ignore[misc]  # FlexKernelOptions' keys are optional
    drafter.FLEX_KERNEL_OPTIONS.update(opts)  # type: ignore[typeddict-item]  # the fwd_/bwd_ forms
    return opts


def batch_shape(loss_mask: torch.Tensor, *, num_anchors: int) -> tuple[int, int, int]:
    """``(rows, seq, blocks)`` of a collated batch as the drafter step sees it: ``drafter_loss`` trains
    ``min(num_anchors, most anchor candidates of a row)`` blocks per row."""
    rows, seq = loss_mask.shape
    counts = candidate_counts(loss_mask.cpu()).tolist()
    return int(rows), int(seq), min(num_anchors, max(counts, default=0))


def warm_up_shapes(
    *,
    rows: int,
    max_length: int,
    num_anchors: int,
    block_size: int,
    flex: bool,
    taken: t.Collection[int] = (),
    max_batch_tokens: int | None = None,
) -> list[tuple[int, int, int]]:
    """``(rows, seq, blocks)`` batches, one per ``shape_class`` a run's batches can fall in.

    dynamo compiles a size of 0 or 1 as a constant (a graph of its own) and any other size as a
    symbol, and the CUDA flex lowering guards the query length against 128 (``shape_class``); so each
    class that can occur is warmed: rows 1 and >= 2, and with flex attention one block or several,
    short queries (< 128), one full query tile (exactly 128) or several, one key tile or several.
    Sizes >= 2 are kept apart from each other and from the model's sizes (``taken``) where possible.
    Batches of several rows are no longer than ``max_batch_tokens`` allows them (the batch planner's bound):
    at 65K tokens a warm-up batch of two full-length rows would need memory no batch of the run needs.
    """
    avoid = set(taken) | {0, 1, block_size, _TILE}
    many_rows = next(r for r in range(2, 1 << 20) if r not in avoid)
    out = [(1, seq, blocks) for seq, blocks in _classes(max_length, num_anchors, block_size, flex, avoid, many_rows)]
    longest = max_length if max_batch_tokens is None else min(max_length, max_batch_tokens // many_rows)
    if rows >= 2 and longest >= 2:
        out += [
            (many_rows, seq, blocks)
            for seq, blocks in _classes(longest, num_anchors, block_size, flex, avoid, many_rows)
        ]
    return out


def _classes(
    max_length: int, num_anchors: int, block_size: int, flex: bool, avoid: set[int], many_rows: int
) -> list[tuple[int, int]]:
    """``(seq, blocks)`` of each class sequences up to ``max_length`` fall in (``warm_up_shapes``)."""
    max_blocks = max(1, min(num_anchors, max_length - 1))

    def pick(blocks: int, hi: int) -> tuple[int, int] | None:
        # the longest seq <= hi whose sizes >= 2 collide with nothing, else the longest seq <= hi
        seqs = range(min(hi, max_length), blocks, -1)
        for seq in seqs:
            sizes = [seq, blocks * block_size, seq + blocks * block_size] + ([blocks] if blocks > 1 else [])
            if len(set(sizes)) == len(sizes) and not set(sizes) & (avoid | {many_rows}):
                return seq, blocks
        return (seqs[0], blocks) if seqs else None

    # every blocks count at which a class boundary lies: 1, 2, the last short one, one full tile, one past it
    short = max(1, -(-_SHORT_QUERY // block_size) - 1)  # most blocks whose queries are < 128
    tile = _TILE // block_size  # blocks of exactly one query tile (when block_size divides 128)
    candidates = {max_blocks, short, short + 1, tile, tile + 1, 3, 2, 1}
    cases: dict[tuple[bool, ...], tuple[int, int]] = {}
    for blocks in sorted({min(max_blocks, b) for b in candidates if b >= 1}, reverse=True):
        for hi in (max_length, _TILE - blocks * block_size):  # several key tiles, then one
            found = pick(blocks, hi)
            if found is not None:
                cases.setdefault(shape_class(2, *found, block_size=block_size, flex=flex)[1:], found)
    return list(cases.values())


def _model_sizes(model: torch.nn.Module) -> set[int]:
    """Every size of every parameter and buffer: warm-up sizes avoid them (see ``warm_up``)."""
    return {int(n) for p in (*model.parameters(), *model.buffers()) for n in p.shape}


__all__ = [
    "WarmUp",
    "batch_shape",
    "compiled_entries",
    "decode_has_config",
    "flex_block_options",
    "flex_bwd_smem",
    "flex_fwd_smem",
    "flex_template",
    "guard_keys",
    "prepare_drafter",
    "recompile_limits",
    "set_flex_block_options",
    "set_recompile_limits",
    "shape_class",
    "shapes_for",
    "uses_flex",
    "warm_up",
    "warm_up_replicas",
    "warm_up_shapes",
]
