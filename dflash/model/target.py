"""The frozen target LLM: the hidden-state features a DFlash drafter is conditioned on, and its head.

A target replica lives on one device and is never trained. For a batch of token ids it returns the
outputs of the chosen decoder layers, concatenated in layer order (``features``). These are exactly
what z-lab's serving code reads as ``hidden_states[id + 1]`` with transformers' ``output_hidden_states``:
the output of decoder layer ``id``, before the final norm. We capture them with forward hooks on the
base model instead, so that no logits (``[S, vocab]``, 2 GB for a 4K-token sample of a 248K vocab) and
no unused hidden states are materialised, and the forward stops after the last layer we need.

The target's embedding and lm_head are shared with the drafter but never owned or saved by it:
``head()`` gives a small frozen ``TargetHead`` that a drafter replica holds on its own device.

Shape legend: B batch, S sequence, H target hidden size, n number of feature layers, V vocabulary.
"""

from __future__ import annotations

import inspect
import logging
import typing as t
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

if t.TYPE_CHECKING:
    from dflash.config import TinyTargetConfig

from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from dflash.errors import DflashError

__all__ = [
    "TargetHead",
    "TargetModel",
    "build_target_layer_ids",
    "default_mask_token_id",
    "tiny_target_config",
    "tiny_target_config_of",
]

logger = logging.getLogger("dflash.target")  # the name train.log has always shown

# z-lab's published drafters use 5 layers; features default to that many target layers.
DEFAULT_NUM_DRAFT_LAYERS = 5


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The target layers a drafter of ``num_draft_layers`` layers reads by default (z-lab's rule).

    One draft layer reads the middle layer ``L // 2``. Otherwise ids are evenly spaced from 1 to
    ``L - 3``: ``round(1 + i * (L - 4) / (n - 1))``; e.g. 36 layers, 5 -> [1, 9, 17, 25, 33].
    """
    if not isinstance(num_target_layers, int) or not isinstance(num_draft_layers, int):
        raise TypeError(
            f"num_target_layers and num_draft_layers must be integers, got "
            f"{num_target_layers!r} and {num_draft_layers!r}"
        )
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers: must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        if num_target_layers < 2:
            raise ValueError(f"num_target_layers: must be >= 2, got {num_target_layers}")
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"num_target_layers: must be >= 4 to space {num_draft_layers} feature layers over 1..L-3, "
            f"got {num_target_layers}"
        )
    start, end = 1, num_target_layers - 3
    span = end - start
    # Python's round() is round-half-even, the same as z-lab's int(round(...)).
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def default_mask_token_id(vocab_size: int, tokenizer_size: int | None = None) -> int:
    """The MASK id for a target whose embedding has ``vocab_size`` rows: the last row.

    The row must exist in the target's embedding (the drafter embeds MASK with it) and must not be a
    real token (its embedding stays untrained). Qwen3 pads its 151,669 tokens to 151,936 rows, so the
    last row is free; ``tokenizer_size`` (the tokens in use) checks that.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size: must be >= 2, got {vocab_size}")
    if tokenizer_size is not None and tokenizer_size >= vocab_size:
        raise ValueError(
            f"the target vocabulary has no unused row for MASK: tokenizer has {tokenizer_size} tokens and the "
            f"embedding {vocab_size} rows; give drafter.mask_token_id explicitly"
        )
    return vocab_size - 1


def tiny_target_config(
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_hidden_layers: int = 8,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    **overrides: t.Any,
) -> Qwen3Config:
    """A small Qwen3 config for tests and the CPU demo (random init, nothing downloaded)."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        **overrides,
    )


class TargetHead(nn.Module):
    """The target's input embedding and lm_head, frozen, for a drafter replica to hold on its own device.

    ``TargetModel.head()`` builds one whose parameters share the target's storage; ``.to(device)``
    then copies them to the drafter's device without touching the target.
    """

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.requires_grad_(False)
        self.eval()

    @property
    def vocab_size(self) -> int:
        return self.embed_tokens.weight.shape[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The raw embedding row, as z-lab's serving code looks it up (no family-specific scaling).
        return F.embedding(input_ids, self.embed_tokens.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def tiny_target_config_of(tiny: TinyTargetConfig) -> Qwen3Config:
    """``[target.tiny]`` of a run config -> the Qwen3 config of that random-init target (train and regen)."""
    return tiny_target_config(
        vocab_size=tiny.vocab_size,
        hidden_size=tiny.hidden_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        head_dim=tiny.head_dim,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        initializer_range=tiny.initializer_range,
    )


def _decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (plain, or multimodal with a ``language_model``)."""
    base = getattr(lm, "model", None)
    for candidate in (base, getattr(base, "language_model", None), getattr(lm, "language_model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
        inner_layers = getattr(getattr(candidate, "model", None), "layers", None)
        if isinstance(inner_layers, nn.ModuleList):
            return inner_layers
    raise TypeError(f"cannot find the decoder layers of {type(lm).__name__} (looked for model.layers)")


def _cache_kwarg(lm: nn.Module) -> str:
    """transformers 5.x renames ``past_key_values`` to ``cache``; pass whichever this version takes."""
    params = inspect.signature(lm.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class _StopForward(DflashError):
    """Raised by the last feature hook: the layers after it are not needed (caught by ``features``)."""


class TargetModel:
    """A frozen causal LM that produces DFlash features. One replica per device, used by one thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = DEFAULT_NUM_DRAFT_LAYERS,
    ) -> None:
        model.requires_grad_(False)
        model.eval()
        self.model = model
        self.config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layers = _decoder_layers(model)
        self.num_layers = len(self.layers)
        if layer_ids is None:
            layer_ids = build_target_layer_ids(self.num_layers, num_draft_layers)
        self.layer_ids = [int(i) for i in layer_ids]
        self._check_layer_ids(self.layer_ids)
        self._cache_kwarg = _cache_kwarg(model)

    def _check_layer_ids(self, layer_ids: list[int]) -> None:
        if not layer_ids:
            raise ValueError("target_layer_ids: must name at least one layer")
        for i in layer_ids:
            # transformers replaces the last entry of hidden_states with the final-normed state, so
            # serving would read a different tensor for layer L-1 than we would train on.
            if not 0 <= i <= self.num_layers - 2:
                raise ValueError(
                    f"target_layer_ids: {i} is out of range for a target of {self.num_layers} layers "
                    f"(allowed 0..{self.num_layers - 2}: features are pre-final-norm layer outputs)"
                )

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: Qwen3Config,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        seed: int = 0,
        layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = DEFAULT_NUM_DRAFT_LAYERS,
    ) -> TargetModel:
        """A random-init target from a config (tests, demo). ``seed`` makes it reproducible."""
        # A private RNG stream: building a target must not move the caller's global RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
        model.to(device=device, dtype=dtype)
        return cls(model, layer_ids=layer_ids, num_draft_layers=num_draft_layers)

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = DEFAULT_NUM_DRAFT_LAYERS,
    ) -> TargetModel:
        """Load a local HF checkpoint (no download: ``local_files_only``) straight onto ``device``.

        Off the CPU, transformers builds the model on the meta device and reads every tensor into its
        place on ``device`` (``device_map``; needs ``accelerate``): a 27B target never passes through
        host RAM (54 GB per replica otherwise, one replica per target GPU).
        """
        dev = torch.device(device)
        placement = {} if dev.type == "cpu" else {"device_map": {"": dev}}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **placement)
        model.to(dev)  # a no-op where it already is
        return cls(model, layer_ids=layer_ids, num_draft_layers=num_draft_layers)

    # ---- facts ----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @property
    def embed_tokens(self) -> nn.Embedding:
        return t.cast(nn.Embedding, self.model.get_input_embeddings())

    @property
    def lm_head(self) -> nn.Linear:
        head = getattr(self.model, "lm_head", None)
        return t.cast(nn.Linear, head if head is not None else self.model.get_output_embeddings())

    def nbytes(self) -> int:
        """Bytes the model's parameters and buffers hold (tied tensors once): what a copy of it needs."""
        seen = {id(p): p.numel() * p.element_size() for p in (*self.model.parameters(), *self.model.buffers())}
        return sum(seen.values())

    def head(self) -> TargetHead:
        """A new frozen TargetHead sharing this target's embedding and lm_head tensors (no copy)."""
        w_embed = self.embed_tokens.weight
        w_head = self.lm_head.weight
        embed = nn.Embedding(w_embed.shape[0], w_embed.shape[1], device="meta")
        embed.weight = nn.Parameter(w_embed.detach(), requires_grad=False)
        lm_head = nn.Linear(w_head.shape[1], w_head.shape[0], bias=self.lm_head.bias is not None, device="meta")
        lm_head.weight = nn.Parameter(w_head.detach(), requires_grad=False)
        if self.lm_head.bias is not None:
            lm_head.bias = nn.Parameter(self.lm_head.bias.detach(), requires_grad=False)
        return TargetHead(embed, lm_head)

    # ---- forward passes -------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: the drafter's fc saves these features for its backward
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, return_final: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[B, S, n*H]``: outputs of ``layer_ids`` (pre-final-norm), concatenated in that order.

        With ``return_final`` also the final-normed last hidden state ``[B, S, H]`` (what lm_head reads).
        """
        captured: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)
        wanted = set(self.layer_ids)

        def hook(index: int) -> t.Callable[..., None]:
            def record(module: nn.Module, args: t.Any, output: t.Any) -> None:
                captured[index] = output[0] if isinstance(output, tuple) else output
                if index == last and not return_final:
                    raise _StopForward

            return record

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in sorted(wanted)]
        final = None
        try:
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            final = out.last_hidden_state
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        feats = torch.cat([captured[i] for i in self.layer_ids], dim=-1)
        if return_final:
            assert final is not None
            return feats, final
        return feats

    def features_from_hidden_states(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """Features from transformers' ``output_hidden_states`` tuple (index ``id + 1``), as z-lab serves."""
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache, *, with_features: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One cached forward (prefill or verify): ``(logits [B, T, V], features [B, T, n*H] or None)``."""
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=with_features,
            **{self._cache_kwarg: cache},
        )
        feats = self.features_from_hidden_states(out.hidden_states) if with_features else None
        return out.logits, feats

    @torch.no_grad()
    def generate_greedy(
        self, input_ids: torch.Tensor, max_new_tokens: int, *, stop_token_ids: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The target's own greedy continuation, one token per forward: ``[1, P + new]`` incl. the prompt.

        Stops after ``max_new_tokens`` or after the first token in ``stop_token_ids`` (kept).
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: expected shape [1, P], got {list(input_ids.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens: must be >= 0, got {max_new_tokens}")
        input_ids = input_ids.to(self.device)
        stops = set(stop_token_ids or ())
        cache = self.new_cache()
        tokens = input_ids
        step_ids = input_ids
        position = 0
        for _ in range(max_new_tokens):
            positions = torch.arange(position, position + step_ids.shape[1], device=self.device)[None]
            logits, _ = self.step(step_ids, positions, cache, with_features=False)
            position += step_ids.shape[1]
            next_id = logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, next_id], dim=1)
            step_ids = next_id
            if int(next_id) in stops:
                break
        return tokens
