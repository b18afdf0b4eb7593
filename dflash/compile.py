"""torch.compile and activation checkpointing of the drafter, and the warm-up that compiles it up front.

``prepare_drafter`` sets activation checkpointing inside each layer and compiles each layer; ``warm_up``
runs forward and backward once for every batch shape a run can meet (``warm_up_shapes``), serially, before
the drafter threads exist: torch.compile is not thread-safe, and a compile in a thread would stall the
others. After the warm-up a recompile is an error (``Run.train`` sets ``fail_on_recompile``).
"""

from __future__ import annotations

import typing as t

import torch

from dflash.drafter import DFlashDraftModel
from dflash.loss import drafter_loss
from dflash.replicas import DrafterReplica


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


def warm_up(
    replica: DrafterReplica, *, feature_size: int, vocab_size: int, mask_token_id: int, attention: str = "auto"
) -> list[tuple[int, int, int]]:
    """Compile forward and backward for every shape a run can meet, serially, before threads exist.

    Returns the ``(rows, seq, blocks)`` it ran (``warm_up_shapes``). Throwaway data; the replica's
    weights and optimizer are untouched (gradients are dropped). A drafter whose parameters need no
    gradient (tests) runs forward only.
    """
    import torch._dynamo.config as dynamo_config  # dynamo is heavy to import: only a compiled run gets here

    d = replica.cfg.drafter
    flex = attention == "flex" or (attention == "auto" and torch.device(replica.device).type == "cuda")
    shapes = warm_up_shapes(
        rows=replica.cfg.data.batch_size,
        max_length=replica.cfg.data.max_length,
        num_anchors=d.num_anchors,
        block_size=d.block_size,
        flex=flex,
        taken=_model_sizes(replica.model),
    )
    gen = torch.Generator().manual_seed(0)
    # Each shape is a cache entry per layer input kind (the first layer's input needs no grad, the
    # others' do); past the limit dynamo would run the layer eager. Hitting it anyway is an error.
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * len(shapes))
    # No duck sizing: a warm-up size equal to a model size (hidden 64 = 8 blocks x 8) would be tied to
    # it and specialised, and real batches would miss the cache.
    with (
        torch.fx.experimental._config.patch(use_duck_shape=False),  # type: ignore[attr-defined]  # set up by install_config_module
        dynamo_config.patch(fail_on_recompile_limit_hit=True),
    ):
        for rows, seq, blocks in shapes:
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
            )
            if out.loss.requires_grad:
                out.loss.backward()
    replica.model.zero_grad(set_to_none=True)
    return shapes


# flex_attention's tile: the BlockMask has ceil(Q/128) query and ceil(K/128) key tiles.
_TILE = 128


def warm_up_shapes(
    *, rows: int, max_length: int, num_anchors: int, block_size: int, flex: bool, taken: t.Collection[int] = ()
) -> list[tuple[int, int, int]]:
    """``(rows, seq, blocks)`` batches that compile every graph a run can need.

    dynamo compiles a size of 0 or 1 as a constant (a graph of its own) and any other size as a
    symbol, so each size that can be 1 in a real batch is warmed up at 1 and at >= 2, in every
    combination that can occur: rows (a batch of one sequence), and with flex attention the blocks (a
    short sequence has one anchor), the query tiles and the key tiles (one tile up to 128 tokens).
    Sizes >= 2 are kept apart from each other and from the model's sizes (``taken``) where possible.
    """
    avoid = set(taken) | {0, 1, block_size, _TILE}
    many_rows = next(r for r in range(2, 1 << 20) if r not in avoid)
    max_blocks = max(1, min(num_anchors, max_length - 1))

    def pick(blocks: int, hi: int) -> tuple[int, int] | None:
        # the longest seq <= hi whose sizes >= 2 collide with nothing, else the longest seq <= hi
        seqs = range(min(hi, max_length), blocks, -1)
        for seq in seqs:
            sizes = [seq, blocks * block_size, seq + blocks * block_size] + ([blocks] if blocks > 1 else [])
            if len(set(sizes)) == len(sizes) and not set(sizes) & (avoid | {many_rows}):
                return seq, blocks
        return (seqs[0], blocks) if seqs else None

    def kind(seq: int, blocks: int) -> tuple[bool, ...]:
        if not flex:  # dense attention: blocks only change the (symbolic) query length
            return ()
        q, kv = blocks * block_size, seq + blocks * block_size
        return blocks == 1, q <= _TILE, kv <= _TILE

    one_tile = max(1, _TILE // block_size)  # most blocks whose queries fit one tile
    cases: dict[tuple[bool, ...], tuple[int, int]] = {}
    for blocks in sorted(
        {max_blocks, min(max_blocks, one_tile), min(max_blocks, 3), min(max_blocks, 2), 1}, reverse=True
    ):
        for hi in (max_length, _TILE - blocks * block_size):  # several key tiles, then one
            found = pick(blocks, hi)
            if found is not None:
                cases.setdefault(kind(*found), found)
    row_cases = [1, many_rows] if rows >= 2 else [1]
    return [(r, seq, blocks) for r in row_cases for seq, blocks in cases.values()]


def _model_sizes(model: torch.nn.Module) -> set[int]:
    """Every size of every parameter and buffer: warm-up sizes avoid them (see ``warm_up``)."""
    return {int(n) for p in (*model.parameters(), *model.buffers()) for n in p.shape}


__all__ = ["prepare_drafter", "warm_up", "warm_up_shapes"]
