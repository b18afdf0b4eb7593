"""A drafter's own, smaller draft vocabulary: which target tokens it can propose, and the maps the engines read.

``drafter.draft_vocab_size`` N (below the target's vocabulary V) gives the drafter its own lm_head of N rows.
Which N target tokens: the N most frequent SUPERVISED tokens (``loss_mask`` > 0: the labels the drafter is
trained on) of the run's whole training data, counted once before step 0; ties go to the lower id, and when
fewer than N distinct tokens occur the lowest unused ids fill the rest. Then sorted by id. This is what
speculators 0.9.0 does (src/speculators/train/vocab_mapping.py ``save_token_frequency_distribution`` counts
the loss-masked tokens, ``build_vocab_mappings_from_distribution`` sorts by (-count, id), fills, sorts), so
the same data gives the same vocabulary there and here; it is deterministic (no sampling, no threads).

The maps, in the engines' convention (vLLM 0.34 qwen3_dflash.py ``compute_logits``: ``targets = base +
draft_id_to_target_id``; speculators ``d2t`` "target_token_id = draft_idx + draft_to_target[draft_idx]"):

- ``d2t`` int64 [N]: ``target_id - draft_id`` (an offset, not the id);
- ``t2d`` bool [V]: True at the target ids in the draft vocabulary (vLLM skips it on load; speculators checks
  its sum against N).

The head starts as the target lm_head's rows of those ids (speculators ``_load_verifier_weights`` slices the
verifier head by ``t2d``), then trains with the drafter. Labels outside the draft vocabulary: ``labels``.
"""

from __future__ import annotations

import logging
import typing as t

import numpy as np
import torch

if t.TYPE_CHECKING:
    from dflash.model.drafter import DFlashDraftModel

__all__ = ["fill", "install", "labels", "maps", "supervised_counts"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 22  # supervised ids per bincount


class _Samples(t.Protocol):
    def __len__(self) -> int: ...

    def read(self, i: int) -> t.Any: ...


def supervised_counts(dataset: _Samples, vocab_size: int) -> np.ndarray:
    """int64 [V]: how often each target id is a supervised token (``loss_mask`` > 0) in ``dataset``, the samples
    as the run reads them (cut to ``data.max_length``). One bincount per ~4M ids, not one [V] array per sample."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[np.ndarray] = []
    held = 0
    for i in range(len(dataset)):
        sample = dataset.read(i)
        ids = np.asarray(sample.input_ids, dtype=np.int64)[np.asarray(sample.loss_mask) > 0]
        pending.append(ids[(ids >= 0) & (ids < vocab_size)])
        held += len(ids)
        if held >= _CHUNK or i == len(dataset) - 1:
            counts += np.bincount(np.concatenate(pending), minlength=vocab_size)
            pending, held = [], 0
    return counts


def maps(counts: np.ndarray | t.Sequence[int], draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``d2t`` int64 [N], ``t2d`` bool [V]) for the ``draft_vocab_size`` most frequent ids of ``counts`` [V]."""
    freq = np.asarray(counts, dtype=np.int64)
    vocab = len(freq)
    if not 1 <= draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size: expected 1..{vocab} (the target vocabulary), got {draft_vocab_size}")
    seen = np.flatnonzero(freq > 0)
    order = seen[np.lexsort((seen, -freq[seen]))]  # by count, descending; ties by id
    chosen = order[:draft_vocab_size].tolist()
    if len(chosen) < draft_vocab_size:  # too few distinct tokens: the lowest unused ids, as speculators fills
        used = set(chosen)
        chosen += [i for i in range(vocab) if i not in used][: draft_vocab_size - len(chosen)]
    ids = torch.tensor(sorted(chosen), dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size, dtype=torch.long), t2d


def install(
    drafter: DFlashDraftModel, d2t: torch.Tensor, t2d: torch.Tensor, target_lm_head: torch.Tensor | None = None
) -> None:
    """Set the drafter's ``d2t``/``t2d`` and, given the target's lm_head weight [V, H], its head's first weights."""
    if drafter.lm_head is None:
        raise ValueError("install: this drafter scores with the target's lm_head (no draft_vocab_size)")
    with torch.no_grad():
        drafter.d2t.copy_(d2t)
        drafter.t2d.copy_(t2d)
        if target_lm_head is not None:
            ids = torch.arange(len(d2t), device=d2t.device) + d2t
            drafter.lm_head.weight.copy_(target_lm_head[ids.to(target_lm_head.device)].to(drafter.lm_head.weight))


def fill(drafter: DFlashDraftModel, dataset: _Samples, target_lm_head: torch.Tensor) -> None:
    """A fresh drafter with an own draft vocabulary gets it from ``dataset`` (nothing to do without one)."""
    if drafter.lm_head is None:
        return
    vocab, n = int(drafter.config.vocab_size), int(drafter.config.draft_vocab)
    counts = supervised_counts(dataset, vocab)
    d2t, t2d = maps(counts, n)
    install(drafter, d2t, t2d, target_lm_head)
    total = int(counts.sum())
    covered = int(counts[t2d.numpy()].sum())
    logger.info(
        "drafter: draft vocabulary of %d of %d target tokens covers %.2f%% of %d supervised tokens",
        n,
        vocab,
        100.0 * covered / max(total, 1),
        total,
    )


def labels(drafter: DFlashDraftModel, target_labels: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids, -1 for a target id outside the draft vocabulary (the drafter cannot propose
    it: the loss has no logit to train towards, and the metrics count it as a miss, as serving would);
    ``target_labels`` itself when the drafter scores with the target's lm_head."""
    if drafter.lm_head is None:
        return target_labels
    t2d = drafter.t2d
    index = torch.where(t2d, torch.cumsum(t2d, 0) - 1, torch.full_like(t2d, -1, dtype=torch.long))
    return index[target_labels]
