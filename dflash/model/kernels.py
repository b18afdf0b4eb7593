"""The fast kernels a hybrid target needs: flash-linear-attention and causal-conv1d for Gated DeltaNet layers.

Qwen3.5 / Qwen3.6 (and Qwen3-Next) interleave Gated DeltaNet layers (``layer_types`` entries
``"linear_attention"``) with full attention. transformers runs those layers with flash-linear-attention's
chunked kernels (``import fla``) and causal-conv1d's short convolution (``import causal_conv1d``) when they
are installed; without them it falls back to ``torch_chunk_gated_delta_rule``, a Python loop over 64-token
chunks (about 700 small kernels per layer: ~35K launches per forward of a 27B target), and the five target
threads of a box then spend their time fighting over the GIL instead of on the GPU.

``dflash train`` warns in one line at start (``missing_kernels_warning``); ``dflashctl doctor`` runs the
same rule on the host (``ops.doctor.KERNEL_PROBE``, stdlib only: the far side has no dflash to import).
"""

from __future__ import annotations

import importlib.util
import typing as t

LINEAR_ATTENTION = "linear_attention"
# (pip name, module transformers imports): what a Gated DeltaNet layer runs fast with
KERNELS = (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))
INSTALL_HINT = "pip install flash-linear-attention causal-conv1d"


def linear_attention_layers(config: t.Any) -> int:
    """How many of a target config's layers are linear attention (its own ``layer_types`` or its text config's)."""

    def get(obj: t.Any, key: str) -> t.Any:
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    for part in (config, get(config, "text_config")):
        types = get(part, "layer_types") if part is not None else None
        if types:
            return sum(1 for kind in types if kind == LINEAR_ATTENTION)
    return 0


def missing_kernels() -> list[str]:
    """The pip names of the kernels that are not importable here (found without importing them)."""
    return [pip for pip, module in KERNELS if importlib.util.find_spec(module) is None]


def missing_kernels_warning(config: t.Any) -> str | None:
    """One line when the target has linear-attention layers and a kernel they need is missing, else None."""
    layers = linear_attention_layers(config)
    missing = missing_kernels() if layers else []
    if not missing:
        return None
    return (
        f"the target has {layers} linear-attention (Gated DeltaNet) layers but {' and '.join(missing)} "
        f"{'is' if len(missing) == 1 else 'are'} not installed: transformers falls back to a Python loop "
        f"(~700 small kernels per layer per forward) and the target threads fight over the GIL; {INSTALL_HINT}"
    )


__all__ = [
    "INSTALL_HINT",
    "KERNELS",
    "LINEAR_ATTENTION",
    "linear_attention_layers",
    "missing_kernels",
    "missing_kernels_warning",
]
