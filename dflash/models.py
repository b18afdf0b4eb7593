"""The models a ``RunConfig`` describes, built one way for training and for ``dflash eval``.

- ``load_target``: the frozen target on a device (``target.tiny`` built from the config, else the checkpoint
  at ``target.path``), reading the layers the drafter reads;
- ``drafter_spec``: what the run's drafter is, given its target: the MASK id (the rule below), the drafter
  config, the warm start of ``drafter.init_from`` (checked against the run) and the tokenizer the data is
  rendered with;
- ``initial_drafter``: the drafter at step 0 (a seeded init, or the warm start's weights).

The MASK id: ``drafter.mask_token_id`` when set (inside the target vocabulary); with ``drafter.init_from``,
the id that drafter was trained with; else the id published drafters of the target's family use
(``drafter.PUBLISHED_MASK_IDS``: Qwen3's 151,936-row vocabulary -> 151669), when the tokenizer leaves that
row unused; else the last row of the target's embedding (``target.default_mask_token_id``).

Sliding layers: ``drafter.layer_types`` and ``drafter.sliding_window`` go into the drafter config as the
config.json keys the engines read (``layer_types``, ``sliding_window``; ``dflash.model.contract`` checks
them on every save and export). With ``drafter.init_from`` the warm start's own are kept, and a key set to
other values than the warm start's is refused in one line: its weights learnt under those masks.

So ``dflash eval --untrained --config RUN.toml`` measures exactly the drafter ``dflash train`` starts from.
"""

from __future__ import annotations

import dataclasses
import logging
import typing as t
from pathlib import Path

import torch

from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.manifest import CheckpointError
from dflash.config import ConfigError, DrafterConfig, RunConfig
from dflash.data.chat import load_tokenizer
from dflash.dtypes import torch_dtype
from dflash.errors import DataError
from dflash.model import config_keys
from dflash.model.contract import ContractError
from dflash.model.drafter import (
    DFLASH2_KEYS,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    DFlashDraftConfig,
    DFlashDraftModel,
    draft_config_for,
    published_mask_token_id,
)
from dflash.model.target import TargetModel, default_mask_token_id, tiny_target_config_of

# The run's log lines keep the name they had in train.py (dflash.train: what train.log has always shown).
logger = logging.getLogger("dflash.train")


def load_target(
    cfg: RunConfig, device: str, *, path: str | None = None, layer_ids: t.Sequence[int] | None = None
) -> TargetModel:
    """The run's target on ``device``, in ``target.dtype``: ``[target.tiny]`` built from the config, else the
    checkpoint at ``target.path`` (``path`` instead: eval's ``--target``). ``layer_ids``: the target layers
    a trained drafter reads (default: ``drafter.target_layer_ids``, else chosen for ``drafter.layers``).
    Loading errors come as transformers raises them (OSError, ValueError): the caller names its key."""
    dtype = torch_dtype(cfg.target.dtype)
    ids = layer_ids if layer_ids is not None else cfg.drafter.target_layer_ids
    if path is None and cfg.target.tiny is not None:
        tiny = cfg.target.tiny
        return TargetModel.from_config(
            tiny_target_config_of(tiny),
            dtype=dtype,
            device=device,
            seed=tiny.seed,
            layer_ids=ids,
            num_draft_layers=cfg.drafter.layers,
        )
    where = path or cfg.target.path
    assert where is not None  # parse_config: exactly one of target.path and [target.tiny]
    return TargetModel.from_pretrained(
        where, dtype=dtype, device=device, layer_ids=ids, num_draft_layers=cfg.drafter.layers
    )


@dataclasses.dataclass(frozen=True)
class DrafterSpec:
    """What a run's drafter is: its config (the MASK id and target layers in it), the warm start
    (``drafter.init_from``, else None) and the tokenizer the run's data is rendered with (None: none)."""

    config: DFlashDraftConfig
    mask_token_id: int
    init: DFlashDraftModel | None
    tokenizer: t.Any


def drafter_spec(cfg: RunConfig, target: TargetModel) -> DrafterSpec:
    """The MASK id and drafter config a run with this config and target trains (``ConfigError``: one line)."""
    tokenizer = run_tokenizer(cfg)
    init = init_drafter(cfg, target) if cfg.drafter.init_from else None
    mask_id = mask_token_id(cfg, target, tokenizer, init)
    if init is not None:
        config = init.config
    else:
        d = cfg.drafter
        dflash2 = {k: int(getattr(d, k)) for k in DFLASH2_KEYS} if d.kind == "dflash2" else None
        n = d.draft_vocab_size
        if n is not None and n >= target.vocab_size:
            raise ConfigError(
                "drafter.draft_vocab_size", f"must be below the target's vocabulary ({target.vocab_size})"
            )
        own: dict[str, t.Any] = {"draft_vocab_size": n, "has_own_lm_head": True} if n is not None else {}
        try:
            config = draft_config_for(
                target.model.config,
                num_layers=d.layers,
                block_size=d.block_size,
                mask_token_id=mask_id,
                target_layer_ids=target.layer_ids,
                layer_types=attention_types(d),
                sliding_window=d.sliding_window,
                dflash2=dflash2,
                **own,
            )
        except ValueError as e:  # a DFlash2 size that does not fit this target (a group that does not divide H)
            message = str(e).removeprefix("dflash_config.")
            raise ConfigError(f"drafter.{message.split(':')[0]}", message.split(": ", 1)[-1]) from None
    return DrafterSpec(config, mask_id, init, tokenizer)


def attention_types(d: DrafterConfig) -> list[str]:
    """Every drafter layer's attention as config.json's ``layer_types`` says it: ``drafter.layer_types``, else
    every layer sliding when ``drafter.sliding_window`` is set, else every layer full."""
    if d.layer_types is not None:
        return list(d.layer_types)
    return [SLIDING_ATTENTION if d.sliding_window is not None else FULL_ATTENTION] * d.layers


def initial_drafter(config: DFlashDraftConfig, *, seed: int, init: DFlashDraftModel | None = None) -> DFlashDraftModel:
    """The drafter at step 0, fp32 on the CPU: ``config`` initialised from ``seed`` (a private RNG stream:
    the caller's stays where it was), then the warm start's weights when there is one."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        base = DFlashDraftModel(config)
    if init is not None:
        base.load_state_dict(init.state_dict(), strict=True)
    return base


def run_tokenizer(cfg: RunConfig) -> t.Any:
    """``data.tokenizer``, else the target's (data that is not pre-tokenized); None when there is none to load."""
    d = cfg.data
    path = d.tokenizer or (cfg.target.path if d.format != "tokens" else None)
    if path is None:
        return None
    try:
        return load_tokenizer(path)
    except DataError:
        if d.tokenizer is not None or d.format == "chat":
            raise
        return None  # the target folder has no tokenizer; pre-tokenized data needs none


def mask_token_id(cfg: RunConfig, target: TargetModel, tokenizer: t.Any, init: DFlashDraftModel | None) -> int:
    """The MASK id the run trains with (the rule in the module docstring)."""
    mask_id = cfg.drafter.mask_token_id
    if init is not None:
        init_mask = init.mask_token_id
        if mask_id is not None and mask_id != init_mask:
            raise ConfigError(
                "drafter.mask_token_id",
                f"{mask_id} differs from {init_mask}, the id the drafter in "
                f"drafter.init_from was trained with; leave it out",
            )
        mask_id = init_mask
    elif mask_id is None:
        mask_id = default_rule_mask_id(
            target.model.config, target.vocab_size, len(tokenizer) if tokenizer is not None else None
        )
    elif mask_id >= target.vocab_size:
        raise ConfigError("drafter.mask_token_id", f"{mask_id} is outside the target vocabulary ({target.vocab_size})")
    return mask_id


def default_rule_mask_id(target_config: t.Any, vocab_size: int, tokenizer_len: int | None) -> int:
    """The MASK id when neither ``drafter.mask_token_id`` nor a warm start sets it: the id published drafters
    of the target's family use, when the tokenizer leaves that row unused; else the last row."""
    published = published_mask_token_id(target_config)
    if published is not None and (tokenizer_len is None or tokenizer_len <= published):
        return published  # what published drafters of this family use: warm starts and comparisons agree
    return default_mask_token_id(vocab_size, tokenizer_len)


def init_drafter(cfg: RunConfig, target: TargetModel) -> DFlashDraftModel:
    """The drafter of ``drafter.init_from`` (ours or a published z-lab folder), checked against this run."""
    d = cfg.drafter
    key = "drafter.init_from"
    folder = Path(t.cast(str, d.init_from)).expanduser()
    try:
        config_keys.check_folder(folder)  # a published key we do not compute: refused, not ignored
        model = ckpt.load_drafter(folder)
    except ContractError as e:
        raise ConfigError(key, f"{d.init_from}: {e}") from None
    except CheckpointError as e:
        raise ConfigError(key, str(e)) from None
    c = model.config
    tc = target.model.config
    text = tc.get_text_config() if hasattr(tc, "get_text_config") else tc
    checks: list[tuple[str, object, object, str]] = [
        ("vocab_size", c.vocab_size, target.vocab_size, "the target's vocabulary"),
        ("hidden_size", c.hidden_size, int(text.hidden_size), "the target's hidden size"),
        ("num_target_layers", c.num_target_layers, int(text.num_hidden_layers), "the target's layers"),
        ("target_layer_ids", list(model.target_layer_ids), list(target.layer_ids), "the target layers this run reads"),
        ("num_hidden_layers", c.num_hidden_layers, d.layers, "drafter.layers"),
        ("block_size", model.block_size, d.block_size, "drafter.block_size"),
        ("kind", model.kind, d.kind, "drafter.kind"),
    ]
    if d.draft_vocab_size is not None:  # unset: the warm start's own (its d2t/t2d come with its weights)
        checks.append(("draft_vocab_size", c.draft_vocab, d.draft_vocab_size, "drafter.draft_vocab_size"))
    if d.layer_types is not None or d.sliding_window is not None:  # unset: the warm start's own
        checks += [
            ("layer_types", model.layer_types, attention_types(d), "drafter.layer_types"),
            ("sliding_window", model.sliding_window, d.sliding_window, "drafter.sliding_window"),
        ]
    for name, theirs, ours, what in checks:
        if theirs != ours:
            raise ConfigError(key, f"{d.init_from}: {name} is {theirs}, but {what} is {ours}")
    logger.info("drafter: warm start from %s (MASK id %d)", d.init_from, model.mask_token_id)
    return model


__all__ = [
    "DrafterSpec",
    "attention_types",
    "default_rule_mask_id",
    "drafter_spec",
    "init_drafter",
    "initial_drafter",
    "load_target",
    "mask_token_id",
    "run_tokenizer",
]
