"""The one dtype vocabulary: a config's target.dtype and drafter.dtype, `dflash export --dtype`, the benches.

Canonical names are torch's (and config.json's ``torch_dtype``): ``float32``, ``bfloat16``, ``float16``.
``export --dtype`` also reads the short spellings it took first (``fp32``, ``bf16``, ``fp16``). Torch is
imported only by ``torch_dtype``: the config parse needs the names alone."""

from __future__ import annotations

import typing as t

if t.TYPE_CHECKING:
    import torch

NAMES = ("float32", "bfloat16", "float16")
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical(name: str) -> str | None:
    """``bf16`` or ``bfloat16`` -> ``bfloat16``; None for a name that is neither."""
    return name if name in NAMES else ALIASES.get(name)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a name of either spelling (KeyError for another)."""
    import torch

    full = canonical(name)
    if full is None:
        raise KeyError(name)
    return t.cast("torch.dtype", getattr(torch, full))


__all__ = ["ALIASES", "NAMES", "canonical", "torch_dtype"]
