"""The keys of a drafter's config.json: each one we read, what it means, which engines honour it, since when.

A drafter folder reaches us from outside (``drafter.init_from``, ``dflash eval --drafter``) and leaves through
``dflash export``. A key we kept but did not implement would make the engines compute other logits than our
training, tau and export: so ``check`` walks the WHOLE config.json against ``KEYS`` and refuses, in one line
naming the key and the engines that honour it, every key whose value changes what the drafter computes and
that we do not implement. Keys that change nothing we compute (ids, versions, metadata) pass; so does a refused
key at its neutral value (``logit_scale: 1.0``). A key in no row is refused too: an engine may read it.

Engine facts were read from the wheels: vLLM 0.34.0 (``vllm/model_executor/models/qwen3_dflash.py``,
``qwen3_dflash2.py``, ``vllm/model_executor/layers/logits_processor.py``), SGLang 0.5.23
(``sglang/srt/speculative/dflash_utils.py`` ``parse_dflash_draft_config``, ``sglang/srt/models/dflash.py``);
"since" names the oldest release the rule was read in (vLLM 0.33.0 and SGLang 0.5.23: ``serving-2.md``).
"""

from __future__ import annotations

import dataclasses
import json
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.errors import InputError
from dflash.model.contract import ContractError

__all__ = ["IMPLEMENTED", "INERT", "KEYS", "REFUSED", "Key", "check", "check_folder", "refusal"]

IMPLEMENTED = "implemented"  # changes what the drafter computes, and we compute it as the engines do
INERT = "inert"  # changes nothing the drafter computes (ids, versions, metadata, training-time-only init)
REFUSED = "refused"  # changes what the drafter computes and we do not implement it: refused off its neutral value

VLLM = "vLLM"
SGLANG = "SGLang"
Z = "z-lab"
ALL = f"{VLLM}, {SGLANG}, {Z}"

# A rule beyond "neutral values pass": (the key's value, the whole config.json) -> why it is refused, or None.
Rule = t.Callable[[t.Any, t.Mapping[str, t.Any]], "str | None"]


@dataclasses.dataclass(frozen=True)
class Key:
    """One config.json key: ``name`` dotted (``dflash_config.causal``); ``where`` the code that reads it;
    ``engines`` those that honour it; ``neutral`` the values at which a refused key computes nothing."""

    name: str
    status: str
    meaning: str
    where: str
    engines: str
    since: str
    neutral: tuple[t.Any, ...] = ()
    rule: Rule | None = None


def _layer_types(data: t.Mapping[str, t.Any]) -> list[str]:
    return [str(x) for x in data.get("layer_types") or []]


def _causal_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    """vLLM ``_dflash_layer_causal``: top-level ``is_causal`` wins, else ``dflash_config.causal`` sets every
    layer; our layers are sliding -> causal, full -> non-causal, so only a value that says the same passes."""
    if value is None or data.get("is_causal") is not None:
        return None  # is_causal decides in every engine (the drafter's own check reads it)
    types = _layer_types(data)
    other = [i for i, kind in enumerate(types) if (kind == "sliding_attention") != bool(value)]
    if not other:
        return None
    return f"makes layer {other[0]} ({types[other[0]]}) {'causal' if value else 'non-causal'}"


def _use_swa_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    """vLLM ``_resolve_layer_attention``: ``use_swa`` makes every layer sliding when ``layer_types`` has none."""
    if not value or "sliding_attention" in _layer_types(data):
        return None
    return "makes every layer a sliding layer (layer_types has none)"


def _swa_window_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    """vLLM and SGLang take ``dflash_config.swa_window_size`` before the top-level ``sliding_window``."""
    if value is None or "sliding_attention" not in _layer_types(data) or value == data.get("sliding_window"):
        return None
    return f"is the window vLLM and SGLang use, but sliding_window {data.get('sliding_window')!r} is ours"


def _same_as(other: str) -> Rule:
    def rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
        path = other.split(".")
        theirs: t.Any = data
        for part in path:
            theirs = theirs.get(part) if isinstance(theirs, t.Mapping) else None
        if value is None or theirs is None or value == theirs:
            return None
        return f"differs from {other} {theirs!r}, which we read"

    return rule


def _aux_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    """vLLM reads ``eagle_aux_hidden_state_layer_ids`` AS IS (the residual ENTERING each layer): it must be
    ``target_layer_ids + 1``, the layers our drafter reads."""
    ids = (data.get("dflash_config") or {}).get("target_layer_ids")
    if value is None or not isinstance(ids, list) or value == [i + 1 for i in ids if isinstance(i, int)]:
        return None
    return f"makes vLLM read target layers {value} (entering), not target_layer_ids {ids} + 1"


def _target_hidden_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    if value is None or value == data.get("hidden_size"):
        return None
    return f"sizes fc from a target width other than hidden_size {data.get('hidden_size')!r}"


def _draft_vocab_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    """An own draft vocabulary is below the target's (``vocab_size``); at ``vocab_size`` it is the target's."""
    vocab = data.get("vocab_size")
    if value is None or value == vocab:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not isinstance(vocab, int) or not 0 < value < vocab:
        return f"is no draft vocabulary below vocab_size {vocab!r}"
    if _dflash2(data):
        return "on a DFlash2 drafter, whose selector reranks the target's vocabulary: not implemented here"
    if data.get("has_own_lm_head") is not True:
        return "without has_own_lm_head true: vLLM would put the target's lm_head in place of the drafter's own"
    return None


def _own_head_rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
    """vLLM keeps a drafter's head only with ``has_own_lm_head: true``, and we own one only for a smaller draft
    vocabulary: true without one (an own full head) and false/absent with one (the target's head would score
    draft ids) are refused."""
    n, vocab = data.get("draft_vocab_size"), data.get("vocab_size")
    smaller = isinstance(n, int) and isinstance(vocab, int) and n < vocab
    if value is not None and not isinstance(value, bool):
        return "is no flag (true or false)"
    if bool(value) == smaller:
        return None
    if smaller:
        return f"with draft_vocab_size {n}: vLLM would put the target's lm_head in place of the drafter's own"
    return "without a smaller draft_vocab_size: an own head over the whole vocabulary is not implemented here"


def _dflash2(data: t.Mapping[str, t.Any]) -> bool:
    return (data.get("dflash_config") or {}).get("selector_rank") is not None


def _for_kind(dflash2: bool, neutral: tuple[t.Any, ...]) -> Rule:
    """A key the engines read for one drafter kind only: off its neutral value on the other kind, refused."""

    def rule(value: t.Any, data: t.Mapping[str, t.Any]) -> str | None:
        if _dflash2(data) == dflash2 or any(value == n and not isinstance(value, bool) for n in neutral):
            return None
        if value is None:
            return None
        kind, other = ("DFlash2", "DFlash") if dflash2 else ("DFlash", "DFlash2")
        return f"on a {other} drafter: the engines read it for {kind} drafters only, so theirs would ignore it"

    return rule


_Q = "vllm/model_executor/models/qwen3_dflash.py"
_Q2 = "vllm/model_executor/models/qwen3_dflash2.py"
_SG = "sglang/srt/speculative/dflash_utils.py parse_dflash_draft_config"
_SGM = "sglang/srt/models/dflash.py"
_Z = "z-lab dflash/model.py DFlashDraftModel"
_TF = "transformers Qwen3Config / PretrainedConfig"
_V33, _V34, _S523 = "vLLM 0.33.0", "vLLM 0.34.0", "SGLang 0.5.23"


def _inert(name: str, meaning: str, where: str = _TF) -> Key:
    return Key(name, INERT, meaning, where, "-", "-")


def _qwen3(name: str, meaning: str) -> Key:
    return Key(name, IMPLEMENTED, meaning, f"{_TF}; {_Q}; {_SGM}", ALL, f"{_V33}; {_S523}")


KEYS: tuple[Key, ...] = (
    # ---- metadata: changes nothing computed ----
    _inert("_name_or_path", "where the folder was loaded from"),
    _inert("architectures", "the model class an engine builds (contract.check refuses a wrong one)", f"{_Q}; {_SGM}"),
    _inert("auto_map", "the remote code transformers loads (dflash.py)"),
    _inert("model_type", "the config class transformers builds (qwen3)"),
    _inert("transformers_version", "the writer's transformers version"),
    _inert("dtype", "the weights' dtype as written (transformers 5)"),
    _inert("torch_dtype", "the weights' dtype as written (transformers 4)"),
    _inert("id2label", "classification labels"),
    _inert("label2id", "classification labels"),
    _inert("problem_type", "classification heads only"),
    _inert("return_dict", "transformers output form"),
    _inert("output_attentions", "transformers output form"),
    _inert("output_hidden_states", "transformers output form"),
    _inert("chunk_size_feed_forward", "transformers feed-forward chunking (same values)"),
    _inert("is_encoder_decoder", "false for every drafter"),
    _inert("use_cache", "generation switch; the drafter's cache is DraftCache"),
    _inert("bos_token_id", "tokenizer ids, not used by the drafter"),
    _inert("eos_token_id", "tokenizer ids, not used by the drafter"),
    _inert("pad_token_id", "tokenizer ids, not used by the drafter"),
    _inert("initializer_range", "the std of a fresh init (a loaded drafter has its weights)"),
    _inert("tie_word_embeddings", "the drafter owns no embedding or lm_head: the target's are used"),
    _inert("dflash_config.mask_token", "the MASK string SGLang cross-checks against the target tokenizer", _SG),
    # ---- Qwen3 layer shape: built by transformers' Qwen3 modules, as in every engine ----
    _qwen3("hidden_size", "the drafter's width"),
    _qwen3("intermediate_size", "the MLP width"),
    _qwen3("num_hidden_layers", "the drafter's layers"),
    _qwen3("num_attention_heads", "query heads"),
    _qwen3("num_key_value_heads", "key/value heads"),
    _qwen3("head_dim", "per-head width"),
    _qwen3("hidden_act", "the MLP activation"),
    _qwen3("rms_norm_eps", "RMSNorm epsilon"),
    _qwen3("attention_bias", "q/k/v/o biases"),
    _qwen3("max_position_embeddings", "RoPE cache length"),
    _qwen3("rope_parameters", "RoPE type and base (transformers 5)"),
    _qwen3("rope_scaling", "RoPE scaling (transformers 4)"),
    _qwen3("rope_theta", "RoPE base (transformers 4)"),
    _qwen3("vocab_size", "the vocabulary the MASK id and DFlash2 codebooks index"),
    _qwen3("layer_types", "full_attention (non-causal) or sliding_attention (causal window) per layer"),
    _qwen3("sliding_window", "the sliding layers' window"),
    _qwen3("use_sliding_window", "Qwen3's switch for sliding layers (layer_types decides)"),
    _qwen3("max_window_layers", "Qwen3's sliding-layer count when layer_types is absent (layer_types decides)"),
    Key(
        "attention_dropout",
        REFUSED,
        "dropout on attention probabilities in training",
        _TF,
        "transformers (training)",
        "-",
        neutral=(0, 0.0, None),
    ),
    # ---- DFlash ----
    Key("block_size", IMPLEMENTED, "the block (1 anchor + B-1 drafts)", f"{_Z}; {_SG}", f"{SGLANG}, {Z}", _S523),
    Key("num_target_layers", IMPLEMENTED, "the target's depth (derives target_layer_ids)", _Z, Z, "-"),
    Key(
        "is_causal",
        IMPLEMENTED,
        "every layer's causality (false with sliding layers: a two-sided window; the drafter refuses that)",
        f"{_Q} _dflash_layer_causal; {_SGM} _get_dflash_attention_type",
        ALL,
        f"{_V33}; {_S523}",
    ),
    Key(
        "eagle_aux_hidden_state_layer_ids",
        IMPLEMENTED,
        "target layers vLLM captures (entering each layer): target_layer_ids + 1",
        "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config",
        VLLM,
        _V33,
        rule=_aux_rule,
    ),
    Key(
        "mask_token_id",
        IMPLEMENTED,
        "vLLM's fallback for dflash_config.mask_token_id",
        _Q,
        f"{VLLM}, {SGLANG}",
        _V33,
        rule=_same_as("dflash_config.mask_token_id"),
    ),
    Key(
        "target_hidden_size",
        REFUSED,
        "the target's width fc reads (ours: hidden_size)",
        f"{_Q} _get_dflash_fc_input_size",
        f"{VLLM}, {SGLANG}",
        _V33,
        rule=_target_hidden_rule,
    ),
    Key("is_neox_style", REFUSED, "RoPE's rotate-half layout", _Q, VLLM, _V33, neutral=(True, None)),
    Key(
        "logit_scale",
        IMPLEMENTED,
        "DFlash draft logits x logit_scale (LogitsProcessor scale; DFlashDraftModel.draft_logits)",
        f"{_Q} DFlashQwen3ForCausalLM.__init__ lines 883-896",
        VLLM,
        _V33,
        rule=_for_kind(False, (1, 1.0)),
    ),
    Key(
        "draft_vocab_size",
        IMPLEMENTED,
        "an own, smaller draft vocabulary: lm_head of that many rows, target id = draft id + d2t[draft id]",
        f"{_Q} DFlashQwen3ForCausalLM.__init__, compute_logits, load_weights (lines 874-904, 930-945, 981-1013)",
        f"{VLLM}, speculators",
        _V33,
        rule=_draft_vocab_rule,
    ),
    Key(
        "has_own_lm_head",
        IMPLEMENTED,
        "the drafter keeps its own lm_head (true exactly with a smaller draft_vocab_size)",
        "vllm/v1/worker/gpu/spec_decode/dflash/utils.py load_dflash_model lines 61-71",
        VLLM,
        _V33,
        rule=_own_head_rule,
    ),
    Key(
        "add_swa_attention_sink_bias",
        REFUSED,
        "a learnt attention sink per head",
        f"{_Q} DFlashQwen3DecoderLayer",
        VLLM,
        _V34,
        neutral=(False, None),
    ),
    Key("quantization_config", REFUSED, "quantized drafter weights", "vllm quantization", VLLM, _V33, neutral=(None,)),
    Key("eagle_config", REFUSED, "vLLM merges it under dflash_config", _Q, VLLM, _V33, neutral=(None, {})),
    Key("use_aux_hidden_state", REFUSED, "fc over target features (false: none)", _Q, VLLM, _V33, (True, None)),
    # ---- dflash_config ----
    Key(
        "dflash_config.mask_token_id", IMPLEMENTED, "the MASK row of the target's embedding", f"{_Q}; {_SG}", ALL, _V33
    ),
    Key("dflash_config.target_layer_ids", IMPLEMENTED, "the target layers fc reads", f"{_Q}; {_SG}", ALL, _V33),
    Key(
        "dflash_config.block_size",
        IMPLEMENTED,
        "the block (equal to block_size)",
        _SG,
        SGLANG,
        _S523,
        rule=_same_as("block_size"),
    ),
    Key(
        "dflash_config.num_target_layers",
        IMPLEMENTED,
        "the target's depth",
        _SG,
        SGLANG,
        _S523,
        rule=_same_as("num_target_layers"),
    ),
    *(
        Key(f"dflash_config.{k}", IMPLEMENTED, f"DFlash2 {k}", f"{_Q2}; {_SG}", ALL, f"{_V33}; {_S523}")
        for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    ),
    Key(
        "dflash_config.causal",
        REFUSED,
        "every layer's causality, when is_causal is absent",
        f"{_Q} _dflash_layer_causal",
        VLLM,
        _V33,
        rule=_causal_rule,
    ),
    Key(
        "dflash_config.use_swa",
        REFUSED,
        "every layer sliding",
        f"{_Q} _resolve_layer_attention",
        VLLM,
        _V33,
        rule=_use_swa_rule,
    ),
    Key(
        "dflash_config.swa_window_size",
        REFUSED,
        "the sliding layers' window, before sliding_window",
        f"{_Q} _resolve_layer_attention; {_SG}",
        f"{VLLM}, {SGLANG}",
        _V33,
        rule=_swa_window_rule,
    ),
    Key(
        "dflash_config.attention_sink_bias",
        REFUSED,
        "a learnt attention sink per head",
        f"{_Q} DFlashQwen3DecoderLayer; {_SG}",
        f"{VLLM}, {SGLANG}",
        _S523,
        neutral=(False, None),
    ),
    Key(
        "dflash_config.attention_value_scale",
        REFUSED,
        "a scale on attention values",
        f"{_Q} DFlashQwen3DecoderLayer; {_SG}",
        f"{VLLM}, {SGLANG}",
        _S523,
        neutral=(None,),
    ),
    Key(
        "dflash_config.output_multiplier",
        IMPLEMENTED,
        "DFlash2 candidate logits x output_multiplier, before the softcap (DFlashDraftModel.draft_logits)",
        f"{_Q2} DFlash2Qwen3ForCausalLM lines 553-559; {_SGM} _transform_unary_logits",
        f"{VLLM}, {SGLANG}",
        f"{_V34}; {_S523}",
        rule=_for_kind(True, (1, 1.0)),
    ),
    Key(
        "dflash_config.final_logit_softcapping",
        IMPLEMENTED,
        "DFlash2 candidate logits c*tanh(l/c), 0 none (DFlashDraftModel.draft_logits)",
        f"{_Q2} DFlash2Qwen3ForCausalLM lines 553-559; {_SGM} _transform_unary_logits",
        f"{VLLM}, {SGLANG}",
        f"{_V34}; {_S523}",
        rule=_for_kind(True, (0, 0.0)),
    ),
    Key(
        "dflash_config.input_embedding_scale",
        IMPLEMENTED,
        "DFlash2 block embedding x input_embedding_scale (DFlashDraftModel.forward); SGLang 0.5.23 does not read it",
        f"{_Q2} DFlash2Qwen3Model lines 526-541",
        VLLM,
        _V34,
        rule=_for_kind(True, (1, 1.0)),
    ),
    Key(
        "dflash_config.sample_from_anchor",
        REFUSED,
        "a draft slot at the anchor (vLLM raises for DFlash)",
        f"{_Q}; {_SG}",
        SGLANG,
        _V33,
        neutral=(False, None),
    ),
    Key("dflash_config.use_aux_hidden_state", REFUSED, "fc over target features", _Q, VLLM, _V33, (True, None)),
    *(
        Key(f"dflash_config.{k}", REFUSED, f"SGLang {k}", _SG, SGLANG, _S523, neutral=(None, False))
        for k in (
            "projector_type",
            "shift_label",
            "pure_draft_prefix_len",
            "gru_hidden_dim",
            "emb_dim",
            "use_gemma_norm",
            "partial_rotary_factor",
        )
    ),
)

_BY_NAME = {k.name: k for k in KEYS}
_NESTED = {"dflash_config"}  # walked key by key; rope_parameters and the like are one value


def refusal(data: t.Mapping[str, t.Any]) -> str | None:
    """The one line refusing this config.json, or None when every key is implemented, inert or neutral."""
    for name, value in _walk(data):
        key = _BY_NAME.get(name)
        if key is None:
            return (
                f"{name}: a key no table row covers (dflash/model/config_keys.py): an engine may compute with it "
                "and this drafter would not; remove it or add its row"
            )
        if key.status != REFUSED:
            if key.rule is not None and (why := key.rule(value, data)) is not None:
                return f"{name} = {json.dumps(value)} {why}: {key.engines} read it ({key.where})"
            continue
        why = key.rule(value, data) if key.rule is not None else (None if _neutral(value, key) else "")
        if why is None:
            continue
        return (
            f"{name} = {json.dumps(value)}{' ' + why if why else ''}: {key.meaning}, honoured by {key.engines} "
            f"({key.where}); not implemented here, so training, tau and export would compute other logits"
        )
    return None


def _neutral(value: t.Any, key: Key) -> bool:
    for n in key.neutral:
        if n is None or isinstance(n, bool) or isinstance(value, bool):
            if value is n:  # true is not 1, false is not 0: a flag is neutral only as the flag
                return True
        elif value == n:
            return True
    return False


def _walk(data: t.Mapping[str, t.Any]) -> t.Iterator[tuple[str, t.Any]]:
    for name in sorted(data):
        value = data[name]
        if name in _NESTED and isinstance(value, t.Mapping):
            for inner in sorted(value):
                yield f"{name}.{inner}", value[inner]
        else:
            yield name, value


def check(data: t.Mapping[str, t.Any]) -> None:
    """Raise ``ContractError`` (one line) for a config.json ``refusal`` refuses."""
    line = refusal(data)
    if line is not None:
        raise ContractError(line)


def check_folder(path: str | Path) -> None:
    """``check`` of ``path/config.json``; a folder without a readable one is left to the loader's own error."""
    try:  # the one reader of what a user hands us: bounded, finite, text (a nesting bomb is no traceback)
        data = inputs.read_json(Path(path) / "config.json", "config.json")
    except InputError:
        return
    if isinstance(data, dict):
        check(data)
