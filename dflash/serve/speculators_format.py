"""``dflash export --format speculators``: vllm-project/speculators' DFlash layout, for one-command serving.

A speculators config.json names its verifier (the target), so ``vllm serve FOLDER`` alone starts the
target and the drafter. The layout is the one speculators 0.9.0 writes
(src/speculators/models/dflash/config.py ``DFlashSpeculatorConfig``; its z-lab converter
src/speculators/convert/dflash/converter.py builds it from a z-lab folder), and vLLM reads it in
vllm/transformers_utils/configs/speculators/algos.py ``update_dflash``:

- ``transformer_layer_config``: the z-lab config.json less the keys that are not the Qwen3 layer config
  (``architectures, auto_map, block_size, dflash_config, num_target_layers``), as Qwen3Config serialises it;
- ``aux_hidden_state_layer_ids`` = z-lab ``target_layer_ids`` + 1 (vLLM captures the residual stream
  entering layer k+1; it takes these as its capture ids and ``dflash_config.target_layer_ids = aux - 1``);
- ``mask_token_id``, ``block_size``, ``draft_vocab_size`` (the target's vocabulary, or an own draft
  vocabulary's size: then ``has_own_lm_head`` stays in ``transformer_layer_config``, which vLLM's
  ``update_dflash`` takes as the drafter's config, and ``lm_head.weight``/``d2t``/``t2d`` are in the weights),
  ``target_hidden_size``, ``sample_from_anchor = false`` (the block's first slot is the verified token);
- ``speculators_config``: algorithm ``dflash``, one greedy proposal of ``block_size - 1`` tokens (vLLM's
  default ``num_speculative_tokens``), and ``verifier {name_or_path, architectures}``.

Where this differs from what the converter writes for the same z-lab folder, on purpose:

- ``sliding_window_non_causal``: vLLM turns it into ``dflash_config.causal = not sliding_window_non_causal``
  for EVERY layer (qwen3_dflash.py ``_dflash_layer_causal``: "overrides all layers"), while speculators'
  own model keeps full-attention layers non-causal whatever the flag (models/dflash/attention.py). The
  converter leaves it false, so vLLM would run a drafter's full-attention (non-causal) layers causally.
  Here: true when no layer slides (vLLM: non-causal, as trained; speculators: no sliding layer to
  change), false when every layer slides (causal windows, as trained); a drafter that mixes both is
  refused: no value makes vLLM's reader right for it (the z-lab format is: vLLM reads ``layer_types``).
- ``target_hidden_size``: written (the converter leaves null, which vLLM reads as hidden_size: the same).
- no ``auto_map``/``config.py``: speculators' own code is not shipped; its config class reads the folder.
- A drafter that reads the target's LAST layer is refused: speculators drops that aux id (it treats
  the last layer as the verifier's own output), which leaves ``fc`` one layer too wide.

A DFlash2 drafter (``dflash_config`` with the convolution and selector keys) is written as speculators'
``DFlash2SpeculatorConfig`` (src/speculators/models/dflash2/config.py): ``speculators_model_type`` and the
algorithm ``dflash2``, ``architectures`` ``DFlash2DraftModel``, and ``conv_kernel_size``,
``conv_group_size``, ``selector_rank``, ``selector_top_k`` at the top level, where vLLM's ``update_dflash2``
(algos.py) copies them into ``dflash_config`` for its DFlash2 model.

Weights: the z-lab names as they are (speculators' DFlashDraftModel has the same body; its embedding,
lm_head and verifier norm are rebuilt from the verifier at load and not saved).
"""

from __future__ import annotations

import copy
import typing as t

import transformers
from transformers import Qwen3Config

from dflash.model.contract import DFLASH2_ARCHITECTURE, DFLASH2_KEYS, ContractError, is_dflash2

__all__ = ["LAYOUT_VERSION", "NON_TRANSFORMER_KEYS", "speculators_config"]

# The speculators release whose layout this writes and whose config class and converter the tests run.
LAYOUT_VERSION = "0.9.0"
# config.json keys that are not the drafter's Qwen3 layer config (the converter's _NON_TRANSFORMER_KEYS)
NON_TRANSFORMER_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers"})
_SLIDING = "sliding_attention"


def speculators_config(
    zlab: t.Mapping[str, t.Any],
    *,
    verifier: str,
    verifier_architectures: t.Sequence[str],
    num_verifier_layers: int | None,
) -> dict[str, t.Any]:
    """The speculators config.json dict for a z-lab config.json dict (``ContractError`` when it cannot be)."""
    dflash = dict(zlab.get("dflash_config") or {})
    ids = list(dflash.get("target_layer_ids") or [])
    block = int(zlab["block_size"])
    if num_verifier_layers is not None and num_verifier_layers - 1 in ids:
        raise ContractError(
            f"--format speculators: target_layer_ids {ids} read the target's last layer ({num_verifier_layers - 1}); "
            "speculators takes that one as the verifier's own output and drops it, leaving fc too wide: "
            "export the z-lab format (the default)"
        )
    types = list(zlab.get("layer_types") or [])
    sliding = [k == _SLIDING for k in types]
    if any(sliding) and not all(sliding):
        raise ContractError(
            f"--format speculators: layer_types {types} mix sliding and full attention; vLLM's speculators "
            "reader sets one causal flag for every layer (dflash_config.causal = not "
            "sliding_window_non_causal), so no value serves this drafter right: export the z-lab format "
            "(the default), whose layer_types vLLM reads per layer"
        )
    scales = {
        "logit_scale": (zlab.get("logit_scale"), 1.0),
        "dflash_config.output_multiplier": (dflash.get("output_multiplier"), 1.0),
        "dflash_config.final_logit_softcapping": (dflash.get("final_logit_softcapping"), 0.0),
        "dflash_config.input_embedding_scale": (dflash.get("input_embedding_scale"), 1.0),
    }
    for key, (value, neutral) in scales.items():
        if value is not None and value != neutral:
            raise ContractError(
                f"--format speculators: {key} = {value}: the speculators layout has no such key, so vLLM would draft "
                "from other logits than this drafter's: export the z-lab format (the default)"
            )
    layer = {k: copy.deepcopy(v) for k, v in zlab.items() if k not in NON_TRANSFORMER_KEYS}
    layer_config = Qwen3Config(**layer).to_diff_dict()
    layer_config.pop("transformers_version", None)
    kind = "dflash2" if is_dflash2(zlab) else "dflash"
    out = {
        "architectures": [DFLASH2_ARCHITECTURE if kind == "dflash2" else "DFlashDraftModel"],
        "aux_hidden_state_layer_ids": [i + 1 for i in ids],
        "block_size": block,
        "draft_vocab_size": int(zlab.get("draft_vocab_size") or zlab["vocab_size"]),
        "dtype": zlab.get("dtype"),
        "mask_token_id": dflash.get("mask_token_id"),
        "sample_from_anchor": False,
        "sliding_window_non_causal": not any(sliding),
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": block - 1,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"architectures": list(verifier_architectures), "name_or_path": verifier},
        },
        "speculators_model_type": kind,
        "speculators_version": LAYOUT_VERSION,
        "target_hidden_size": int(zlab["hidden_size"]),
        "tie_word_embeddings": False,
        "transformer_layer_config": layer_config,
        "transformers_version": transformers.__version__,
    }
    if kind == "dflash2":
        out.update({k: int(dflash[k]) for k in DFLASH2_KEYS})
    return out
