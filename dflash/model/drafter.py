"""The DFlash block-diffusion drafter: its config and model, with z-lab's parameter names.

A drafter predicts a whole block in one forward: ``[last verified token, MASK x (B-1)]`` at positions
``anchor + k``. Its layers are Qwen3 decoder layers whose attention takes its queries from the block
only, and its keys/values from ``[context ; block]``: the context is the target's features (outputs of
``n`` target layers, concatenated, ``fc`` to H, ``hidden_norm``), projected by the SAME k_proj/v_proj
as the block, in every layer. RoPE covers ``[context positions ; block positions]``. The target's
embedding and lm_head are used (``TargetHead``) but not owned, so they are not in the state dict; with a
smaller ``draft_vocab_size`` the drafter owns an lm_head over it and the ``d2t``/``t2d`` maps (vLLM's names).

Parameter names and ``config.json`` keys are those of z-lab's ``DFlashDraftModel`` (``dflash/model.py``),
so a checkpoint of ours loads there; the config is a ``Qwen3Config`` (``model_type: qwen3``) with
``block_size``, ``num_target_layers`` and ``dflash_config = {mask_token_id, target_layer_ids}``.

Attention: at inference there is no mask in full layers (the block sees all context and itself) and a
causal + sliding-window mask in ``sliding_attention`` layers. Training passes an explicit mask (dense
bool for SDPA, or a flex_attention ``BlockMask``; see ``dflash.loss``), or a dict of them per layer type.

Shape legend: B batch, C context length, Q block tokens (queries), K keys = C + Q (plus cached),
H hidden, h heads, g kv heads, D head dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import typing as t

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from dflash.model.target import build_target_layer_ids

# This module is also the checkpoints' remote code (dflash/hf_remote), which must load on transformers 4.x
# (z-lab pins 4.57.1) as well as 5.x. 5.0 made configs dataclasses: PreTrainedConfig subclasses get fields
# and __post_init__, checked by huggingface_hub's @strict. 4.x spells it PretrainedConfig, its configs take
# keywords in __init__, and @strict refuses a class that is not a dataclass.
try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig
_DATACLASS_CONFIGS = dataclasses.is_dataclass(Qwen3Config)
if _DATACLASS_CONFIGS:
    from huggingface_hub.dataclasses import strict
else:  # transformers 4.x

    def strict(cls: t.Any) -> t.Any:  # type: ignore[no-redef]
        return cls


try:  # flex_attention is the GPU training path; the dense SDPA path needs nothing optional
    from torch.nn.attention.flex_attention import BlockMask, FlexKernelOptions, flex_attention
except ImportError:  # pragma: no cover - torch without flex attention
    BlockMask = None  # type: ignore[assignment,misc]
    flex_attention = None  # type: ignore[assignment]
    FlexKernelOptions = dict  # type: ignore[misc,assignment]

__all__ = [
    "ARCHITECTURES",
    "DFLASH2_KEYS",
    "BlockConv",
    "CandidateSelector",
    "CompileMissError",
    "DFlashDraftConfig",
    "DFlashDraftModel",
    "DraftCache",
    "draft_config_for",
    "published_mask_token_id",
    "selector_walk",
]

INF = float("inf")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)

# What z-lab's Hub checkpoints carry: AutoModel resolves to dflash.py's DFlashDraftModel (trust_remote_code).
ZLAB_AUTO_MAP = {"AutoModel": "dflash.DFlashDraftModel"}

DFLASH, DFLASH2 = "dflash", "dflash2"
# The drafter kinds' architectures: the names vLLM's registry and SGLang's model classes map to each one.
ARCHITECTURES = {DFLASH: "DFlashDraftModel", DFLASH2: "DFlash2DraftModel"}
# DFlash2's keys inside dflash_config (vLLM qwen3_dflash2.py and SGLang dflash_utils.py read them there).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

AttentionMask = t.Union[torch.Tensor, "BlockMask", None]

# The MASK id published drafters use per target family, keyed by the TEXT config's (model_type, embedding
# rows): Qwen3 the first row past the tokenizer's tokens (SpecForge configs/qwen3-8b-dflash.json, z-lab's
# Qwen3 drafters); the Qwen3.5 family (Qwen3.5, 3.6 and 3.8 share its dense and MoE text configs and its
# 248,320-row vocabulary) 248070 (z-lab's Qwen3.5/3.6 and Qwen3.8-DFlash2 configs). A warm start from a
# published drafter needs the same id: its weights learnt that row's embedding as MASK.
PUBLISHED_MASK_IDS: dict[tuple[str, int], int] = {
    ("qwen3", 151936): 151669,
    ("qwen3_5_text", 248320): 248070,
    ("qwen3_5_moe_text", 248320): 248070,
}


def published_mask_token_id(target_config: t.Any) -> int | None:
    """The MASK id published drafters of this target family use, or None for a family without one."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return PUBLISHED_MASK_IDS.get((str(getattr(text, "model_type", "")), int(getattr(text, "vocab_size", 0) or 0)))


DRAFTER_SIZES = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


@strict
class DFlashDraftConfig(Qwen3Config):
    """A Qwen3 config plus the DFlash keys. ``model_type`` stays ``qwen3`` so z-lab's loader reads it.

    ``dflash_config`` holds ``mask_token_id`` and ``target_layer_ids``; ``layer_types`` (one of
    ``full_attention``/``sliding_attention`` per layer) and ``sliding_window`` choose sliding layers.
    Construction without DFlash keys is allowed (transformers builds default configs to diff against);
    ``DFlashDraftModel`` requires them.
    """

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None

    if _DATACLASS_CONFIGS:

        def __post_init__(self, **kwargs: t.Any) -> None:
            super().__post_init__(**kwargs)
            self._check_dflash_keys()

    else:  # transformers 4.x: a keyword __init__, as its own configs have

        def __init__(
            self,
            block_size: int = 16,
            num_target_layers: int | None = None,
            dflash_config: dict | None = None,
            **kwargs: t.Any,
        ) -> None:
            self.block_size = block_size
            self.num_target_layers = num_target_layers
            self.dflash_config = dflash_config
            super().__init__(**kwargs)
            self._check_dflash_keys()

    def _check_dflash_keys(self) -> None:
        for key in DRAFTER_SIZES:  # a config.json is a user's file: a size of -1 fails here, not in torch
            v = getattr(self, key, None)
            if v is not None and v < 1:
                raise ValueError(f"{key}: must be >= 1, got {v}")
        if self.block_size < 2:
            raise ValueError(f"block_size: must be >= 2, got {self.block_size}")
        layer_types = list(self.layer_types or [])
        if len(layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types: expected {self.num_hidden_layers} entries (num_hidden_layers), got {len(layer_types)}"
            )
        for i, kind in enumerate(layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]: expected one of {list(LAYER_TYPES)}, got {kind!r}")
        if SLIDING_ATTENTION in layer_types and not (isinstance(self.sliding_window, int) and self.sliding_window > 0):
            raise ValueError(
                f"sliding_window: sliding_attention layers need a positive window (and use_sliding_window=true), "
                f"got {self.sliding_window!r}"
            )
        self._check_causal(layer_types)
        self._check_logit_keys()
        own, n = self.__dict__.get("has_own_lm_head"), self.draft_vocab
        if (n < self.vocab_size) != (own is True) or own not in (None, False, True) or not 1 <= n <= self.vocab_size:
            raise ValueError(  # vLLM shares the target's head unless has_own_lm_head: true (dflash/utils.py)
                f"draft_vocab_size {n} with has_own_lm_head {own!r}: expected a draft vocabulary in [1, "
                f"{self.vocab_size}) with has_own_lm_head true, or the target's vocabulary and no own head"
            )
        if n < self.vocab_size and self.kind == DFLASH2:
            raise ValueError("draft_vocab_size: a DFlash2 drafter reranks the target's vocabulary; not supported")
        if self.dflash_config is None:
            return
        self._check_dflash2()
        mask_id = self.dflash_config.get("mask_token_id")
        if mask_id is not None and (
            isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < self.vocab_size
        ):
            raise ValueError(
                f"dflash_config.mask_token_id: expected an integer in [0, {self.vocab_size}), got {mask_id!r}"
            )
        ids = self.dflash_config.get("target_layer_ids")
        if ids is not None:
            if (
                not isinstance(ids, (list, tuple))
                or not ids
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            ):
                raise ValueError(
                    f"dflash_config.target_layer_ids: expected a non-empty list of layer indices, got {ids!r}"
                )
            if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
                raise ValueError(
                    f"dflash_config.target_layer_ids: {max(ids)} is out of range for num_target_layers="
                    f"{self.num_target_layers}"
                )

    def _check_causal(self, layer_types: list[str]) -> None:
        """A published drafter's top-level ``is_causal`` sets every layer's causality (vLLM
        ``_dflash_layer_causal``, SGLang ``_get_dflash_attention_type``, z-lab's reference; ``false`` with
        sliding layers is a two-sided window). These masks are sliding -> causal, full -> non-causal: a
        value that says the same is dropped (never written back), any other is refused, since training or
        decoding it here would use other masks than the drafter learnt."""
        causal = self.__dict__.get("is_causal")
        if causal is None:
            self.__dict__.pop("is_causal", None)
            return
        if not isinstance(causal, bool):
            raise ValueError(f"is_causal: expected true, false or null, got {causal!r}")
        other = [i for i, kind in enumerate(layer_types) if (kind == SLIDING_ATTENTION) != causal]
        if other:
            how = "causal" if causal else "non-causal (a sliding layer: a two-sided window)"
            raise ValueError(
                f"is_causal {str(causal).lower()} makes layer {other[0]} ({layer_types[other[0]]}) {how}, as vLLM, "
                "SGLang and z-lab's reference read it (vLLM _dflash_layer_causal, SGLang _get_dflash_attention_type); "
                "this drafter makes sliding layers causal and full layers non-causal only, so it cannot train or "
                "decode this one with the masks it learnt"
            )
        del self.__dict__["is_causal"]

    def _check_logit_keys(self) -> None:
        """The engines' logit and embedding scales (``DFlashDraftModel.draft_logits``, ``forward``): positive
        finite numbers; a softcap of 0 means none."""
        cfg = self.dflash_config or {}
        keys = {
            "logit_scale": self.__dict__.get("logit_scale"),
            "dflash_config.output_multiplier": cfg.get("output_multiplier"),
            "dflash_config.input_embedding_scale": cfg.get("input_embedding_scale"),
            "dflash_config.final_logit_softcapping": cfg.get("final_logit_softcapping"),
        }
        for key, v in keys.items():
            if v is None:
                continue
            soft = key.endswith("softcapping")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if soft else v > 0) or v == INF:
                raise ValueError(f"{key}: expected a {'non-negative' if soft else 'positive'} number, got {v!r}")

    def _check_dflash2(self) -> None:
        """DFlash2's four keys in ``dflash_config`` (where vLLM's and SGLang's DFlash2 readers look): all or none."""
        cfg = self.dflash_config or {}
        present = [k for k in DFLASH2_KEYS if cfg.get(k) is not None]
        if not present:
            return
        if len(present) != len(DFLASH2_KEYS):
            missing = [k for k in DFLASH2_KEYS if k not in present]
            raise ValueError(f"dflash_config: a DFlash2 drafter needs {', '.join(DFLASH2_KEYS)}; missing {missing}")
        for k in DFLASH2_KEYS:
            v = cfg[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"dflash_config.{k}: expected a positive integer, got {v!r}")
        if self.hidden_size % cfg["conv_group_size"]:
            raise ValueError(
                f"dflash_config.conv_group_size: {cfg['conv_group_size']} does not divide hidden_size {self.hidden_size}"
            )
        if cfg["conv_kernel_size"] > self.block_size:
            raise ValueError(
                f"dflash_config.conv_kernel_size: {cfg['conv_kernel_size']} taps exceed block_size {self.block_size}"
            )
        if cfg["selector_top_k"] > self.vocab_size:
            raise ValueError(
                f"dflash_config.selector_top_k: {cfg['selector_top_k']} exceeds vocab_size {self.vocab_size}"
            )

    @property
    def logit_multiplier(self) -> float:
        """What the engines multiply the lm_head's logits by before drafting: DFlash2's candidates
        ``dflash_config.output_multiplier``, DFlash's draft logits the top-level ``logit_scale``."""
        if self.kind == DFLASH2:
            return float((self.dflash_config or {}).get("output_multiplier") or 1.0)
        return float(self.__dict__.get("logit_scale") or 1.0)

    @property
    def logit_softcap(self) -> float | None:
        """DFlash2's ``dflash_config.final_logit_softcapping`` c (scores ``c * tanh(l / c)``); None: none."""
        cap = float((self.dflash_config or {}).get("final_logit_softcapping") or 0.0) if self.kind == DFLASH2 else 0.0
        return cap if cap > 0 else None

    @property
    def input_embedding_scale(self) -> float:
        """DFlash2's ``dflash_config.input_embedding_scale``: the block's embedding is multiplied by it."""
        if self.kind != DFLASH2:
            return 1.0
        return float((self.dflash_config or {}).get("input_embedding_scale") or 1.0)

    @property
    def draft_vocab(self) -> int:
        """The rows of the drafter's own lm_head (``d2t`` maps them to target ids); the target's vocabulary
        when the drafter has no head of its own and scores with the target's lm_head."""
        n = self.__dict__.get("draft_vocab_size")
        return int(self.vocab_size) if n is None else n if isinstance(n, int) and not isinstance(n, bool) else -1

    @property
    def kind(self) -> str:
        """``dflash2`` when ``dflash_config`` carries the convolution and selector keys, else ``dflash``."""
        return DFLASH2 if (self.dflash_config or {}).get("selector_rank") is not None else DFLASH

    def dflash2_value(self, key: str) -> int:
        return int((self.dflash_config or {})[key])

    @property
    def mask_token_id(self) -> int | None:
        return (self.dflash_config or {}).get("mask_token_id")

    @property
    def target_layer_ids(self) -> list[int] | None:
        ids = (self.dflash_config or {}).get("target_layer_ids")
        if ids is None and self.num_target_layers is not None:
            return build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        return None if ids is None else list(ids)


def draft_config_for(
    target_config: PreTrainedConfig,
    *,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: t.Sequence[int] | None = None,
    layer_types: t.Sequence[str] | None = None,
    sliding_window: int | None = None,
    dflash2: t.Mapping[str, int] | None = None,
    **overrides: t.Any,
) -> DFlashDraftConfig:
    """The drafter config for a target: same width, heads, vocabulary and RoPE base as the target.

    ``dflash2``: the four ``DFLASH2_KEYS`` for a DFlash2 drafter (None: DFlash).
    ``overrides`` set any other Qwen3Config field (e.g. ``intermediate_size``).
    """
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_target_layers = int(text.num_hidden_layers)
    if num_layers < 1:
        raise ValueError(f"num_layers: must be >= 1, got {num_layers}")
    ids = (
        list(target_layer_ids)
        if target_layer_ids is not None
        else build_target_layer_ids(num_target_layers, num_layers)
    )
    types = list(layer_types) if layer_types is not None else [FULL_ATTENTION] * num_layers
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    fields: dict[str, t.Any] = dict(
        vocab_size=int(text.vocab_size),
        hidden_size=int(text.hidden_size),
        intermediate_size=int(text.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=int(text.num_attention_heads),
        num_key_value_heads=int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
        head_dim=int(head_dim),
        hidden_act="silu",
        max_position_embeddings=int(text.max_position_embeddings),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_parameters=_draft_rope(text),
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=types,
        use_sliding_window=SLIDING_ATTENTION in types,
        sliding_window=sliding_window,
        max_window_layers=num_layers,
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={
            "mask_token_id": int(mask_token_id),
            "target_layer_ids": [int(i) for i in ids],
            **({k: int(dflash2[k]) for k in DFLASH2_KEYS} if dflash2 is not None else {}),
        },
        architectures=[ARCHITECTURES[DFLASH2 if dflash2 is not None else DFLASH]],
        auto_map=dict(ZLAB_AUTO_MAP),
    )
    fields.update(overrides)
    return DFlashDraftConfig(**fields)


def _draft_rope(text: t.Any) -> dict[str, t.Any]:
    """The drafter's RoPE: the target's own for a Qwen3 target, else default RoPE on the target's base."""
    rope = dict(getattr(text, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    if getattr(text, "model_type", None) == "qwen3" and rope:
        return rope
    # Other families (e.g. multimodal rope with sections) do not apply to a Qwen3 drafter.
    return {"rope_type": "default", "rope_theta": float(theta)}


class DraftCache:
    """The drafter's KV cache for speculative decoding: post-RoPE keys and values per layer.

    It keeps every position (no sliding eviction), so key index == absolute position and the sliding
    mask stays a function of indices, as in z-lab's serving code. ``crop(n)`` drops the block again.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        if old_k is not None and old_v is not None:
            k = torch.cat([old_k, k], dim=-2)
            v = torch.cat([old_v, v], dim=-2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def get_seq_length(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[-2])

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None and v is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, h, L, D]; cos/sin [B, L, D] for the same L positions.
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def _inference_mask(q_len: int, k_len: int, sliding_window: int, device: torch.device) -> torch.Tensor:
    """Causal + window over key indices, queries being the last ``q_len`` keys (z-lab's sliding layers)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    return ((k_pos <= q_pos) & (q_pos - k_pos < sliding_window))[None, None]


class CompileMissError(RuntimeError):
    """A compiled drafter met a shape its warm-up did not compile (``fail_on_recompile``), or flex
    attention on CUDA would have run unfused (the full score matrix: out of memory at real sizes).

    Not a ``dflash.errors.DflashError``: this module is also the served model's remote code, which imports
    nothing of dflash (``dflash.hf_remote``). It ends a run with its traceback, exit 1, as that root's
    failures do."""


_flex_lock = threading.Lock()
_compiled_flex: t.Callable[..., torch.Tensor] | None = None

# One compiled call at a time, process-wide. Drafter threads calling compiled layers concurrently made
# dynamo's cache lookup miss now and then although the shape was compiled (torch 2.13, aot_eager, 3 CPU
# threads: "Unexpected recompilation: runtime guards failed even though they passed"), which after
# warm-up is a dead drafter, or unfused attention without fail_on_recompile. Held while the compiled
# forward launches its kernels (asynchronous on CUDA); the backward runs outside it.
_compiled_calls = threading.RLock()


def compiled_flex() -> t.Callable[..., torch.Tensor]:
    """flex_attention compiled on its own (inductor: the fused kernel), for layers that are not compiled.

    Built once under a lock; it compiles at its first call, which ``dflash.train.warm_up`` makes before
    any worker thread exists.
    """
    global _compiled_flex
    with _flex_lock:
        if _compiled_flex is None:
            _compiled_flex = t.cast(
                t.Callable[..., torch.Tensor], torch.compile(flex_attention, dynamic=True, fullgraph=True)
            )
        return _compiled_flex


# Every training flex call lowers to flex's main Triton template. Otherwise inductor's CUDA lowering sends a
# batch of one row (a constant) with queries < 128 and a power-of-two GQA ratio to the decode template, whose
# default BLOCK_M = next_pow2(q_len * GQA) leaves it no config once that passes 128 (torch 2.11:
# NoValidChoicesError; 2.14: ValueError): the warm-up's short-query class (q = 112) at GQA 2-8. Shape
# classes are unchanged (the decode test's guards are evaluated first). The CPU lowering ignores BACKEND.
FLEX_KERNEL_OPTIONS: FlexKernelOptions = {"BACKEND": "TRITON"}


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: t.Any, scale: float) -> torch.Tensor:
    """flex_attention: traced into the compiled layer, else the compiled kernel on CUDA, eager on CPU.

    Eager flex is unfused (it materialises ``[B, h, Q, K]`` scores): allowed on CPU, where it runs
    forward only (tests), never on CUDA.
    """
    if flex_attention is None:  # pragma: no cover
        raise RuntimeError("flex_attention is not available in this torch build; use the dense mask")
    gqa, opts = q.shape[1] != k.shape[1], FLEX_KERNEL_OPTIONS
    # Per frame: True only while dynamo traces THIS code. torch.compiler.is_compiling() is process-wide
    # (set while any thread compiles), so a drafter thread would call unfused flex during another's compile.
    if torch.compiler.is_dynamo_compiling():
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=opts)
    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=opts)
    try:
        with _compiled_calls:
            return compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=opts)
    except RuntimeError as e:
        if _RECOMPILE_MARK not in str(e):
            raise
        raise CompileMissError(_miss_line("flex attention", q, e)) from None


# What torch raises when ``set_stance("fail_on_recompile")`` meets a shape nothing was compiled for.
_RECOMPILE_MARK = "stance is 'fail_on_recompile'"


def _miss_line(where: str, x: torch.Tensor, e: BaseException) -> str:
    """One line for a compile miss after warm-up: where, the shape, torch's first guard failure."""
    reasons = [ln.strip()[2:] for ln in str(e).splitlines() if ln.strip().startswith("- ")]
    why = f" ({reasons[0]})" if reasons else ""
    return (
        f"{where}: no compiled code for a batch of shape {list(x.shape)} after warm-up{why}; "
        "a recompile now would run unfused or stall every drafter, so the run stops"
    )


class Qwen3DFlashAttention(nn.Module):
    """Queries from the block; keys/values from ``[context ; block]`` through the same projections."""

    def __init__(self, config: DFlashDraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = int(config.head_dim or config.hidden_size // config.num_attention_heads)
        self.num_heads = config.num_attention_heads
        # Qwen3Config.__post_init__ fills both (num_key_value_heads from num_attention_heads)
        assert config.num_key_value_heads is not None and config.layer_types is not None
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == SLIDING_ATTENTION else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: AttentionMask = None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        b, q_len, _ = hidden_states.shape
        c_len = target_hidden.shape[1]
        q = self.q_norm(self.q_proj(hidden_states).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([target_hidden, hidden_states], dim=1)  # [B, C+Q, H]: one projection for both
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings  # [B, C+Q, D]: context positions then block positions
        q = _apply_rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)

        if attention_mask is None and self.sliding_window is not None:
            attention_mask = _inference_mask(q_len, k.shape[-2], self.sliding_window, q.device)
        if BlockMask is not None and isinstance(attention_mask, BlockMask):
            out = _flex(q, k, v, attention_mask, self.scaling)
        else:
            # A fully masked query row (a padding block) comes out as zeros from SDPA's safe softmax.
            # Here the mask is a dense one or None (a BlockMask went to flex above).
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=t.cast("torch.Tensor | None", attention_mask),
                scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


def block_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, block_size: int, group_size: int
) -> torch.Tensor:
    """DFlash2's grouped dynamic convolution along the block: ``out[k] = sum_t (base[t] + delta[k, t]) * x[k - t]``
    over taps ``t`` with ``k - t`` in the same block (a tap reaching before the block's first slot adds 0).

    ``x`` [..., Q, H] (Q a whole number of blocks, each contiguous), ``delta`` [..., Q, T, G] (one weight
    per tap and group of ``group_size`` channels, from the token itself), ``base`` [T, H] (per channel).
    """
    q_len, hidden = x.shape[-2], x.shape[-1]
    taps = base.shape[0]
    groups = hidden // group_size
    xs = x.unflatten(-1, (groups, group_size))  # [..., Q, G, g]
    coef = base.to(x.dtype).view(taps, groups, group_size) + delta.to(x.dtype)[..., None]  # [..., Q, T, G, g]
    out = coef[..., 0, :, :] * xs
    slot = torch.arange(q_len, device=x.device) % block_size
    for tap in range(1, taps):
        earlier = F.pad(xs, (0, 0, 0, 0, tap, 0))[..., :q_len, :, :]  # x[k - tap] at k (zeros before the start)
        out = out + coef[..., tap, :, :] * earlier * (slot >= tap).to(x.dtype).view(q_len, 1, 1)
    return out.flatten(-2)


class BlockConv(nn.Module):
    """The pair of convolutions around one sublayer (its input and its output), both weighted from the
    sublayer's input by one projection. Starts as the identity (tap 0 = 1, the rest and the projection 0), so a
    new DFlash2 drafter computes what a DFlash one does. Names as speculators, vLLM and SGLang load them:
    ``base_kernel`` [2, T, H] (input side, output side), ``kernel_projection.weight`` [2*T*G, H]."""

    def __init__(self, hidden_size: int, *, block_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.block_size, self.taps, self.group_size = block_size, taps, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's convolved input, and the output side's dynamic weights ``[..., Q, T, G]``."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        conv = block_conv(
            x, delta[..., 0, :, :], self.base_kernel[0], block_size=self.block_size, group_size=self.group_size
        )
        return conv, delta[..., 1, :, :]

    def finish(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(x, delta, self.base_kernel[1], block_size=self.block_size, group_size=self.group_size)


class CandidateSelector(nn.Module):
    """DFlash2's low-rank reranker: slot k's candidates (the lm_head's top-k) get
    ``logit(c) + <P[prev] * W h_k, S[c]>``, ``prev`` the token in slot k-1 (the anchor for slot 1). Names as
    the engines load them: ``predecessor_codebook`` [V, r], ``successor_codebook`` [V, r],
    ``hidden_projection.weight`` [r, H]; all three start normal(0, initializer_range)."""

    def __init__(self, *, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float) -> None:
        for p in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(p, std=std)

    def edge_scores(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``hidden`` [..., H], ``previous`` [...] token ids, ``candidates`` [..., K] -> the pair scores [..., K]."""
        context = self.predecessor_codebook[previous] * self.hidden_projection(
            hidden.to(self.hidden_projection.weight.dtype)
        )
        return (self.successor_codebook[candidates] * context[..., None, :]).sum(-1)


def selector_walk(
    selector: CandidateSelector,
    logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    *,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tokens of one block as vLLM's and SGLang's DFlash2 walk picks them, left to right.

    ``logits`` [B, L, V] (the lm_head on the L predicting slots' hidden [B, L, H]), ``anchor`` [B] the
    verified token. Slot k's candidates are its top-k unary tokens; each scores ``logit + edge`` from the token
    chosen at k-1. Temperature 0 takes the best score; above it one draw from ``softmax(score / T)`` over the K
    candidates. Returns the tokens [B, L] and each slot's draft distribution [B, L, V] (0 off the candidates,
    what the rejection sampler divides by; one-hot when greedy)."""
    top = logits.float().topk(selector.top_k, dim=-1)
    candidates, unary = top.indices, top.values
    batch, steps = candidates.shape[:2]
    previous = anchor.to(candidates.device)
    tokens, dists = [], []
    for k in range(steps):
        scores = unary[:, k] + selector.edge_scores(hidden[:, k], previous, candidates[:, k]).float()
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=-1)
            pick = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            pick = scores.argmax(dim=-1)
            probs = F.one_hot(pick, selector.top_k).float()
        previous = candidates[:, k].gather(-1, pick[:, None]).squeeze(-1)
        tokens.append(previous)
        dists.append(torch.zeros(batch, logits.shape[-1], device=logits.device).scatter(-1, candidates[:, k], probs))
    return torch.stack(tokens, dim=1), torch.stack(dists, dim=1)


class Qwen3DFlashDecoderLayer(nn.Module):
    """Pre-norm attention + residual, pre-norm SiLU-gated MLP + residual (a Qwen3 layer).

    Activation checkpointing is ours, not transformers' ``GradientCheckpointingLayer`` (whose order
    relative to ``Module.compile`` changed between 5.x releases): with ``gradient_checkpointing`` set,
    ``forward`` runs the layer under non-reentrant ``torch.utils.checkpoint``. ``Module.compile``
    compiles ``forward``, so the checkpoint sits INSIDE the compiled region: dynamo records it and
    AOTAutograd recomputes the layer in the compiled backward (torchtitan's AC-then-compile order).
    The other order, checkpoint around a compiled call, reruns the compiled call (and dynamo's cache
    lookup) in the backward: pytorch #166926 and #144035 report crashes there.
    """

    def __init__(self, config: DFlashDraftConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # The attribute name transformers' gradient_checkpointing_enable() sets, so that switch works too.
        self.gradient_checkpointing = False
        self.attention_conv: BlockConv | None = None
        self.mlp_conv: BlockConv | None = None
        if config.kind == DFLASH2:  # DFlash2: a convolution pair around attention and one around the MLP
            conv = dict(
                block_size=int(config.block_size),
                taps=config.dflash2_value("conv_kernel_size"),
                group_size=config.dflash2_value("conv_group_size"),
            )
            self.attention_conv = BlockConv(config.hidden_size, **conv)
            self.mlp_conv = BlockConv(config.hidden_size, **conv)

    def forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: AttentionMask = None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and cache is None and torch.is_grad_enabled():
            return t.cast(
                torch.Tensor,
                checkpoint(
                    self._forward,
                    hidden_states,
                    target_hidden,
                    position_embeddings,
                    attention_mask,
                    use_reentrant=False,
                ),
            )
        return self._forward(hidden_states, target_hidden, position_embeddings, attention_mask, cache)

    def _forward(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: AttentionMask = None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        if self.attention_conv is not None and self.mlp_conv is not None:
            return self._forward_dflash2(hidden_states, target_hidden, position_embeddings, attention_mask, cache)
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), target_hidden, position_embeddings, attention_mask, cache=cache
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    def _forward_dflash2(
        self,
        hidden_states: torch.Tensor,
        target_hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: AttentionMask = None,
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        """The same layer with each sublayer's normed input and its output convolved along the block (the
        target context reaches attention unconvolved, as in the engines: only block queries pass here)."""
        assert self.attention_conv is not None and self.mlp_conv is not None
        x, delta = self.attention_conv.prepare(self.input_layernorm(hidden_states))
        x = self.self_attn(x, target_hidden, position_embeddings, attention_mask, cache=cache)
        hidden_states = hidden_states + self.attention_conv.finish(x, delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.mlp_conv.finish(self.mlp(x), delta)


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The drafter. ``forward`` returns the final-normed block hidden states ``[B, Q, H]``."""

    # Qwen3Config, as z-lab's class has: AutoModel (trust_remote_code) reads config.json as a Qwen3Config
    # (model_type qwen3), and transformers 5.13-5.18 then register this class for that config class, refusing
    # a config_class of another name ("not consistent with the config class you passed"); 4.57, 5.0-5.12 and
    # 5.19+ skip the registration. __init__ turns the Qwen3Config into a DFlashDraftConfig.
    config_class = Qwen3Config
    config: DFlashDraftConfig
    base_model_prefix = ""
    _no_split_modules = ["Qwen3DFlashDecoderLayer"]
    _can_record_outputs: dict[str, t.Any] = {}
    d2t: torch.Tensor  # buffers of an own draft vocabulary (``lm_head`` not None)
    t2d: torch.Tensor

    def __init__(self, config: DFlashDraftConfig) -> None:
        if not isinstance(config, DFlashDraftConfig):
            # AutoModel (trust_remote_code) reads config.json as a plain Qwen3Config (model_type qwen3)
            config = DFlashDraftConfig.from_dict(config.to_dict())
        super().__init__(config)
        target_layer_ids = config.target_layer_ids
        if target_layer_ids is None:
            raise ValueError("dflash_config.target_layer_ids: required (or num_target_layers to derive it)")
        if config.mask_token_id is None:
            raise ValueError("dflash_config.mask_token_id: required")
        self.target_layer_ids = target_layer_ids
        self.block_size = int(config.block_size)
        self.mask_token_id = int(config.mask_token_id)
        self.layers = nn.ModuleList(
            [Qwen3DFlashDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if config.draft_vocab < config.vocab_size:  # an own, smaller head; d2t/t2d as vLLM and speculators
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab, dtype=torch.long))  # target - draft id
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))  # target id in the draft
        self.candidate_selector: CandidateSelector | None = None
        if config.kind == DFLASH2:
            self.candidate_selector = CandidateSelector(
                vocab_size=int(config.vocab_size),
                hidden_size=int(config.hidden_size),
                rank=config.dflash2_value("selector_rank"),
                top_k=config.dflash2_value("selector_top_k"),
            )
        self.post_init()
        # After post_init, which would give the convolutions' Linear a random init: they start as the identity.
        for layer in t.cast(t.Iterable[Qwen3DFlashDecoderLayer], self.layers):
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.reset_parameters()
        if self.candidate_selector is not None:
            self.candidate_selector.reset_parameters(float(getattr(config, "initializer_range", 0.02)))

    @property
    def kind(self) -> str:
        return str(self.config.kind)

    @property
    def layer_types(self) -> list[str]:
        assert self.config.layer_types is not None  # Qwen3Config.__post_init__ fills it
        return list(self.config.layer_types)

    @property
    def sliding_window(self) -> int | None:
        return self.config.sliding_window if SLIDING_ATTENTION in self.layer_types else None

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The scores an engine drafts from, given the target lm_head's ``logits`` of this drafter's hidden
        states: ``logits x logit_multiplier``, then ``c * tanh(l / c)`` with ``c = logit_softcap`` (vLLM 0.34
        qwen3_dflash.py ``LogitsProcessor(scale=logit_scale)``; qwen3_dflash2.py ``candidate_logits_processor``
        and logits_processor.py ``get_top_k_tokens``: scale, then cap; SGLang ``_transform_unary_logits``: the
        same). A drafter without these keys gets ``logits`` itself back, untouched."""
        scale, cap = self.config.logit_multiplier, self.config.logit_softcap
        if scale == 1.0 and cap is None:
            return logits
        out = logits.float() * scale
        return out if cap is None else torch.tanh(out / cap) * cap

    def engine_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """The scores an engine drafts from, over the target's vocabulary: ``draft_logits`` of the target's
        ``lm_head``, or of this drafter's own head scattered to target ids ``i + d2t[i]``, -inf elsewhere
        (vLLM 0.34 qwen3_dflash.py ``compute_logits``)."""
        head = lm_head if self.lm_head is None else self.lm_head
        logits = self.draft_logits(head(hidden.to(t.cast(torch.Tensor, head.weight).dtype)))
        if self.lm_head is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], int(self.config.vocab_size)), -INF)
        full[..., torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t] = logits
        return full

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Non-reentrant activation checkpointing per layer, done by the layers themselves."""
        for layer in t.cast(t.Iterable[Qwen3DFlashDecoderLayer], self.layers):
            layer.gradient_checkpointing = enabled

    def forward(
        self,
        position_ids: torch.Tensor,
        attention_mask: AttentionMask | dict[str, AttentionMask] = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: DraftCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        """Block hidden states.

        ``noise_embedding`` [B, Q, H]: the target's embedding of the block ids. ``target_hidden``
        [B, C, n*H]: target features of the C context positions not yet in ``past_key_values``.
        ``position_ids`` [B, C+Q]: their positions, then the block's. ``attention_mask``: None
        (inference), a mask for every layer, or ``{layer_type: mask}``. ``use_cache`` is accepted for
        z-lab's signature; the cache is used whenever ``past_key_values`` is given.
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("noise_embedding and target_hidden are required")
        expected = self.fc.in_features
        if target_hidden.shape[-1] != expected:
            raise ValueError(
                f"target_hidden: expected {expected} features ({len(self.target_layer_ids)} target layers "
                f"{self.target_layer_ids} x hidden {self.config.hidden_size}), got {target_hidden.shape[-1]}"
            )
        if position_ids.shape[-1] != target_hidden.shape[1] + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids: expected {target_hidden.shape[1]} context + {noise_embedding.shape[1]} block "
                f"positions, got {position_ids.shape[-1]}"
            )
        target_hidden = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        hidden_states = noise_embedding.to(self.fc.weight.dtype)
        if self.config.input_embedding_scale != 1.0:  # DFlash2's: vLLM scales the block's embedding by it
            hidden_states = hidden_states * self.config.input_embedding_scale
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for i, layer in enumerate(t.cast(t.Iterable[Qwen3DFlashDecoderLayer], self.layers)):
            mask = attention_mask[layer.self_attn.layer_type] if isinstance(attention_mask, dict) else attention_mask
            try:
                with _compiled_calls if layer._compiled_call_impl is not None else contextlib.nullcontext():
                    hidden_states = layer(
                        hidden_states, target_hidden, position_embeddings, mask, cache=past_key_values
                    )
            except RuntimeError as e:  # a compiled layer refused to recompile after warm-up: say so in one line
                if _RECOMPILE_MARK not in str(e):
                    raise
                raise CompileMissError(_miss_line(f"drafter layer {i}", hidden_states, e)) from None
        return self.norm(hidden_states)
