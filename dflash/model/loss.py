"""DFlash training objective as pure functions: anchors, blocks, the attention mask, the loss, metrics.

One training step of a drafter on a batch of sequences (``drafter_loss``):

1. anchors: per sequence up to ``num_anchors`` positions ``p`` with ``loss_mask[p]`` and ``loss_mask[p+1]``
   set, drawn uniformly without replacement (fresh every step, from a seeded ``torch.Generator``),
   sorted, padded with invalid anchors;
2. blocks: ``[input_ids[p], MASK x (B-1)]`` at positions ``p + k``, all blocks of a batch in one forward;
3. mask: a query of block ``n`` sees the target context strictly before its anchor (the anchor's own
   target state does not exist yet at inference) and its own block, never another block; in
   ``sliding_attention`` layers the block part is causal and the context is cut to the window;
4. loss: slot ``k`` (k >= 1) is scored against ``input_ids[p + k]`` (same position, NOT shifted by one)
   with weight ``exp(-(k-1)/gamma) * loss_mask[p+k] * in_bounds * block_valid`` (``position_weight="dpace"``:
   ``dpace_weights`` of the forward's own confidences in place of the decay); slot 0 is the given
   token and is never scored; the loss is the weighted mean. lm_head and cross-entropy run over chunks
   of blocks under activation checkpointing, so ``blocks x B x vocab`` logits never exist at once.

Shape legend: Bt batch, S sequence, N anchors (blocks) per sequence, B block size, H hidden, V vocab,
Q = N*B block queries, KV = S + Q keys.
"""

from __future__ import annotations

import dataclasses
import math
import typing as t

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from dflash.model import draft_vocab

if t.TYPE_CHECKING:
    from dflash.model.drafter import CandidateSelector, DFlashDraftModel
    from dflash.model.target import TargetHead

try:
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = None  # type: ignore[assignment,misc]

__all__ = [
    "Anchors",
    "LossTerms",
    "StepOutput",
    "block_inputs",
    "block_targets",
    "candidate_counts",
    "default_gamma",
    "dpace_weights",
    "dflash_loss",
    "drafter_loss",
    "mask_mod",
    "sample_anchors",
    "slot_weights",
    "training_block_mask",
    "training_mask",
    "training_masks",
]

# The paper's decay per block size (SpecForge's --loss-decay-gamma help); others scale 7 * B / 16.
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return _GAMMA_BY_BLOCK.get(block_size, 7.0 * block_size / 16)


@dataclasses.dataclass(frozen=True)
class Anchors:
    """``positions`` [Bt, N] (0 where padding) and ``valid`` [Bt, N]; valid anchors first, ascending."""

    positions: torch.Tensor
    valid: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.positions.shape[1])


def candidate_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[Bt]``: positions p per row with ``loss_mask[p]`` and ``loss_mask[p+1]`` (possible anchors)."""
    supervised = loss_mask > 0
    return (supervised[:, :-1] & supervised[:, 1:]).sum(dim=1)


def sample_anchors(
    loss_mask: torch.Tensor,
    *,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator,
    counts: t.Sequence[int] | None = None,
) -> Anchors:
    """Draw up to ``num_anchors`` anchors per sequence among positions p with loss_mask[p] and [p+1].

    Blocks near the end are kept: their slots past the sequence get zero weight (``block_targets``).
    ``block_size`` is checked only. Raises ValueError if no sequence of the batch has any anchor.
    ``counts``: ``candidate_counts(loss_mask)`` as host numbers, when the caller has them from host
    data; without them the widest row is read from ``loss_mask`` (a host sync when it is on a GPU).
    """
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask: expected shape [batch, seq], got {list(loss_mask.shape)}")
    if num_anchors < 1:
        raise ValueError(f"num_anchors: must be >= 1, got {num_anchors}")
    if block_size < 2:
        raise ValueError(f"block_size: must be >= 2, got {block_size}")
    batch, seq = loss_mask.shape
    device = loss_mask.device
    supervised = loss_mask > 0
    candidate = torch.zeros_like(supervised)
    candidate[:, :-1] = supervised[:, :-1] & supervised[:, 1:]
    if counts is None:
        counts = candidate.sum(dim=1).tolist()
    width = min(num_anchors, max(counts, default=0))
    if width == 0:
        raise ValueError(
            "loss_mask: no sequence in the batch has two consecutive supervised tokens (an anchor p needs "
            "loss_mask[p] and loss_mask[p+1]); drop such samples before training"
        )
    # Random keys from the caller's generator (on its own device); invalid positions sort last.
    keys = torch.rand((batch, seq), generator=generator, device=generator.device).to(device)
    keys = keys.masked_fill(~candidate, 2.0)
    chosen = keys.argsort(dim=1)[:, :width]
    keep = torch.arange(width, device=device)[None, :] < candidate.sum(dim=1).clamp(max=width)[:, None]
    chosen = torch.where(keep, chosen, torch.full_like(chosen, seq)).sort(dim=1).values
    valid = chosen < seq
    return Anchors(positions=torch.where(valid, chosen, torch.zeros_like(chosen)), valid=valid)


def block_inputs(
    input_ids: torch.Tensor, anchors: Anchors, *, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids and positions, both ``[Bt, N*B]``: ``[x_p, MASK, ...]`` at ``p, p+1, ...``.

    A padding block is all MASK (it is fully masked in attention and carries no weight).
    """
    batch, n = anchors.positions.shape
    ids = torch.full((batch, n, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    first = torch.gather(input_ids, 1, anchors.positions)
    ids[:, :, 0] = torch.where(anchors.valid, first, torch.full_like(first, mask_token_id))
    offsets = torch.arange(block_size, device=input_ids.device)
    positions = anchors.positions[:, :, None] + offsets
    return ids.view(batch, n * block_size), positions.view(batch, n * block_size)


def slot_weights(block_size: int, gamma: float | None, *, device: torch.device | str | None = None) -> torch.Tensor:
    """``[B]``: 0 for slot 0, ``exp(-(k-1)/gamma)`` for slot k >= 1 (1 everywhere when gamma is None/<=0)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    w = torch.exp(-(k - 1).clamp(min=0) / gamma) if gamma is not None and gamma > 0 else torch.ones_like(k)
    w[0] = 0.0
    return w


def dpace_weights(confidence: torch.Tensor, scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights ``[n, B]`` from the drafter's confidence in each label ``[n, B]`` (no grad).

    A block's expected accepted length is ``sum_j prod_{i<=j} c_i`` over its scored slots, with ``c`` the
    confidences smoothed to ``(1 - alpha) * c + alpha`` (alpha keeps one bad slot from zeroing the rest).
    Slot k's weight is what that sum gains per unit of log-confidence at k: ``sum_{j>=k} prod_{i<=j} c_i``,
    so an early slot, which every later acceptance depends on, weighs more while the block is going well.
    Unscored slots count as confidence 1 and weigh 0.
    """
    with torch.no_grad():
        mask = scored.to(torch.float32)
        smooth = torch.where(scored, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(mask))
        reach = torch.cumprod(smooth, dim=-1) * mask  # prod_{i<=j} c_i for each scored slot j
        tail = reach.flip(-1).cumsum(-1).flip(-1)  # sum over j >= k
        return tail * mask


def block_targets(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: Anchors, *, block_size: int, gamma: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights ``[Bt, N, B]``: slot k of the block at p is scored against ``input_ids[p+k]``."""
    seq = input_ids.shape[1]
    index = anchors.positions[:, :, None] + torch.arange(block_size, device=input_ids.device)  # [Bt, N, B]
    in_bounds = index < seq
    safe = index.clamp(max=seq - 1)
    batch, n = anchors.positions.shape
    labels = torch.gather(input_ids, 1, safe.view(batch, -1)).view(batch, n, block_size)
    supervised = torch.gather(loss_mask.float(), 1, safe.view(batch, -1)).view(batch, n, block_size)
    weights = (
        supervised
        * in_bounds.float()
        * anchors.valid[:, :, None].float()
        * slot_weights(block_size, gamma, device=input_ids.device)
    )
    return labels, weights


# ---- attention mask ------------------------------------------------------------------------


def _visible(
    q_idx: torch.Tensor,
    kv_idx: torch.Tensor,
    anchor: torch.Tensor,
    valid: torch.Tensor,
    *,
    seq_len: int,
    block_size: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """The one rule both mask forms use. ``anchor``/``valid`` belong to the query's block."""
    q_block, q_off = q_idx // block_size, q_idx % block_size
    kv_block, kv_off = (kv_idx - seq_len) // block_size, (kv_idx - seq_len) % block_size
    context = (kv_idx < seq_len) & (kv_idx < anchor)
    own_block = (kv_idx >= seq_len) & (kv_block == q_block)
    if sliding_window is not None:
        # The query sits at anchor + q_off; it sees keys within the last `sliding_window` positions,
        # itself included, and nothing after itself (causal inside the block), as at inference.
        context = context & (anchor + q_off - kv_idx < sliding_window)
        own_block = own_block & (kv_off <= q_off) & (q_off - kv_off < sliding_window)
    return (context | own_block) & valid


def training_mask(
    anchors: Anchors, *, seq_len: int, block_size: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Dense boolean mask ``[Bt, 1, Q, KV]`` (True = may attend) for SDPA/eager on CPU."""
    device = anchors.positions.device
    n = anchors.num_blocks
    q_idx = torch.arange(n * block_size, device=device)[None, :, None]
    kv_idx = torch.arange(seq_len + n * block_size, device=device)[None, None, :]
    anchor = anchors.positions.repeat_interleave(block_size, dim=1)[:, :, None]
    valid = anchors.valid.repeat_interleave(block_size, dim=1)[:, :, None]
    mask = _visible(q_idx, kv_idx, anchor, valid, seq_len=seq_len, block_size=block_size, sliding_window=sliding_window)
    return mask[:, None]


def mask_mod(
    anchors: Anchors, *, seq_len: int, block_size: int, sliding_window: int | None = None
) -> t.Callable[..., torch.Tensor]:
    """flex_attention's ``mask_mod(b, h, q_idx, kv_idx)`` for the same rule as ``training_mask``."""
    positions, valid = anchors.positions, anchors.valid
    n = anchors.num_blocks

    def mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        block = (q_idx // block_size).clamp(max=n - 1)  # flex may probe padded query rows
        in_range = q_idx < n * block_size
        return in_range & _visible(
            q_idx,
            kv_idx,
            positions[b, block],
            valid[b, block],
            seq_len=seq_len,
            block_size=block_size,
            sliding_window=sliding_window,
        )

    return mod


# flex_attention's tile: a BlockMask says per (query tile, key tile) "empty", "partial" or "full".
_FLEX_TILE = 128


def _tile_counts(
    anchors: Anchors, *, seq_len: int, block_size: int, sliding_window: int | None, tile: int
) -> torch.Tensor:
    """``[Bt, Q/tile, KV/tile]`` (rounded up): visible (query, key) pairs per tile, from the anchors alone.

    The rule is an interval per query row: context keys ``[c0, c1)`` (before the anchor, cut to the
    window) and own-block keys ``[s0, s1)``; padding blocks see nothing. Counting their overlap with
    each key tile costs ``Q * KV/tile`` small integers, never the ``Q * KV`` mask.
    """
    # int32: every position and count fits, and at 65K tokens x 2,048 anchors each [Bt, Q, KT] temporary is
    # 100 MB a row instead of 200
    positions, valid = anchors.positions.to(torch.int32), anchors.valid
    device = positions.device
    batch, n = positions.shape
    q_len, kv_len = n * block_size, seq_len + n * block_size
    q = torch.arange(q_len, device=device, dtype=torch.int32)
    blk, off = q // block_size, q % block_size
    anchor = positions[:, blk]  # [Bt, Q]
    live = valid[:, blk]
    start = seq_len + blk * block_size  # [Q]: the row's own block among the keys
    if sliding_window is None:
        c0 = torch.zeros_like(anchor)
        s0, s1 = start, start + block_size
    else:
        c0 = (anchor + off - sliding_window + 1).clamp(min=0)
        s0, s1 = start + (off - sliding_window + 1).clamp(min=0), start + off + 1
    k0 = torch.arange(0, kv_len, tile, device=device, dtype=torch.int32)  # [KT]
    k1 = (k0 + tile).clamp(max=kv_len)

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return (torch.minimum(hi[..., None], k1) - torch.maximum(lo[..., None], k0)).clamp(min=0)

    rows = (overlap(c0, anchor) + overlap(s0, s1).expand(batch, -1, -1)) * live[..., None]  # [Bt, Q, KT]
    q_tiles = -(-q_len // tile)
    rows = F.pad(rows, (0, 0, 0, q_tiles * tile - q_len))
    return rows.view(batch, q_tiles, tile, -1).sum(dim=2)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's layout of a [Bt, 1, QT, KT] tile set: count per row and column indices, set ones first."""
    dense = tiles.to(torch.int32)
    return dense.sum(dim=-1, dtype=torch.int32), torch.argsort(dense, dim=-1, descending=True, stable=True).to(
        torch.int32
    )


def training_block_mask(
    anchors: Anchors, *, seq_len: int, block_size: int, sliding_window: int | None = None
) -> BlockMask:
    """flex_attention ``BlockMask`` with the semantics of ``training_mask`` (the GPU path).

    Built from the anchors directly: the same tiles, full tiles and order
    that ``create_block_mask(mask_mod(...))`` finds, without evaluating the mask on every (query, key).
    """
    if BlockMask is None:  # pragma: no cover
        raise RuntimeError("flex_attention is not available in this torch build; use the dense mask")
    n = anchors.num_blocks
    q_len, kv_len = n * block_size, seq_len + n * block_size
    counts = _tile_counts(
        anchors, seq_len=seq_len, block_size=block_size, sliding_window=sliding_window, tile=_FLEX_TILE
    )[:, None]
    full = counts == _FLEX_TILE * _FLEX_TILE  # edge tiles are never full: their padding is never visible
    partial = (counts > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    # The query-side tiles (backward) from the same tile sets, transposed. Not through
    # BlockMask.from_kv_blocks: torch derives them under torch.fx.traceback.annotate, which edits a
    # module-global dict that compiled calls in the other drafter threads edit too (KeyError: 'custom').
    q_num, q_idx = _ordered(partial.transpose(-2, -1))
    full_q_num, full_q_idx = _ordered(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths=(q_len, kv_len),
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        q_num_blocks=q_num,
        q_indices=q_idx,
        full_q_num_blocks=full_q_num,
        full_q_indices=full_q_idx,
        BLOCK_SIZE=(_FLEX_TILE, _FLEX_TILE),
        mask_mod=mask_mod(anchors, seq_len=seq_len, block_size=block_size, sliding_window=sliding_window),
    )


def training_masks(
    drafter: DFlashDraftModel, anchors: Anchors, *, seq_len: int, backend: str = "auto"
) -> dict[str, t.Any]:
    """``{layer_type: mask}`` for the drafter's layer types. backend: "dense", "flex" or "auto" (flex on GPU)."""
    if backend == "auto":
        backend = "flex" if anchors.positions.is_cuda and BlockMask is not None else "dense"
    if backend not in ("dense", "flex"):
        raise ValueError(f"attention backend: expected 'auto', 'dense' or 'flex', got {backend!r}")
    build = training_block_mask if backend == "flex" else training_mask
    masks: dict[str, t.Any] = {}
    for kind in dict.fromkeys(drafter.layer_types):
        window = drafter.config.sliding_window if kind == "sliding_attention" else None
        masks[kind] = build(anchors, seq_len=seq_len, block_size=drafter.block_size, sliding_window=window)
    return masks


# ---- loss --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LossTerms:
    """The weighted loss and the counts behind the metrics (all over scored slots, weight > 0)."""

    loss: torch.Tensor  # scalar, with grad: loss_sum / weight_sum
    weight_sum: torch.Tensor  # scalar
    loss_sum: torch.Tensor  # scalar, with grad: the weighted CE sum (gradient accumulation normalises it once)
    correct_per_slot: torch.Tensor  # [B] argmax == label
    scored_per_slot: torch.Tensor  # [B]
    accepted_sum: torch.Tensor  # scalar: sum over blocks of the matched prefix length (slots 1..)
    blocks: torch.Tensor  # scalar: blocks with at least one scored slot
    selector_correct: torch.Tensor | None = None  # DFlash2: the selector's right picks among in_top_k slots
    in_top_k: torch.Tensor | None = None  # DFlash2: scored slots whose label is among the unary top-k


class DraftHead(nn.Module):
    """The frozen lm_head followed by the drafter's ``draft_logits`` (its engines' logit scale and softcap):
    training scores the logits the engines draft from. ``weight`` is the lm_head's, for the dtype cast."""

    def __init__(self, lm_head: nn.Module, drafter: DFlashDraftModel) -> None:
        super().__init__()
        self.lm_head = lm_head
        self.shape = drafter.draft_logits

    @property
    def weight(self) -> torch.Tensor:
        return t.cast(torch.Tensor, self.lm_head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shape(self.lm_head(hidden))


def draft_head(drafter: DFlashDraftModel, lm_head: nn.Module) -> nn.Module:
    """``lm_head`` itself for a drafter whose logits the engines take as they are (the default), else a ``DraftHead``."""
    cfg = drafter.config
    lm_head = lm_head if drafter.lm_head is None else drafter.lm_head  # an own head: the draft vocabulary's
    return lm_head if cfg.logit_multiplier == 1.0 and cfg.logit_softcap is None else DraftHead(lm_head, drafter)


def _chunk_terms(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    lm_head: nn.Module,
    dpace_alpha: float | None = None,
    selector: CandidateSelector | None = None,
    selector_weight: float = 1.0,
) -> tuple[torch.Tensor, ...]:
    """hidden [n, B, H], labels/weights [n, B] -> (weighted CE sum, correct [B], scored [B], accepted, blocks,
    with ``dpace_alpha`` the chunk's D-PACE weight sum (``weights`` then only say which slots count), with a
    ``selector`` its correct picks and the slots whose label was among the top-k)."""
    weight = getattr(lm_head, "weight", None)
    if weight is not None and hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)  # a drafter may train in another dtype than the frozen head
    logits = lm_head(hidden).float()  # [n, B, V]: CE in fp32 whatever the model dtype
    # A label of -1 (outside an own draft vocabulary) has no logit: no loss, but a miss in the metrics.
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=-1).view_as(labels)
    scored = weights > 0
    dpace = None
    if dpace_alpha is not None:
        weights = dpace = dpace_weights(torch.exp(-ce.detach()), scored & (labels >= 0), dpace_alpha)
    loss_sum = (ce * weights).sum()
    extra: tuple[torch.Tensor, ...] = () if dpace is None else (dpace.sum(),)
    if selector is not None:
        sel_sum, sel_correct, in_top = _selector_terms(selector, hidden, logits, labels, scored, weights, dpace_alpha)
        loss_sum = loss_sum + selector_weight * sel_sum
        extra = (*extra, sel_correct, in_top)
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels) & scored
        # Teacher-forced acceptance: the run of correct, scored slots from slot 1 on.
        accepted = correct[:, 1:].long().cumprod(dim=1).sum(dim=1)
        has_scored = scored.any(dim=1)
        terms = (correct.sum(dim=0), scored.sum(dim=0), (accepted * has_scored).sum(), has_scored.sum())
    return (loss_sum, *terms, *extra)


def _selector_terms(
    selector: CandidateSelector,
    hidden: torch.Tensor,
    logits: torch.Tensor,
    labels: torch.Tensor,
    scored: torch.Tensor,
    weights: torch.Tensor,
    dpace_alpha: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DFlash2's selector objective on one chunk: cross-entropy over each slot's top-k candidates, the
    previous slot's label as the predecessor (teacher forcing). A label outside the top-k replaces the k-th
    candidate, so every scored slot has a target among K; the picks count only where serving could make them
    (the label in the unary top-k). Returns (weighted CE sum, correct picks, labels in the top-k)."""
    k = selector.top_k
    candidates = logits.detach().topk(k, dim=-1).indices  # [n, B, K]
    match = candidates == labels[..., None]
    in_top = match.any(dim=-1)
    target = torch.where(in_top, match.long().argmax(dim=-1), torch.full_like(labels, k - 1))
    candidates = torch.cat([candidates[..., :-1], torch.where(in_top, candidates[..., -1], labels)[..., None]], dim=-1)
    previous = torch.cat([labels[:, :1], labels[:, :-1]], dim=1)  # slot 0 (never scored) gets its own token
    scores = logits.gather(-1, candidates) + selector.edge_scores(hidden, previous, candidates).float()
    ce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none").view_as(labels)
    if dpace_alpha is not None:
        weights = dpace_weights(torch.exp(-ce.detach()), scored, dpace_alpha)
    loss_sum = (ce * weights).sum()
    with torch.no_grad():
        live = in_top & scored
        picked = scores.argmax(dim=-1) == target
        return loss_sum, (picked & live).sum(), live.sum()


def dflash_loss(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_size: int | None = 128,
    keep: torch.Tensor | None = None,
    dpace_alpha: float | None = None,
    selector: CandidateSelector | None = None,
    selector_weight: float = 1.0,
) -> LossTerms:
    """Weighted cross-entropy of the block slots through the frozen lm_head.

    ``hidden`` [Bt, N, B, H] (drafter output, final-normed), ``labels``/``weights`` [Bt, N, B].
    ``chunk_size``: blocks per lm_head + CE chunk, checkpointed so that only one chunk's logits live at a
    time (in forward and in backward); None or 0 computes everything at once (no recomputation).
    ``keep``: indices into the ``Bt*N`` blocks of those with a positive weight, when the caller knows
    them from host data; without it they are found on the device (``nonzero``: a host sync on a GPU).
    ``dpace_alpha``: weigh the slots by ``dpace_weights`` of this forward's confidences (``weights`` > 0
    say which slots are scored); None: ``weights`` as given. ``selector``: add DFlash2's selector objective
    (``selector_weight`` times its weighted cross-entropy, in the same sum over the same weight sum).
    """
    block = labels.shape[-1]
    hidden = hidden.reshape(-1, block, hidden.shape[-1])
    labels = labels.reshape(-1, block)
    weights = weights.reshape(-1, block)
    # Padding blocks (and blocks with nothing supervised) cost lm_head time for nothing: drop them.
    if keep is None:
        keep = (weights > 0).any(dim=1).nonzero().squeeze(1)
    if keep.numel() == 0:
        raise ValueError("dflash_loss: no slot has a positive weight (no valid block with a supervised target)")
    hidden, labels, weights = hidden.index_select(0, keep), labels.index_select(0, keep), weights.index_select(0, keep)
    total = hidden.shape[0]
    step = total if not chunk_size else chunk_size
    use_checkpoint = bool(chunk_size) and torch.is_grad_enabled() and hidden.requires_grad
    sums: list[torch.Tensor] | None = None
    for start in range(0, total, step):
        parts = (hidden[start : start + step], labels[start : start + step], weights[start : start + step])
        if use_checkpoint:
            terms = checkpoint(
                _chunk_terms, *parts, lm_head, dpace_alpha, selector, selector_weight, use_reentrant=False
            )
        else:
            terms = _chunk_terms(*parts, lm_head, dpace_alpha, selector, selector_weight)
        sums = list(terms) if sums is None else [a + b for a, b in zip(sums, terms)]
    assert sums is not None
    loss_sum, correct, scored, accepted, blocks = sums[:5]
    weight_sum = (weights * (labels >= 0)).sum() if dpace_alpha is None else sums[5]
    sel = sums[6:] if dpace_alpha is not None else sums[5:]
    return LossTerms(
        loss=loss_sum / weight_sum,
        weight_sum=weight_sum,
        loss_sum=loss_sum,
        correct_per_slot=correct,
        scored_per_slot=scored,
        accepted_sum=accepted,
        blocks=blocks,
        selector_correct=sel[0] if sel else None,
        in_top_k=sel[1] if sel else None,
    )


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """One drafter step. ``loss`` has grad; the metrics stay on the device (read them once per log interval)."""

    loss: torch.Tensor
    loss_sum: torch.Tensor  # the weighted CE sum (with grad) and the weight sum behind ``loss``: accumulating
    weight_sum: torch.Tensor  # micro-batches divides the sum of sums by ONE weight sum, as SpecForge does
    acc_per_slot: torch.Tensor  # [B-1] float32: accuracy of slots 1..B-1 (0 where nothing was scored)
    acc: torch.Tensor  # 0-dim float64: accuracy over all scored slots
    tau_tf: torch.Tensor  # 0-dim float64: teacher-forced accept length, mean over blocks of 1 + matched prefix
    n_tokens: int  # supervised tokens in the batch (loss_mask), for Ktok/s
    n_blocks: int  # valid anchors (blocks) trained on
    anchors: Anchors
    sel_acc: torch.Tensor | None = None  # DFlash2, 0-dim float64: selector picks right where the label is in top-k
    top_k_rate: torch.Tensor | None = None  # DFlash2, 0-dim float64: scored slots whose label is in the top-k


def drafter_loss(
    drafter: DFlashDraftModel,
    head: TargetHead,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    *,
    num_anchors: int,
    gamma: float | None = None,
    generator: torch.Generator,
    chunk_size: int | None = 128,
    attention: str = "auto",
    position_weight: str = "decay",
    dpace_alpha: float = 0.5,
    selector_weight: float = 1.0,
) -> StepOutput:
    """The whole DFlash objective for one batch: the entry point a drafter replica calls per step.

    ``features`` [Bt, S, n*H] from ``TargetModel.features`` (on the drafter's device); ``input_ids``
    and ``loss_mask`` [Bt, S] on the host (pinned for an asynchronous copy), moved there.
    ``gamma`` None: ``default_gamma(block_size)``.
    ``attention``: "auto" (flex BlockMask on GPU, dense mask elsewhere), "dense" or "flex".
    ``position_weight``: "decay" (``slot_weights`` of ``gamma``) or "dpace" (``dpace_weights``, ``dpace_alpha``).
    No host sync: every shape and count comes from the host copy of ``loss_mask``.
    """
    device = features.device
    if input_ids.shape != loss_mask.shape or features.shape[:2] != input_ids.shape:
        raise ValueError(
            f"input_ids {list(input_ids.shape)}, loss_mask {list(loss_mask.shape)} and features "
            f"{list(features.shape[:2])} must agree on [batch, seq]"
        )
    block = drafter.block_size
    gamma = default_gamma(block) if gamma is None else gamma
    batch, seq = input_ids.shape
    # Host side (a device loss_mask is read once here): tokens, anchors per row, the blocks that count.
    host_mask = loss_mask.cpu()
    n_tokens = int(t.cast(int, (host_mask > 0).sum().tolist()))  # a 0-d tensor's tolist() is a number
    counts = candidate_counts(host_mask).tolist()
    width = min(num_anchors, max(counts, default=0))
    per_row = [min(width, c) for c in counts]  # valid anchors come first in every row
    keep = torch.tensor([r * width + j for r, k in enumerate(per_row) for j in range(k)], dtype=torch.long)

    input_ids = input_ids.to(device, non_blocking=True)
    loss_mask = loss_mask.to(device, non_blocking=True)
    anchors = sample_anchors(loss_mask, num_anchors=num_anchors, block_size=block, generator=generator, counts=counts)
    block_ids, block_positions = block_inputs(input_ids, anchors, block_size=block, mask_token_id=drafter.mask_token_id)
    context_positions = torch.arange(seq, device=device).expand(batch, seq)
    hidden = drafter(
        position_ids=torch.cat([context_positions, block_positions], dim=1),
        attention_mask=training_masks(drafter, anchors, seq_len=seq, backend=attention),
        noise_embedding=head.embed(block_ids),
        target_hidden=features,
    )
    if position_weight not in ("decay", "dpace"):
        raise ValueError(f"position_weight: expected 'decay' or 'dpace', got {position_weight!r}")
    dpace = position_weight == "dpace"
    labels, weights = block_targets(input_ids, loss_mask, anchors, block_size=block, gamma=None if dpace else gamma)
    labels = draft_vocab.labels(drafter, labels)  # an own draft vocabulary: its ids, -1 outside it
    terms = dflash_loss(
        hidden.view(batch, anchors.num_blocks, block, -1),
        draft_head(drafter, head.lm_head),
        labels,
        weights,
        chunk_size=chunk_size,
        keep=keep.to(device, non_blocking=True),
        dpace_alpha=dpace_alpha if dpace else None,
        selector=drafter.candidate_selector,
        selector_weight=selector_weight,
    )

    correct = terms.correct_per_slot[1:].double()
    scored = terms.scored_per_slot[1:].double()
    acc_per_slot = torch.where(scored > 0, correct / scored.clamp(min=1), torch.zeros_like(correct))
    n_scored = scored.sum()
    blocks = terms.blocks.double()
    sel_acc = top_k_rate = None
    if terms.selector_correct is not None and terms.in_top_k is not None:
        live = terms.in_top_k.double()
        sel_acc = torch.where(live > 0, terms.selector_correct.double() / live.clamp(min=1), torch.zeros_like(live))
        top_k_rate = torch.where(n_scored > 0, live / n_scored.clamp(min=1), torch.zeros_like(live))
    return StepOutput(
        loss=terms.loss,
        loss_sum=terms.loss_sum,
        weight_sum=terms.weight_sum.detach(),
        acc_per_slot=acc_per_slot.float(),
        acc=torch.where(n_scored > 0, correct.sum() / n_scored.clamp(min=1), torch.zeros_like(n_scored)),
        tau_tf=torch.where(
            blocks > 0, 1.0 + terms.accepted_sum.double() / blocks.clamp(min=1), torch.full_like(blocks, math.nan)
        ),
        n_tokens=n_tokens,
        n_blocks=sum(per_row),
        anchors=anchors,
        sel_acc=sel_acc,
        top_k_rate=top_k_rate,
    )
