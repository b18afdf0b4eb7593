"""`dflash export CKPT OUT`: a serving folder from a training checkpoint.

    dflash export runs/tiny-cpu/checkpoints OUT [--dtype bfloat16|float16|float32] [--eval eval.json] [--force]
                  [--format zlab|speculators [--verifier TARGET]]

OUT holds what a Hugging Face user or a serving engine loads, and nothing for resuming:

- ``config.json``       the drafter config (z-lab keys, ``auto_map`` -> ``dflash.DFlashDraftModel``, ``dtype``,
                        and the keys the serving engines need: ``dflash.model.contract``)
- ``model.safetensors`` the drafter weights in the chosen dtype, z-lab parameter names
- ``dflash.py``         the drafter as remote code (``dflash.model.hf_remote``):
                        ``AutoModel.from_pretrained(OUT, trust_remote_code=True)`` with only transformers
- ``README.md``         a model card: the target, the training data, the run's recipe, how to serve it
                        (vLLM and SGLang command lines), tau when ``--eval`` gives a report written by
                        ``dflash eval --json``

``--format speculators`` writes vllm-project/speculators' layout instead (``dflash.serve.speculators_format``:
config.json naming the verifier, so ``vllm serve OUT`` alone starts target and drafter; no dflash.py).
Either way ``dflash.model.contract`` refuses, in one line, what a serving engine would refuse or get wrong.

It is written into a temporary folder next to OUT and renamed, so OUT is complete or absent.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import typing as t
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash import inputs, outputs
from dflash.checkpoint import checkpoints as ckpt
from dflash.checkpoint.manifest import CONFIG_FILE, STATE_FILE, WEIGHTS_FILE, CheckpointError
from dflash.dtypes import ALIASES, NAMES, canonical, torch_dtype
from dflash.errors import InputError
from dflash.model import config_keys, contract, hf_remote, model_config
from dflash.serve import speculators_format

__all__ = ["FORMATS", "ExportError", "export"]

FORMATS = ("zlab", "speculators")


class ExportError(InputError, ValueError):
    """Bad input to export (no checkpoint, OUT in the way, an unreadable report): one line."""


def _resolve(path: Path, log: t.Callable[[str], None] | None) -> Path:
    """A checkpoint dir (config.json), or under a root or a run dir the ``best`` checkpoint when training
    chose one by held-out tau, else the latest complete ``step-*`` (``checkpoint.choose``; ``log`` says which)."""
    chosen, note = ckpt.choose(path)
    if (chosen / CONFIG_FILE).is_file():
        if note is not None and log is not None:
            log(note)
        return chosen
    if not path.exists():
        raise ExportError(f"{path}: no such checkpoint")
    raise ExportError(f"{path}: no drafter here (a checkpoint dir with config.json, or a folder of step-* checkpoints)")


def _run_config(path: Path) -> dict[str, t.Any]:
    """The training run's config saved with the checkpoint ({} for a folder without trainer state)."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        return {}
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError subclasses and RuntimeErrors here
        raise ExportError(f"{state_file}: cannot be loaded with weights_only=True: {exc}") from exc
    cfg = (state.get("trainer_state") or {}).get("config")
    return {**cfg, "_step": state.get("step")} if isinstance(cfg, dict) else {"_step": state.get("step")}


# the report keys the model card prints, and what each must be (a report is a user's file: a tau of NaN,
# true or "6" is not a figure for a model card)
REPORT_NUMBERS = ("tau",)
REPORT_INTS = ("num_prompts", "max_new_tokens", "step")
REPORT_TEXTS = ("prompts", "target", "drafter")


def _number(v: t.Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _read_report(path: Path) -> dict[str, t.Any]:
    """A ``dflash eval --json`` report, every key the card prints checked (one line naming the key)."""
    if not path.exists():
        raise ExportError(f"--eval: {path} does not exist")
    report = inputs.read_json(path, "--eval")  # bounded, finite, text: InputFileError is one line
    if not isinstance(report, dict) or "tau" not in report:
        raise ExportError(f"--eval: {path} is not a report of `dflash eval --json` (no tau)")
    bad = [k for k in REPORT_NUMBERS if not (_number(report[k]) and report[k] >= 0)]
    bad += [
        k for k in REPORT_INTS if report.get(k) is not None and not (_number(report[k]) and report[k] == int(report[k]))
    ]
    bad += [k for k in REPORT_TEXTS if report.get(k) is not None and not isinstance(report[k], str)]
    if "all_equal" in report and not isinstance(report["all_equal"], bool):
        bad.append("all_equal")
    positions = report.get("position_acceptance")
    if positions is not None and not (isinstance(positions, list) and all(_number(a) for a in positions)):
        bad.append("position_acceptance")
    if bad:
        k = bad[0]
        raise ExportError(
            f"--eval: {path}: {k} is {json.dumps(report.get(k))[:60]}, not what `dflash eval --json` writes"
        )
    return report


def _run_field(run: dict[str, t.Any], key: str) -> t.Any:
    """target.path (a string) or target.tiny (a table) of the run's saved config, None when absent or of
    another type (a trainer state an older version wrote)."""
    target = run.get("target")
    value = target.get(key) if isinstance(target, dict) else None
    return value if isinstance(value, str if key == "path" else dict) and value else None


def _read_model(folder: t.Any, what: str) -> model_config.ModelConfig:
    """A model folder's config.json, checked (``model_config.read``); ExportError naming ``what`` otherwise."""
    if not Path(str(folder)).expanduser().is_dir():
        raise ExportError(
            f"{what} {folder}: not a local folder: give --verifier a local folder of the target (its config.json "
            "is checked against the drafter)"
        )
    try:
        return model_config.read(str(folder), f"{what} {folder}")
    except inputs.InputFileError as e:
        raise ExportError(str(e)) from None
    except inputs.RecordError as e:
        raise ExportError(f"{what} {folder}: {e}") from None


def _run_target(run: dict[str, t.Any]) -> model_config.ModelConfig | None:
    """The run's target config.json (a local folder), or None: a tiny target, or a folder moved away (then
    the drafter's own config stands in). A config.json there that is not a model's is one line."""
    path = _run_field(run, "path")
    if not path or not (Path(str(path)).expanduser() / model_config.CONFIG_FILE).exists():
        return None
    return _read_model(path, "the run's target")


def _facts(model: model_config.ModelConfig) -> contract.Target:
    return contract.Target(model.vocab_size, model.hidden_size, model.num_layers)


def _target_facts(run: dict[str, t.Any]) -> contract.Target:
    """What the serving contract checks the drafter against: the target the run trained with."""
    data = _run_target(run)
    if data is not None:
        return _facts(data)
    tiny = _run_field(run, "tiny")
    if isinstance(tiny, dict):
        sizes = [tiny.get(k) for k in ("vocab_size", "hidden_size", "num_layers")]
        return contract.Target(
            *(v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None for v in sizes)
        )
    return contract.Target()


def _verifier(
    run: dict[str, t.Any], verifier: str | None, config: t.Mapping[str, t.Any]
) -> tuple[str, list[str], contract.Target]:
    """speculators_config.verifier: (name_or_path, architectures) and the facts the drafter is checked
    against: ``--verifier`` read like the run's target (a local folder whose config.json is a model's),
    else the run's target folder. Never the one for the other: the config names the folder it was read from."""
    target_path = _run_field(run, "path")
    if verifier is None and not target_path:
        raise ExportError(
            "--format speculators: name the target it serves with (speculators_config.verifier): "
            "--verifier PATH (the run's target is not a local folder)"
        )
    name = verifier if verifier is not None else str(target_path)
    what = "--verifier" if verifier is not None else "the run's target"
    model = _read_model(name, what)
    if model.architectures is None:
        raise ExportError(f"{what} {name}: {model.path}: architectures missing, expected a non-empty list of strings")
    pairs = [  # the verifier's key, the drafter's key, theirs, the drafter's
        ("vocab_size", "vocab_size", model.vocab_size, config.get("vocab_size")),
        # z-lab: no target_hidden_size means the drafter's own hidden size
        (
            "hidden_size",
            "target_hidden_size",
            model.hidden_size,
            config.get("target_hidden_size") or config.get("hidden_size"),
        ),
        ("num_hidden_layers", "num_target_layers", model.num_layers, config.get("num_target_layers")),
    ]
    for theirs_key, key, theirs, drafter in pairs:
        if drafter is not None and drafter != theirs:
            raise ExportError(
                f"{what} {name}: {model.path}: {theirs_key} is {theirs}, but the drafter's {key} is {drafter}: "
                "a drafter serves only the target it was trained for"
            )
    return name, list(model.architectures), _facts(model)


def _target_name(run: dict[str, t.Any]) -> str:
    target = {"path": _run_field(run, "path"), "tiny": _run_field(run, "tiny")}
    if target.get("path"):
        return str(target["path"])
    if target.get("tiny"):
        return "a tiny random Qwen3-shaped target (target.tiny)"
    return "unknown (no trainer state in the checkpoint)"


def _serving_lines(*, out: Path, fmt: str, config: t.Any, run: dict[str, t.Any]) -> list[str]:
    """The card's "Serving" section: the exact vLLM and SGLang command lines for this folder."""
    target = str(_run_field(run, "path") or "TARGET")
    drafter, block = str(out), int(config.block_size)
    own = config.draft_vocab < config.vocab_size
    lines = ["", "## Serving", ""]
    if fmt == "speculators":
        lines += [
            "vLLM (this folder's speculators config names the target and the number of draft tokens):",
            "",
            "```bash",
            contract.vllm_speculators_command(drafter=drafter),
            "```",
            "",
            "SGLang reads the z-lab layout: export again without `--format speculators` for it.",
        ]
    else:
        lines += [
            f"vLLM ({block - 1} speculative tokens: a block of {block} is the last verified token and "
            f"{block - 1} drafts):",
            "",
            "```bash",
            contract.vllm_command(
                target=target,
                drafter=drafter,
                block_size=block,
                layer_types=config.layer_types or (),
                dflash2=getattr(config, "kind", "dflash") == "dflash2",
            ),
            "```",
            "",
            'vLLM detects the method only from a path that contains "dflash"; the command names it unless '
            "this folder's does. No `--attention-backend`: since vLLM PR #39930 (in 0.33) it sets the target's "
            "backend only, and vLLM picks the drafter's among those that run its non-causal layers "
            "(0.34: `load_dflash_model`, vllm/v1/worker/gpu/spec_decode/dflash/utils.py). To pin the "
            f"drafter's (a build before PR #48167 on Blackwell), put `{contract.ATTENTION_BACKEND_PIN}` inside "
            "`--speculative-config`.",
            *(
                ["", note]
                if (
                    note := contract.vllm_runner_note(
                        layer_types=config.layer_types or (), dflash2=getattr(config, "kind", "dflash") == "dflash2"
                    )
                )
                else []
            ),
            *(
                [
                    "",
                    "DFlash2: vLLM and SGLang pick their DFlash2 model (convolutions and the selector's walk over "
                    f"the top-{config.dflash2_value('selector_top_k')} candidates) from `architectures` "
                    "`DFlash2DraftModel`; keep the number of draft tokens at the block size (the convolutions "
                    "are laid out per block).",
                ]
                if getattr(config, "kind", "dflash") == "dflash2"
                else []
            ),
            "",
            *(
                ["SGLang:", "", "```bash", sglang, "```"]
                if (sglang := contract.sglang_command(target=target, drafter=drafter, block_size=block, own_vocab=own))
                else [
                    f"Not SGLang: this drafter has its own lm_head over {config.draft_vocab} of "
                    f"{config.vocab_size} tokens (d2t/t2d), which SGLang 0.5.23 ignores (it drafts with the "
                    "target's lm_head); vLLM reads it."
                ]
            ),
        ]
    if target == "TARGET":
        lines += ["", "TARGET: the model this drafter was trained for."]
    lines += [
        "",
        "Acceptance where it is served: `dflash bench serve --server URL --prompts PROMPTS --eval REPORT.json` "
        "(the engine's own counters, beside `dflash eval`'s offline tau).",
    ]
    return lines


def _context_lines(config: t.Any, data: dict[str, t.Any]) -> list[str]:
    """The context the drafter was trained at (``data.max_length``), its sliding window, and what is not
    measured: served past its trained length a drafter's acceptance is unknown (users have run drafters at
    4x theirs, and engines that ran sliding layers as full attention lost acceptance past the window)."""
    length = data.get("max_length")
    trained = f"{length} tokens (data.max_length)" if isinstance(length, int) else "unknown"
    types = list(config.layer_types or [])
    sliding = sum(1 for k in types if k == contract.SLIDING_ATTENTION)
    window = (
        f"{config.sliding_window} tokens on {sliding} of {len(types)} layers (the engine must serve them as "
        "sliding, causal layers)"
        if sliding
        else "none (every layer attends to the whole context)"
    )
    return [
        f"- trained context: {trained}",
        f"- sliding window: {window}",
        "",
        "Acceptance past the trained context is not measured: serve this drafter within it, or measure it "
        "at your context with `dflash bench serve`.",
    ]


def model_card(
    *,
    source: Path,
    config: t.Any,
    dtype: str,
    run: dict[str, t.Any],
    report: dict[str, t.Any] | None,
    out: Path | None = None,
    fmt: str = "zlab",
) -> str:
    """README.md for the exported folder: what it drafts for, what it learnt from, how to serve and load it."""
    d = run.get("drafter") or {}
    data = run.get("data") or {}
    optim = run.get("optim") or {}
    lines = [
        "---",
        "library_name: transformers",
        "tags: [dflash, speculative-decoding, block-diffusion, draft-model]",
        "---",
        "",
        "# DFlash drafter",
        "",
        "A block-diffusion draft model (DFlash) for speculative decoding: one forward drafts a block of "
        f"{config.block_size} positions ({config.block_size - 1} new tokens) from the target's hidden states.",
        "",
        f"- target: `{_target_name(run)}`",
        f"- training data: `{data.get('path', 'unknown')}`",
        f"- drafter: {config.num_hidden_layers} layers, hidden {config.hidden_size}, block size {config.block_size}, "
        f"target layers {list(config.dflash_config['target_layer_ids'])}, MASK id {config.dflash_config['mask_token_id']}",
        f"- weights: {dtype}, exported from `{source}`"
        + (f" (step {run['_step']})" if run.get("_step") is not None else ""),
        *_context_lines(config, data),
    ]
    if optim:
        lines.append(
            f"- recipe: lr {optim.get('lr')}, {optim.get('sequences_per_update')} sequences per update per "
            f"drafter x {len((run.get('devices') or {}).get('drafters') or []) or '?'} drafter(s), "
            f"{run.get('max_steps')} updates, {d.get('num_anchors')} anchors per sequence"
        )
    if report is not None:
        lines += [
            "",
            "## Acceptance",
            "",
            f"tau {report['tau']:.2f} (tokens per target forward, exact greedy speculative decoding) on "
            f"{report.get('num_prompts', '?')} prompts from `{report.get('prompts', '?')}`, "
            f"{report.get('max_new_tokens', '?')} new tokens each, target `{report.get('target', '?')}`; "
            f"output identical to plain greedy decoding: {'yes' if report.get('all_equal') else 'no'}.",
        ]
        positions = report.get("position_acceptance")
        if isinstance(positions, list) and positions:
            lines += ["", "Acceptance by draft position (1..B-1): " + " ".join(f"{a:.2f}" for a in positions)]
    if out is not None:
        lines += _serving_lines(out=out, fmt=fmt, config=config, run=run)
    if fmt == "speculators":
        kind = "DFlash2" if getattr(config, "kind", "dflash") == "dflash2" else "DFlash"
        lines += [
            "",
            "## Loading",
            "",
            f"vllm-project/speculators' `{kind}SpeculatorConfig` / `{kind}DraftModel` read this folder (the "
            "embedding and lm_head come from the verifier named in config.json). Parameter names are "
            "z-lab's `DFlashDraftModel`'s.",
            "",
        ]
        return "\n".join(lines)
    lines += [
        "",
        "## Loading",
        "",
        "```python",
        "from transformers import AutoModel",
        'drafter = AutoModel.from_pretrained("PATH", trust_remote_code=True)  # dflash.py in this folder',
        "```",
        "",
        "The target's embedding and lm_head are not part of this model: the drafter embeds its block "
        + (
            "with the target's embedding and scores it with the target's lm_head. "
            if config.draft_vocab >= config.vocab_size
            else f"with the target's embedding and scores it with its own lm_head over {config.draft_vocab} target "
            "tokens (target id = draft id + d2t[draft id]; t2d marks them). "
        )
        + "Parameter names and config.json keys are those of z-lab's `DFlashDraftModel`.",
        "",
    ]
    return "\n".join(lines)


def export(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = "bfloat16",
    eval_report: str | os.PathLike[str] | None = None,
    force: bool = False,
    fmt: str = "zlab",
    verifier: str | None = None,
    log: t.Callable[[str], None] | None = None,
) -> Path:
    """Write the serving folder ``out`` from a checkpoint (or the latest under a root); returns ``out``.
    ``fmt``: "zlab" (vLLM, SGLang and transformers read it) or "speculators" (``verifier``: the target it
    names, default the run's target folder)."""
    if canonical(dtype) is None:
        raise ExportError(f"--dtype: expected one of {', '.join(NAMES)} (or {', '.join(ALIASES)}), got {dtype!r}")
    if fmt not in FORMATS:
        raise ExportError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if verifier is not None and fmt != "speculators":
        raise ExportError("--verifier goes with --format speculators")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out}: exists and is not empty (use --force to replace it)")
    path = _resolve(Path(source).expanduser(), log)
    check_out(out, sources=(source, path))
    report = _read_report(Path(eval_report)) if eval_report is not None else None
    try:
        model = ckpt.load_drafter(path)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    run = _run_config(path)
    # d2t (int64) and t2d (bool) keep their dtypes: vLLM loads d2t into an int64 parameter
    weights = {
        k: (v.detach().to(torch_dtype(dtype)) if v.is_floating_point() else v.detach()).contiguous()
        for k, v in model.state_dict().items()
    }
    config = json.loads(ckpt.config_json(model.config, dtype=torch_dtype(dtype)))
    target = _target_facts(run)
    try:  # said before anything is written: OUT stays as it was
        shapes = {k: tuple(v.shape) for k, v in weights.items()}
        config_keys.check(config)  # every key the engines will read: computed here as there, or refused
        contract.check(config, shapes, target=target)
        if fmt == "speculators":
            name, archs, facts = _verifier(run, verifier, config)
            contract.check(config, shapes, target=facts)
            config = speculators_format.speculators_config(
                config, verifier=name, verifier_architectures=archs, num_verifier_layers=facts.num_layers
            )
    except contract.ContractError as exc:
        raise ExportError(f"{out}: not exported: {exc}") from None
    card = model_card(source=path, config=model.config, dtype=dtype, run=run, report=report, out=out.resolve(), fmt=fmt)
    with outputs.OutputLock(out, command="export"), outputs.writing(command="export", where=out):
        check_out(out, sources=(source, path))  # again, holding the lock
        _write(out, f".tmp-export-{out.name}-{os.getpid()}", weights=weights, config=config, fmt=fmt, card=card)
    return out


EXPORT_FILES = frozenset({WEIGHTS_FILE, CONFIG_FILE, "dflash.py", "README.md"})


def check_out(out: Path, *, sources: t.Sequence[str | os.PathLike[str]]) -> None:
    """OUT may be replaced (``--force``) only when it is what export writes: never the working directory or
    a folder above it, the checkpoint or a folder holding it, nor a folder with anything else in it."""
    outputs.check_out(out, what="export: OUT", kind="dir", sources=sources)
    if out.is_dir():
        other = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
        if other:
            raise ExportError(
                f"{out}: not replaced: it holds {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}, which "
                "export does not write (only an earlier export is replaced); remove it or choose another folder"
            )


def _write(out: Path, tmp_name: str, *, weights: dict[str, torch.Tensor], config: t.Any, fmt: str, card: str) -> None:
    """Everything into a folder beside OUT, then the rename: OUT is complete, or as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / tmp_name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if fmt == "zlab":  # a speculators config.json has no model_type: AutoModel cannot read it anyway
            hf_remote.write(tmp)
        (tmp / "README.md").write_text(card)
        if out.exists():  # an earlier export (check_out): nothing else is ever removed
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
