"""The serving contract: what vLLM, SGLang and vllm-project/speculators read from a drafter folder.

Every folder this project writes for an engine (a checkpoint's ``config.json`` + ``model.safetensors``,
``dflash export`` in either format) goes through here: ``serving_keys`` adds the keys that make every
engine read the layers the drafter was trained on, ``check`` refuses, in one line, what an engine would
refuse or, worse, silently get wrong. Checkpoint saves and exports call both (``dflash.checkpoint.checkpoints``,
``dflash.serve.export``), so the rules live only here. (``dflash/model/drafter.py`` checks the mask id and the
sliding window of a config it builds too: it is also the served remote code, which cannot import this.)

The rules, with the engine code each one was read from (engine facts: ``../shared/research/serving.md``):

- **Layer ids.** A z-lab ``target_layer_id`` k is the output of target decoder layer k (HF
  ``hidden_states[k + 1]``). vLLM and SGLang capture the residual stream ENTERING a layer, so both read
  layer k + 1: SGLang ``set_dflash_layers_to_capture`` stores ``k + 1`` (python/sglang/srt/models/qwen3.py);
  vLLM ``get_eagle3_aux_layers_from_config`` (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) takes
  ``eagle_aux_hidden_state_layer_ids`` AS IS when present and derives ``k + 1`` itself only since
  vllm-project/vllm PR #40727 (2026-04-23); older builds read one layer early without an error. So
  config.json carries ``eagle_aux_hidden_state_layer_ids = [k + 1 ...]``: right on old and new vLLM alike;
  SGLang does not read it for DFLASH.
- **Block size.** ``dflash_config.block_size`` equals the top-level ``block_size``: SGLang
  (``parse_dflash_draft_config``, python/sglang/srt/speculative/dflash_utils.py) and the speculators
  converter (src/speculators/convert/dflash/converter.py) read either place.
- **MASK id** below the target's vocabulary: SGLang cannot resize the target's embeddings
  (``_resolve_mask_token_id``, python/sglang/srt/speculative/dflash_worker_v2.py); vLLM embeds the block with
  the target's embedding table.
- **Sliding layers need a window**: vLLM ``_resolve_layer_attention``
  (vllm/model_executor/models/qwen3_dflash.py) raises without one; SGLang builds a causal window of
  ``sliding_window - 1`` from it.
- **Weight names** are z-lab's bare names (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ...),
  nothing else: SGLang's ``DFlashDraftModel.load_weights`` (python/sglang/srt/models/dflash.py) skips an
  unknown name SILENTLY and serves that weight's random init; vLLM prepends ``model.`` to each name
  (``DFlashQwen3ForCausalLM.load_weights``) and fails on one it does not know.
- **DFlash2** (``dflash_config`` has ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
  ``selector_top_k``): all four or none (SGLang ``parse_dflash_draft_config`` refuses half a pair, vLLM
  ``qwen3_dflash2.py`` indexes all four), and ``architectures`` ``DFlash2DraftModel`` (vLLM's registry maps it
  to ``DFlash2Qwen3ForCausalLM``, SGLang to its ``DFlash2DraftModel``; under ``DFlashDraftModel`` vLLM would
  refuse the conv/selector weights and SGLang serve without them). Per layer ``attention_conv`` and
  ``mlp_conv`` (``base_kernel`` [2, taps, hidden], ``kernel_projection.weight`` [2 x taps x hidden/group,
  hidden]) and one ``candidate_selector`` (``predecessor_codebook``/``successor_codebook`` [vocab, rank],
  ``hidden_projection.weight`` [rank, hidden]): the names and shapes both engines and speculators build.
- **An own draft vocabulary** (``draft_vocab_size`` N below ``vocab_size``, ``has_own_lm_head: true``):
  ``lm_head.weight`` [N, hidden], ``d2t`` int64 [N] (target id = draft id + ``d2t[draft id]``) and ``t2d`` bool
  [vocab_size], at the top level. vLLM 0.34 ``DFlashQwen3ForCausalLM.load_weights`` (qwen3_dflash.py lines
  981-1013) keeps ``lm_head`` unprefixed, renames ``d2t`` to its int64 ``draft_id_to_target_id`` [N]
  (lines 898-904) and skips ``t2d``; ``load_dflash_model`` (spec_decode/dflash/utils.py lines 62-71) keeps the
  drafter's head only with ``has_own_lm_head: true``, else puts the target's in its place. SGLang 0.5.23 has no
  own draft head for DFLASH (dflash_worker_v2.py ``_DflashDraftSampler``: "it borrows the target lm_head";
  models/dflash.py ``load_weights`` skips the three names): such a drafter is vLLM-only (``sglang_command``).
- **fc** is ``[hidden_size, target_hidden_size x len(target_layer_ids)]``: vLLM sizes it from the aux
  layers (``_get_dflash_fc_input_size``) and raises "DFlash drafter expects N concatenated aux hidden
  features"; SGLang checks the shape on load.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shlex
import typing as t

from dflash.errors import InputError

__all__ = [
    "ATTENTION_BACKEND_PIN",
    "ContractError",
    "Target",
    "check",
    "is_dflash2",
    "serving_keys",
    "sglang_command",
    "vllm_command",
    "vllm_runner_note",
    "vllm_speculators_command",
    "OWN_VOCAB_WEIGHTS",
    "own_vocab",
    "own_vocab_shapes",
    "weight_names",
]

SLIDING_ATTENTION = "sliding_attention"

# Per decoder layer, the names z-lab's DFlashDraftModel has (q/k/v/o biases only with attention_bias).
_LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")
_TOP_WEIGHTS = ("fc.weight", "hidden_norm.weight", "norm.weight")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
_CONV_WEIGHTS = tuple(
    f"{c}.{w}" for c in ("attention_conv", "mlp_conv") for w in ("base_kernel", "kernel_projection.weight")
)
_SELECTOR_WEIGHTS = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "candidate_selector.hidden_projection.weight",
)
# An own draft vocabulary's weights, top-level names as vLLM 0.34 and speculators 0.9.0 write and read them.
OWN_VOCAB_WEIGHTS = ("lm_head.weight", "d2t", "t2d")
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.")


class ContractError(InputError, ValueError):
    """A drafter folder an engine would refuse or serve wrongly: one line naming the key and the engine."""


@dataclasses.dataclass(frozen=True)
class Target:
    """What is known of the target a drafter serves with (None: unknown, the drafter's own config stands in)."""

    vocab_size: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None


def serving_keys(data: dict[str, t.Any]) -> dict[str, t.Any]:
    """``data`` (a config.json dict) with the keys every engine needs to read the trained layers: a copy."""
    out = copy.deepcopy(data)
    dflash = dict(out.get("dflash_config") or {})
    ids = dflash.get("target_layer_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    if isinstance(out.get("block_size"), int):
        # a published config may carry its own (z-lab's Qwen3.5 drafters keep it only here): a different
        # one stays, for ``check`` to refuse, rather than being overwritten without a word
        dflash.setdefault("block_size", out["block_size"])
    out["dflash_config"] = dflash
    return out


def weight_names(data: t.Mapping[str, t.Any]) -> set[str]:
    """The weight names z-lab's DFlashDraftModel has for this config.json (no embedding, no lm_head)."""
    dflash2 = is_dflash2(data)
    per_layer = _LAYER_WEIGHTS + (_BIASES if data.get("attention_bias") else ()) + (_CONV_WEIGHTS if dflash2 else ())
    names = {f"layers.{i}.{w}" for i in range(int(data.get("num_hidden_layers") or 0)) for w in per_layer}
    own = set(OWN_VOCAB_WEIGHTS) if own_vocab(data) else set()
    return names | set(_TOP_WEIGHTS) | (set(_SELECTOR_WEIGHTS) if dflash2 else set()) | own


def own_vocab(data: t.Mapping[str, t.Any]) -> bool:
    """A config.json whose drafter has its own, smaller draft vocabulary (``draft_vocab_size`` < ``vocab_size``)."""
    n, vocab = data.get("draft_vocab_size"), data.get("vocab_size")
    return isinstance(n, int) and isinstance(vocab, int) and n < vocab


def own_vocab_shapes(data: t.Mapping[str, t.Any], vocab_size: int | None = None) -> dict[str, list[int]]:
    """The shapes vLLM 0.34 builds for an own draft vocabulary's weights (qwen3_dflash.py lines 884-904)."""
    n, hidden = int(data["draft_vocab_size"]), int(data["hidden_size"])
    return {"lm_head.weight": [n, hidden], "d2t": [n], "t2d": [int(vocab_size or data["vocab_size"])]}


def is_dflash2(data: t.Mapping[str, t.Any]) -> bool:
    """A DFlash2 config.json: ``dflash_config`` carries the selector (``check`` refuses half the keys)."""
    return (data.get("dflash_config") or {}).get("selector_rank") is not None


def _check_dflash2(data: t.Mapping[str, t.Any], shapes: t.Mapping[str, t.Sequence[int]], vocab: t.Any) -> None:
    dflash = data.get("dflash_config") or {}
    present = [k for k in DFLASH2_KEYS if dflash.get(k) is not None]
    archs = list(data.get("architectures") or [])
    if not present:
        if DFLASH2_ARCHITECTURE in archs:
            raise ContractError(
                f"architectures {archs} names DFlash2 but dflash_config has none of {', '.join(DFLASH2_KEYS)}: "
                "vLLM's DFlash2 model and SGLang's read them there"
            )
        return
    if len(present) < len(DFLASH2_KEYS):
        missing = [k for k in DFLASH2_KEYS if k not in present]
        raise ContractError(
            f"dflash_config has {present} but not {missing}: SGLang refuses half a DFlash2 config, vLLM needs all four"
        )
    for k in DFLASH2_KEYS:
        v = dflash[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ContractError(f"dflash_config.{k}: expected a positive integer, got {v!r}")
    if archs != [DFLASH2_ARCHITECTURE]:
        raise ContractError(
            f"architectures {archs} with DFlash2 weights: vLLM loads {DFLASH2_ARCHITECTURE} only under that name "
            "(DFlashDraftModel refuses the conv/selector weights) and SGLang's DFlashDraftModel drops them"
        )
    hidden, taps, group = data.get("hidden_size"), dflash["conv_kernel_size"], dflash["conv_group_size"]
    rank, top_k = dflash["selector_rank"], dflash["selector_top_k"]
    if isinstance(hidden, int) and hidden % group:
        raise ContractError(
            f"dflash_config.conv_group_size {group} does not divide hidden_size {hidden}: both engines refuse it"
        )
    if isinstance(vocab, int) and top_k > vocab:
        raise ContractError(f"dflash_config.selector_top_k {top_k} exceeds the vocabulary size {vocab}")
    if not isinstance(hidden, int):
        return
    want: dict[str, list[int]] = {}
    for i in range(int(data.get("num_hidden_layers") or 0)):
        for conv in ("attention_conv", "mlp_conv"):
            want[f"layers.{i}.{conv}.base_kernel"] = [2, taps, hidden]
            want[f"layers.{i}.{conv}.kernel_projection.weight"] = [2 * taps * (hidden // group), hidden]
    rows = vocab if isinstance(vocab, int) else None
    for name in _SELECTOR_WEIGHTS[:2]:
        if rows is not None:
            want[name] = [rows, rank]
    want[_SELECTOR_WEIGHTS[2]] = [rank, hidden]
    for name, shape in want.items():
        got = list(shapes.get(name, shape))
        if got != shape:
            raise ContractError(
                f"{name} is {got}, not {shape} (from dflash_config's DFlash2 keys, hidden_size and the vocabulary): "
                "vLLM and SGLang build it at that shape and refuse the checkpoint"
            )


def _first(names: t.Iterable[str], limit: int = 3) -> str:
    ordered = sorted(names, key=lambda n: (int(m.group(1)) if (m := _LAYER_NAME.match(n)) else -1, n))
    more = f" (+{len(ordered) - limit} more)" if len(ordered) > limit else ""
    return ", ".join(ordered[:limit]) + more


def check(
    data: t.Mapping[str, t.Any],
    shapes: t.Mapping[str, t.Sequence[int]],
    *,
    target: Target | None = None,
) -> None:
    """Refuse (``ContractError``, one line) a folder an engine would refuse or get wrong.

    ``data``: the config.json dict as written; ``shapes``: every weight's name and shape as written;
    ``target``: the target's facts where known (the run's target), else the drafter's config stands in.
    """
    target = target or Target()
    dflash = data.get("dflash_config") or {}
    vocab = target.vocab_size if target.vocab_size is not None else data.get("vocab_size")
    mask = dflash.get("mask_token_id", data.get("mask_token_id"))
    whose = "the target's" if target.vocab_size is not None else "the drafter's"
    if isinstance(mask, bool) or not isinstance(mask, int) or mask < 0:
        raise ContractError(f"dflash_config.mask_token_id: expected a token id, got {mask!r}")
    if isinstance(vocab, int) and mask >= vocab:
        raise ContractError(
            f"dflash_config.mask_token_id {mask} is not below {whose} vocabulary size {vocab}: SGLang cannot "
            "resize the target's embeddings and vLLM embeds the MASK row with them"
        )

    layer_types = list(data.get("layer_types") or [])
    window = data.get("sliding_window")
    if SLIDING_ATTENTION in layer_types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        i = layer_types.index(SLIDING_ATTENTION)
        raise ContractError(
            f"layer_types[{i}] is sliding_attention but sliding_window is {window!r}: vLLM refuses a sliding "
            "layer without a window and SGLang builds its causal window from it"
        )

    if data.get("block_size") != dflash.get("block_size", data.get("block_size")):
        raise ContractError(
            f"dflash_config.block_size {dflash.get('block_size')} differs from block_size {data.get('block_size')}: "
            "SGLang and the speculators converter read either one"
        )

    _check_dflash2(data, shapes, vocab)
    expected = weight_names(data)
    unknown = set(shapes) - expected
    if unknown:
        raise ContractError(
            f"weights outside z-lab's DFlashDraftModel names: {_first(unknown)}: SGLang skips them silently "
            "(serving random weights in their place) and vLLM refuses them"
        )
    missing = expected - set(shapes)
    if missing:
        raise ContractError(f"weights missing: {_first(missing)}: an engine would serve them uninitialised")

    if own_vocab(data):
        if data.get("has_own_lm_head") is not True:
            raise ContractError(
                f"draft_vocab_size {data['draft_vocab_size']} without has_own_lm_head true: vLLM's "
                "load_dflash_model puts the target's lm_head in place of the drafter's own"
            )
        for name, want in own_vocab_shapes(data, vocab if isinstance(vocab, int) else None).items():
            if list(shapes[name]) != want:
                raise ContractError(f"{name} is {list(shapes[name])}, not {want}: vLLM's loader refuses it")
    ids = dflash.get("target_layer_ids")
    hidden = data.get("hidden_size")
    target_hidden = target.hidden_size or data.get("target_hidden_size") or hidden
    if isinstance(ids, list) and isinstance(hidden, int) and isinstance(target_hidden, int):
        want = [hidden, target_hidden * len(ids)]
        got = list(shapes["fc.weight"])
        if got != want:
            raise ContractError(
                f"fc.weight is {got}, not [hidden_size {hidden}, target_hidden_size {target_hidden} x "
                f"{len(ids)} target layers]: vLLM and SGLang size fc from target_layer_ids and refuse it"
            )
    if isinstance(ids, list) and target.num_layers is not None:
        bad = [i for i in ids if not 0 <= i < target.num_layers]
        if bad:
            raise ContractError(
                f"dflash_config.target_layer_ids {ids}: {bad} outside the target's {target.num_layers} layers"
            )


# ---- how to start them ---------------------------------------------------------------------


def vllm_command(
    *, target: str, drafter: str, block_size: int, layer_types: t.Sequence[str] = (), dflash2: bool = False
) -> str:
    """``vllm serve`` for a z-lab folder, as vLLM 0.33 and 0.34 take it. ``"method": "dflash"`` is named unless
    the drafter's path says "dflash" (vLLM detects it then: vllm/config/speculative.py);
    num_speculative_tokens = block_size - 1.

    No ``--attention-backend``: since vllm-project/vllm PR #39930 it sets the TARGET's backend only, and the
    drafter's is chosen in 0.34's ``load_dflash_model`` (vllm/v1/worker/gpu/spec_decode/dflash/utils.py:
    ``backend=speculative_config.attention_backend``, ``use_non_causal=dflash_has_any_non_causal(...)``): a
    pin belongs in the speculative config (``ATTENTION_BACKEND_PIN``). No ``VLLM_USE_V2_MODEL_RUNNER``: 0.34
    removed the V1 runner (``validate_environ`` in vllm/platforms/interface.py stops the server at ``=0`` and
    calls ``=1`` redundant) and 0.33 chose V2 by default; ``vllm_runner_note`` says when a build before 0.33
    needs ``=1``. ``layer_types`` and ``dflash2`` are kept for that note's callers."""
    spec: dict[str, t.Any] = {"method": "dflash", "model": drafter, "num_speculative_tokens": block_size - 1}
    if "dflash" in drafter.lower():
        del spec["method"]
    return f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(spec))}"


def vllm_runner_note(*, layer_types: t.Sequence[str] = (), dflash2: bool = False) -> str | None:
    """The one sentence a card adds for a drafter only vLLM's V2 model runner serves (mixed sliding/full layers:
    qwen3_dflash.py refused them on V1; DFlash2: its speculator exists on V2 only), else None."""
    why = "mixes sliding and full layers" if len(set(layer_types)) > 1 else "is DFlash2" if dflash2 else None
    if why is None:
        return None
    return (
        f"This drafter {why}: only vLLM's V2 model runner serves it. vLLM 0.33 picks V2 by default and 0.34 has "
        "no other (there `VLLM_USE_V2_MODEL_RUNNER=0` stops the server at start-up); on a build before 0.33 put "
        "`VLLM_USE_V2_MODEL_RUNNER=1` in front of the command."
    )


# Where a drafter backend must be pinned (a build before PR #48167 on Blackwell, where FlashInfer's
# non-causal draft attention gave near-zero acceptance): inside --speculative-config, which reaches the
# drafter (vllm/config/speculative.py ``_parse_attention_backend``, case-insensitive).
ATTENTION_BACKEND_PIN = '"attention_backend": "FLASH_ATTN"'


def vllm_speculators_command(*, drafter: str) -> str:
    """``vllm serve`` for a speculators folder: its config names the target (the verifier) and the tokens."""
    return f"vllm serve {shlex.quote(drafter)}"


def sglang_command(*, target: str, drafter: str, block_size: int, own_vocab: bool = False) -> str | None:
    """SGLang's DFLASH flags (python/sglang/srt/server_args.py); --speculative-num-draft-tokens is the block.
    None for a drafter with an own draft vocabulary: SGLang 0.5.23 would draft with the target's lm_head."""
    if own_vocab:
        return None
    return (
        f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
        f"--speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-draft-tokens {block_size}"
    )
