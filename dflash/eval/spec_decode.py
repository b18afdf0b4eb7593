"""Exact greedy speculative decoding with a DFlash drafter: the offline measure of acceptance (tau).

Each step drafts one block ``[last verified token, MASK x (B-1)]`` at positions ``start .. start+B-1``
with the drafter (context: target features of every committed position, through the drafter's KV
cache), verifies it with ONE target forward, accepts the longest prefix of draft tokens equal to the
target's own greedy tokens, commits the target's next token after it (the bonus), and crops both caches
back to the committed length. The output is token-for-token the target's greedy output; what the drafter
changes is how many tokens each target forward yields: ``tau = mean(accepted + 1)``.

This follows z-lab's ``dflash_generate``, written for batch 1. Two options reproduce the rest of it:

- ``sampler`` (temperature T > 0): the target's tokens are SAMPLED, as z-lab's benchmark samples them for
  its T > 0 rows, and the drafts stay greedy (z-lab drafts with argmax at every temperature); a draft is
  accepted while it equals the target's sampled token at its position. Each committed token is a sample of
  the target at that prefix, so the output is distributed exactly as the target's own sampling. The
  sample at new-token index k is ``argmax(logits / T + g_k)`` (Gumbel-max) with ``g_k`` drawn from
  ``(seed, stream, k)`` alone: the same seed gives the same output, and it is token for token what
  ``target_sample`` (the target alone, one token per forward) gives with that seed.
- ``overrun`` (z-lab's loop): every step drafts and verifies a full block, even past ``max_new_tokens``,
  and the loop runs while the last committed token is inside the budget (so a step may lie wholly past
  it); a stop token ends the loop after the step that committed it (the prefill's token included); the
  output is then cut to the budget and the first stop token. Its steps are the ones z-lab counts.

A DFlash2 drafter (``drafter.candidate_selector``) drafts as vLLM's and SGLang's DFlash2 walk does at T = 0:
each slot's top-k unary candidates, reranked left to right by the token picked before (``draft_tokens``,
``dflash.model.drafter.selector_walk``). At T > 0 the engines sample that walk and verify with a rejection
sampler; here drafts stay greedy and are verified by match, as for DFlash, so the output stays token for
token ``target_sample``'s (exact either way; the engines' acceptance at T > 0 can be higher).

``step_credits`` is how many tokens each step is credited with under the two counting rules (module doc
of ``dflash.eval.evaluate``): ``"dflash"`` (tokens committed inside the output) and ``"zlab"`` (accepted + 1
for every step z-lab's loop ran).
"""

from __future__ import annotations

import dataclasses
import typing as t

import numpy as np
import torch

if t.TYPE_CHECKING:
    from dflash.model.drafter import DFlashDraftModel
    from dflash.model.target import TargetHead, TargetModel

__all__ = [
    "COUNT_RULES",
    "Sampler",
    "draft_tokens",
    "SpecResult",
    "speculative_generate",
    "step_credits",
    "target_greedy",
    "target_sample",
]

COUNT_RULES = ("dflash", "zlab")


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Seeded sampling from the target's ``softmax(logits / temperature)``, one draw per output position.

    The token at new-token index k of stream ``stream`` (a prompt) is ``argmax(logits / T + g)`` with
    Gumbel noise ``g`` from numpy's generator seeded with ``[seed, stream, k]``: it depends on nothing
    else (not on how many positions a forward scores, nor on the device), so speculative decoding and
    the target alone draw the same token wherever their logits agree.
    """

    temperature: float
    seed: int = 0
    stream: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature: a Sampler needs T > 0 (T = 0 is greedy), got {self.temperature}")

    def noise(self, k: int, vocab: int) -> torch.Tensor:
        u = np.random.default_rng([self.seed, self.stream, k]).random(vocab)
        with np.errstate(divide="ignore"):  # u == 0 gives -inf: that token is never drawn, as it should
            return torch.from_numpy(-np.log(-np.log(u))).float()

    def pick(self, logits: torch.Tensor, first: int) -> torch.Tensor:
        """Tokens ``[T]`` for logits ``[T, V]`` that predict new-token indices ``first .. first + T - 1``."""
        vocab = logits.shape[-1]
        g = torch.stack([self.noise(first + j, vocab) for j in range(logits.shape[0])]).to(logits.device)
        return (logits.float() / self.temperature + g).argmax(dim=-1)


def step_credits(accepted: t.Sequence[int], *, max_new: int, stop_at: int | None, rule: str) -> list[int]:
    """Tokens each target step is credited with, from the drafts each step accepted, in decode order.

    New token 0 came from the prefill; step i's anchor is new token ``s_i`` (``s_0 = 0``,
    ``s_{i+1} = s_i + accepted[i] + 1``) and it commits new tokens ``s_i + 1 .. s_{i+1}``. ``stop_at`` is
    the index of the first stop token of the output (None: none).

    - ``"dflash"``: the output ends at ``end = min(max_new - 1, stop_at)``; step i counts while
      ``s_i < end`` and is credited with the tokens it committed up to ``end``: the credits add up to
      the output's tokens after the first, so tau is output tokens per target forward.
    - ``"zlab"`` (z-lab's ``dflash_generate``): step i counts while ``s_i < max_new`` and no stop token is
      among new tokens ``0 .. s_i`` (step 0 always counts), credited with ``accepted[i] + 1`` whole:
      drafts accepted past the budget or past the stop token count, and so does a step taken when only
      the anchor was left in the budget.
    """
    if rule not in COUNT_RULES:
        raise ValueError(f"rule: expected one of {COUNT_RULES}, got {rule!r}")
    out: list[int] = []
    s = 0
    if rule == "dflash":
        end = max_new - 1 if stop_at is None else min(max_new - 1, stop_at)
        for a in accepted:
            if s >= end:
                break
            out.append(min(a + 1, end - s))
            s += a + 1
        return out
    for i, a in enumerate(accepted):
        if s >= max_new or (i > 0 and stop_at is not None and stop_at <= s):
            break
        out.append(a + 1)
        s += a + 1
    return out


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


@torch.no_grad()
def target_sample(
    target: TargetModel,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    sampler: Sampler,
    stop_token_ids: t.Sequence[int] | None = None,
) -> torch.Tensor:
    """The reference at T > 0: the target alone samples one token per forward with ``sampler``.
    ``[1, P + T]``; stops after the first stop token (kept)."""
    input_ids = input_ids.to(target.device)
    stops = set(stop_token_ids or ())
    cache = target.new_cache()
    tokens, step_ids, position = input_ids, input_ids, 0
    for k in range(max_new_tokens):
        positions = torch.arange(position, position + step_ids.shape[1], device=target.device)[None]
        logits, _ = target.step(step_ids, positions, cache, with_features=False)
        position += step_ids.shape[1]
        step_ids = sampler.pick(logits[0, -1:], k)[None]
        tokens = torch.cat([tokens, step_ids], dim=1)
        if int(step_ids) in stops:
            break
    return tokens


def draft_tokens(
    drafter: DFlashDraftModel, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor
) -> torch.Tensor:
    """The greedy drafts ``[1, L]`` of one block from its predicting slots' ``hidden`` [1, L, H] and
    ``logits`` [1, L, V]: the argmax (DFlash), or the selector's walk from the ``anchor`` token [1] (DFlash2)."""
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None:
        return logits.argmax(dim=-1)
    from dflash.model.drafter import selector_walk  # the drafter module is heavy to import: only DFlash2 gets here

    return selector_walk(selector, logits, hidden, anchor)[0]


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
    sampler: Sampler | None = None,
    overrun: bool = False,
) -> SpecResult:
    """Decoding of ``max_new_tokens`` tokens (fewer after a stop token) with drafted blocks: greedy, or
    sampled by ``sampler`` (module doc); ``overrun``: z-lab's loop (module doc).

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

    out = torch.full((1, max_len + (block if overrun else 0)), mask_id, dtype=torch.long, device=device)
    out[:, :num_prompt] = prompt
    target_cache = target.new_cache()
    draft_cache = drafter.new_cache()

    logits, feats = target.step(prompt, torch.arange(num_prompt, device=device)[None], target_cache)
    assert feats is not None
    out[0, num_prompt] = logits[0, -1].argmax() if sampler is None else sampler.pick(logits[0, -1:], 0)[0]
    start = num_prompt  # the last committed token; the target has not seen it yet
    pending = feats  # target features the drafter has not consumed (positions draft_cache_len .. start-1)
    accept_lengths: list[int] = []
    block_starts: list[int] = []
    kept: list[torch.Tensor] = []
    # z-lab's loop looks for a stop token only after a step, so a stop token from the prefill still gets one
    finished = not overrun and _first_stop(out[0, start : start + 1], stops) is not None

    while not finished and (start < max_len if overrun else start + 1 < max_len):
        verify = block if overrun else min(block, max_len - start - 1)  # ours never drafts past max_new_tokens
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
            draft_logits = drafter.engine_logits(hidden[:, 1:], head.lm_head)
            block_ids[0, 1:] = draft_tokens(drafter, hidden[:, 1:], draft_logits, block_ids[:, 0])[0]
            if keep_draft_logits:
                kept.append(draft_logits[0].float().cpu())
        block_starts.append(start)

        logits, feats = target.step(block_ids, torch.arange(start, start + verify, device=device)[None], target_cache)
        assert feats is not None
        if sampler is None:
            posterior = logits[0].argmax(dim=-1)  # the target's greedy token after each block position
        else:  # the target's sampled token after each block position (new-token index start - P + 1 ...)
            posterior = sampler.pick(logits[0], start - num_prompt + 1)
        accepted = int((block_ids[0, 1:] == posterior[:-1]).long().cumprod(dim=0).sum())
        new = torch.cat([block_ids[0, 1 : accepted + 1], posterior[accepted : accepted + 1]])
        out[0, start + 1 : start + 2 + accepted] = new
        accept_lengths.append(accepted)
        if overrun:
            start += accepted + 1
            if _first_stop(out[0, num_prompt : start + 1], stops) is not None:
                break
        else:
            stop_at = _first_stop(new, stops)
            if stop_at is not None:
                start += stop_at + 1
                finished = True
                break
            start += accepted + 1
        _crop(target_cache, start)  # the verified tokens' KV stays; the rejected drafts' goes
        pending = torch.cat([pending, feats[:, : accepted + 1]], dim=1)

    if overrun:  # cut back to the budget and the first stop token, as z-lab returns its output
        end = min(start + 1, max_len)
        stop_at = _first_stop(out[0, num_prompt:end], stops)
        start = num_prompt + stop_at if stop_at is not None else end - 1  # the last token kept
    return SpecResult(
        out[:, : start + 1].clone(), accept_lengths, num_prompt, block_starts, kept if keep_draft_logits else None
    )
