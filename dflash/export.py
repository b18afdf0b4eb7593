"""`dflash export CKPT OUT`: a serving folder from a training checkpoint.

    dflash export runs/tiny-cpu/checkpoints OUT [--dtype bf16|fp16|fp32] [--eval eval.json] [--force]
                  [--format zlab|speculators [--verifier TARGET]]

OUT holds what a Hugging Face user or a serving engine loads, and nothing for resuming:

- ``config.json``       the drafter config (z-lab keys, ``auto_map`` -> ``dflash.DFlashDraftModel``, ``dtype``,
                        and the keys the serving engines need: ``dflash.contract``)
- ``model.safetensors`` the drafter weights in the chosen dtype, z-lab parameter names
- ``dflash.py``         the drafter as remote code (``dflash.hf_remote``):
                        ``AutoModel.from_pretrained(OUT, trust_remote_code=True)`` with only transformers
- ``README.md``         a model card: the target, the training data, the run's recipe, how to serve it
                        (vLLM and SGLang command lines), tau when ``--eval`` gives a report written by
                        ``dflash eval --json``

``--format speculators`` writes vllm-project/speculators' layout instead (``dflash.speculators_format``:
config.json naming the verifier, so ``vllm serve OUT`` alone starts target and drafter; no dflash.py).
Either way ``dflash.contract`` refuses, in one line, what a serving engine would refuse or get wrong.

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
from dflash import contract, hf_remote, speculators_format
from dflash.errors import InputError

__all__ = ["DTYPES", "FORMATS", "ExportError", "export"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORMATS = ("zlab", "speculators")


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


def _target_config(run: dict[str, t.Any]) -> dict[str, t.Any] | None:
    """The run's target config.json (a local folder), or None (a tiny target, or a folder moved away)."""
    path = (run.get("target") or {}).get("path")
    try:
        data = json.loads((Path(str(path)) / ckpt.CONFIG_FILE).read_text()) if path else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _target_facts(run: dict[str, t.Any]) -> contract.Target:
    """What the serving contract checks the drafter against: the target the run trained with."""
    data = _target_config(run)
    if data is not None:
        nested = data.get("text_config")
        text: dict[str, t.Any] = nested if isinstance(nested, dict) else data
        return contract.Target(text.get("vocab_size"), text.get("hidden_size"), text.get("num_hidden_layers"))
    tiny = (run.get("target") or {}).get("tiny")
    if isinstance(tiny, dict):
        return contract.Target(tiny.get("vocab_size"), tiny.get("hidden_size"), tiny.get("num_layers"))
    return contract.Target()


def _verifier(run: dict[str, t.Any], verifier: str | None) -> tuple[str, list[str]]:
    """speculators_config.verifier: (name_or_path, architectures): --verifier, else the run's target folder;
    the architectures from the first of the two that is a folder with a config.json."""
    target_path = (run.get("target") or {}).get("path")
    name = verifier or (str(target_path) if target_path else None)
    if not name:
        raise ExportError(
            "--format speculators: name the target it serves with (speculators_config.verifier): "
            "--verifier PATH (the run's target is not a local folder)"
        )
    for where in (name, target_path):
        try:
            data = json.loads((Path(str(where)).expanduser() / ckpt.CONFIG_FILE).read_text()) if where else None
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("architectures"), list):
            return name, [str(a) for a in data["architectures"]]
    raise ExportError(
        f"--verifier {name}: no config.json with architectures there (nor in the run's target folder): "
        "give --verifier a local folder of the target"
    )


def _target_name(run: dict[str, t.Any]) -> str:
    target = run.get("target") or {}
    if target.get("path"):
        return str(target["path"])
    if target.get("tiny"):
        return "a tiny random Qwen3-shaped target (target.tiny)"
    return "unknown (no trainer state in the checkpoint)"


def _serving_lines(*, out: Path, fmt: str, config: t.Any, run: dict[str, t.Any]) -> list[str]:
    """The card's "Serving" section: the exact vLLM and SGLang command lines for this folder."""
    target = str((run.get("target") or {}).get("path") or "TARGET")
    drafter, block = str(out), int(config.block_size)
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
            f"{block - 1} drafts; FLASH_ATTN, because the drafter's full-attention layers are non-causal):",
            "",
            "```bash",
            contract.vllm_command(
                target=target, drafter=drafter, block_size=block, layer_types=config.layer_types or ()
            ),
            "```",
            "",
            'vLLM detects the method only from a path that contains "dflash"; the command names it unless '
            "this folder's does.",
            "",
            "SGLang:",
            "",
            "```bash",
            contract.sglang_command(target=target, drafter=drafter, block_size=block),
            "```",
        ]
    if target == "TARGET":
        lines += ["", "TARGET: the model this drafter was trained for."]
    lines += [
        "",
        "Acceptance where it is served: `dflash bench serve --server URL --prompts PROMPTS --eval REPORT.json` "
        "(the engine's own counters, beside `dflash eval`'s offline tau).",
    ]
    return lines


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
        lines += [
            "",
            "## Loading",
            "",
            "vllm-project/speculators' `DFlashSpeculatorConfig` / `DFlashDraftModel` read this folder (the "
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
    fmt: str = "zlab",
    verifier: str | None = None,
) -> Path:
    """Write the serving folder ``out`` from a checkpoint (or the latest under a root); returns ``out``.
    ``fmt``: "zlab" (vLLM, SGLang and transformers read it) or "speculators" (``verifier``: the target it
    names, default the run's target folder)."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    if fmt not in FORMATS:
        raise ExportError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if verifier is not None and fmt != "speculators":
        raise ExportError("--verifier goes with --format speculators")
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
    config = json.loads(ckpt.config_json(model.config, dtype=DTYPES[dtype]))
    target = _target_facts(run)
    try:  # said before anything is written: OUT stays as it was
        contract.check(config, {k: tuple(v.shape) for k, v in weights.items()}, target=target)
        if fmt == "speculators":
            name, archs = _verifier(run, verifier)
            config = speculators_format.speculators_config(
                config, verifier=name, verifier_architectures=archs, num_verifier_layers=target.num_layers
            )
    except contract.ContractError as exc:
        raise ExportError(f"{out}: not exported: {exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-export-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(weights, str(tmp / ckpt.WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / ckpt.CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if fmt == "zlab":  # a speculators config.json has no model_type: AutoModel cannot read it anyway
            hf_remote.write(tmp)
        (tmp / "README.md").write_text(
            model_card(
                source=path, config=model.config, dtype=dtype, run=run, report=report, out=out.resolve(), fmt=fmt
            )
        )
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
