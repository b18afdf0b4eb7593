"""`dflash export CKPT OUT`: a serving folder from a training checkpoint.

    dflash export runs/tiny-cpu/checkpoints OUT [--dtype bf16|fp16|fp32] [--eval eval.json] [--force]

OUT holds what a Hugging Face user or a serving engine loads, and nothing for resuming:

- ``config.json``       the drafter config (z-lab keys, ``auto_map`` -> ``dflash.DFlashDraftModel``, ``dtype``)
- ``model.safetensors`` the drafter weights in the chosen dtype, z-lab parameter names
- ``dflash.py``         the drafter as remote code (``dflash.hf_remote``):
                        ``AutoModel.from_pretrained(OUT, trust_remote_code=True)`` with only transformers
- ``README.md``         a model card: the target, the training data, the run's recipe, tau when ``--eval``
                        gives a report written by ``dflash eval --json``

It is written into a temporary folder next to OUT and renamed, so OUT is complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import typing as t
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash import checkpoint as ckpt
from dflash import hf_remote
from dflash.errors import InputError

__all__ = ["DTYPES", "ExportError", "export"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ExportError(InputError, ValueError):
    """Bad input to export (no checkpoint, OUT in the way, an unreadable report): one line."""


def _resolve(path: Path) -> Path:
    """A checkpoint dir (config.json), or the latest complete ``step-*`` under a root or a run dir."""
    if (path / ckpt.CONFIG_FILE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        latest = ckpt.latest_complete(root)
        if latest is not None:
            return latest
    if not path.exists():
        raise ExportError(f"{path}: no such checkpoint")
    raise ExportError(f"{path}: no drafter here (a checkpoint dir with config.json, or a folder of step-* checkpoints)")


def _run_config(path: Path) -> dict[str, t.Any]:
    """The training run's config saved with the checkpoint ({} for a folder without trainer state)."""
    state_file = path / ckpt.STATE_FILE
    if not state_file.is_file():
        return {}
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError subclasses and RuntimeErrors here
        raise ExportError(f"{state_file}: cannot be loaded with weights_only=True: {exc}") from exc
    cfg = (state.get("trainer_state") or {}).get("config")
    return {**cfg, "_step": state.get("step")} if isinstance(cfg, dict) else {"_step": state.get("step")}


def _read_report(path: Path) -> dict[str, t.Any]:
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"--eval: {path} does not exist") from None
    except ValueError as exc:
        raise ExportError(f"--eval: {path} is not JSON ({exc})") from None
    if not isinstance(report, dict) or not isinstance(report.get("tau"), (int, float)):
        raise ExportError(f"--eval: {path} is not a report of `dflash eval --json` (no tau)")
    return report


def _target_name(run: dict[str, t.Any]) -> str:
    target = run.get("target") or {}
    if target.get("path"):
        return str(target["path"])
    if target.get("tiny"):
        return "a tiny random Qwen3-shaped target (target.tiny)"
    return "unknown (no trainer state in the checkpoint)"


def model_card(
    *, source: Path, config: t.Any, dtype: str, run: dict[str, t.Any], report: dict[str, t.Any] | None
) -> str:
    """README.md for the exported folder: what it drafts for, what it learnt from, how to load it."""
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
        "with the target's embedding and scores it with the target's lm_head. Parameter names and "
        "config.json keys are those of z-lab's `DFlashDraftModel`.",
        "",
    ]
    return "\n".join(lines)


def export(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: str = "bf16",
    eval_report: str | os.PathLike[str] | None = None,
    force: bool = False,
) -> Path:
    """Write the serving folder ``out`` from a checkpoint (or the latest under a root); returns ``out``."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ExportError(f"{out}: exists and is not empty (use --force to replace it)")
    path = _resolve(Path(source).expanduser())
    report = _read_report(Path(eval_report)) if eval_report is not None else None
    try:
        model = ckpt.load_drafter(path)
    except ckpt.CheckpointError as exc:
        raise ExportError(str(exc)) from None
    run = _run_config(path)
    weights = {k: v.detach().to(DTYPES[dtype]).contiguous() for k, v in model.state_dict().items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / ckpt.WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / ckpt.CONFIG_FILE).write_text(ckpt.config_json(model.config, dtype=DTYPES[dtype]))
        hf_remote.write(tmp)
        (tmp / "README.md").write_text(
            model_card(source=path, config=model.config, dtype=dtype, run=run, report=report)
        )
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
