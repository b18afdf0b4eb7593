"""Exact greedy speculative decoding with a DFlash drafter: the offline measure of acceptance (tau).

Each step drafts one block ``[last verified token, MASK x (B-1)]`` at positions ``start .. start+B-1``
with the drafter (context: target features of every committed position, through the drafter's KV
cache), verifies it with ONE target forward, accepts the longest prefix of draft tokens equal to the
target's own greedy tokens, commits the target's next token after it (the bonus), and crops both caches
back to the committed length. The output is token-for-token the target's greedy output; what the drafter
changes is how many tokens each target forward yields: ``tau = mean(accepted + 1)``.

This follows z-lab's ``dflash_generate`` (greedy branch), written for batch 1.
"""

from __future__ import annotations

import dataclasses
import typing as t

import torch

if t.TYPE_CHECKING:
    from dflash.drafter import DFlashDraftModel
    from dflash.target import TargetHead, TargetModel

__all__ = ["SpecResult", "speculative_generate", "target_greedy"]


@dataclasses.dataclass(frozen=True)
class SpecResult:
    """``tokens`` [1, P + T] (prompt included); ``accept_lengths``: draft tokens accepted per target step."""

    tokens: torch.Tensor
    accept_lengths: list[int]
    num_prompt_tokens: int
    block_starts: list[int]  # position of each step's first block token (its anchor)
    draft_logits: list[torch.Tensor] | None = None  # per step [B'-1, V] when asked for

    @property
    def new_tokens(self) -> torch.Tensor:
        return self.tokens[:, self.num_prompt_tokens :]

    @property
    def tau(self) -> float:
        """Tokens per target forward in decoding: mean(accepted + 1)."""
        if not self.accept_lengths:
            return 0.0
        return sum(a + 1 for a in self.accept_lengths) / len(self.accept_lengths)


def target_greedy(
    target: TargetModel, input_ids: torch.Tensor, *, max_new_tokens: int, stop_token_ids: t.Sequence[int] | None = None
) -> torch.Tensor:
    """The reference: the target alone, one token per forward. ``[1, P + T]``."""
    return target.generate_greedy(input_ids, max_new_tokens, stop_token_ids=stop_token_ids)


def _crop(cache: t.Any, length: int) -> None:
    # A negative argument removes that many tokens in every transformers version we support
    # (5.x refuses a positive length).
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _first_stop(tokens: torch.Tensor, stops: torch.Tensor | None) -> int | None:
    if stops is None or tokens.numel() == 0:
        return None
    hits = torch.isin(tokens, stops).nonzero()
    return int(hits[0]) if hits.numel() else None


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDraftModel,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    head: TargetHead | None = None,
    stop_token_ids: t.Sequence[int] | None = None,
    keep_draft_logits: bool = False,
) -> SpecResult:
    """Greedy decoding of ``max_new_tokens`` tokens (fewer after a stop token) with drafted blocks.

    ``block_size`` defaults to the drafter's; ``head`` to the target's own embedding and lm_head. With
    ``keep_draft_logits`` each step's draft logits are kept (for train/inference parity checks).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: expected shape [1, P] (batch 1), got {list(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
    block = drafter.block_size if block_size is None else block_size
    if block < 1:
        raise ValueError(f"block_size: must be >= 1, got {block}")
    device = target.device
    if next(drafter.parameters()).device != device:
        raise ValueError(f"drafter is on {next(drafter.parameters()).device}, target on {device}: put both on one")
    head = head if head is not None else target.head()
    mask_id = drafter.mask_token_id
    prompt = input_ids.to(device)
    num_prompt = prompt.shape[1]
    max_len = num_prompt + max_new_tokens
    stops = torch.tensor(list(stop_token_ids), device=device) if stop_token_ids else None

    if max_new_tokens == 0:
        return SpecResult(prompt.clone(), [], num_prompt, [], [] if keep_draft_logits else None)

    out = torch.full((1, max_len), mask_id, dtype=torch.long, device=device)
    out[:, :num_prompt] = prompt
    target_cache = target.new_cache()
    draft_cache = drafter.new_cache()

    logits, feats = target.step(prompt, torch.arange(num_prompt, device=device)[None], target_cache)
    assert feats is not None
    out[0, num_prompt] = logits[0, -1].argmax()
    start = num_prompt  # the last committed token; the target has not seen it yet
    pending = feats  # target features the drafter has not consumed (positions draft_cache_len .. start-1)
    accept_lengths: list[int] = []
    block_starts: list[int] = []
    kept: list[torch.Tensor] = []
    finished = _first_stop(out[0, start : start + 1], stops) is not None

    while not finished and start + 1 < max_len:
        verify = min(block, max_len - start - 1)  # never draft past max_new_tokens
        block_ids = torch.full((1, verify), mask_id, dtype=torch.long, device=device)
        block_ids[0, 0] = out[0, start]
        if verify > 1:
            cached = draft_cache.get_seq_length()
            positions = torch.arange(cached, start + verify, device=device)[None]
            hidden = drafter(
                position_ids=positions,
                noise_embedding=head.embed(block_ids),
                target_hidden=pending,
                past_key_values=draft_cache,
            )
            draft_cache.crop(start)  # keep the context, drop the block
            pending = pending[:, :0]
            draft_logits = head.logits(hidden[:, 1:].to(head.lm_head.weight.dtype))
            block_ids[0, 1:] = draft_logits[0].argmax(dim=-1)
            if keep_draft_logits:
                kept.append(draft_logits[0].float().cpu())
        block_starts.append(start)

        logits, feats = target.step(block_ids, torch.arange(start, start + verify, device=device)[None], target_cache)
        assert feats is not None
        posterior = logits[0].argmax(dim=-1)  # the target's greedy token after each block position
        accepted = int((block_ids[0, 1:] == posterior[:-1]).long().cumprod(dim=0).sum())
        new = torch.cat([block_ids[0, 1 : accepted + 1], posterior[accepted : accepted + 1]])
        out[0, start + 1 : start + 2 + accepted] = new
        accept_lengths.append(accepted)
        stop_at = _first_stop(new, stops)
        if stop_at is not None:
            start += stop_at + 1
            finished = True
            break
        start += accepted + 1
        _crop(target_cache, start)  # the verified tokens' KV stays; the rejected drafts' goes
        pending = torch.cat([pending, feats[:, : accepted + 1]], dim=1)

    return SpecResult(
        out[:, : start + 1].clone(), accept_lengths, num_prompt, block_starts, kept if keep_draft_logits else None
    )
