"""Drafter checkpoints: servable by z-lab's DFlashDraftModel, resumable, never picked half-written.

Layout of one checkpoint, ``<root>/step-<n>/``:

- ``config.json``       the drafter config (z-lab keys: architectures, auto_map, block_size,
                        num_target_layers, dflash_config{mask_token_id, target_layer_ids}, layer_types,
                        sliding_window; plus ``rope_theta`` for transformers 4.x readers)
- ``model.safetensors`` drafter weights only, z-lab parameter names (no target embedding or lm_head)
- ``trainer_state.pt``  {"step", "trainer_state", "optimizer"}: whatever the trainer needs to resume
                        (data position, RNG, pipeline config); loaded with ``weights_only=True``, so
                        it may hold tensors, numbers, strings, lists, tuples and dicts
- ``checkpoint.json``   the manifest, written last: step and the size of every file above

Everything is written into ``<root>/.tmp-step-<n>-<pid>``, fsynced, and renamed to ``step-<n>``, so a
``step-*`` directory is either absent or complete; ``latest_complete`` also checks the manifest, so a
directory copied or truncated by hand is not picked either.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import random
import re
import shutil
import typing as t
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.drafter import DFlashDraftConfig, DFlashDraftModel

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "latest_complete",
    "list_complete",
    "load_checkpoint",
    "load_drafter",
    "restore_rng_state",
    "rng_state",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "checkpoint.json"
FORMAT = "dflash-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.(?:tmp|old)-step-(\d+)-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or not ours; the message names the path."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    config: DFlashDraftConfig
    state_dict: dict[str, torch.Tensor]
    trainer_state: dict[str, t.Any]
    optimizer_state: dict[str, t.Any] | None


# ---- writing --------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def config_json(config: DFlashDraftConfig, *, dtype: torch.dtype | None = None) -> str:
    """The config.json text: transformers' own serialisation plus the keys older readers need."""
    data = json.loads(config.to_json_string(use_diff=True))
    full = config.to_dict()
    for key in ("architectures", "block_size", "num_target_layers", "dflash_config", "layer_types",
                "sliding_window", "use_sliding_window", "model_type", "vocab_size", "hidden_size"):
        data.setdefault(key, full.get(key))
    data["architectures"] = ["DFlashDraftModel"]
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope and rope.get("rope_type", "default") == "default":
        # transformers 4.x (z-lab pins 4.57) reads rope_theta, not rope_parameters.
        data.setdefault("rope_theta", rope["rope_theta"])
    if dtype is not None:
        data["dtype"] = str(dtype).removeprefix("torch.")
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale(root: Path) -> None:
    """Remove temp dirs that a dead process left behind (a crash mid-save)."""
    for entry in root.iterdir():
        match = _TMP_DIR.match(entry.name)
        if match and entry.is_dir() and int(match.group(2)) != os.getpid() and not _pid_alive(int(match.group(2))):
            shutil.rmtree(entry, ignore_errors=True)


def save_checkpoint(
    root: str | os.PathLike[str],
    *,
    step: int,
    drafter: DFlashDraftModel,
    trainer_state: dict[str, t.Any],
    optimizer_state: dict[str, t.Any] | None = None,
    keep: int | None = 3,
) -> Path:
    """Write ``<root>/step-<step>`` atomically and keep only the ``keep`` newest (None/0: keep all).

    Call it when no thread is changing the drafter (at the trainer's barrier). Returns the directory.
    """
    if step < 0:
        raise ValueError(f"step: must be >= 0, got {step}")
    if keep is not None and keep < 0:
        raise ValueError(f"keep: must be >= 0 (0 or None keeps all), got {keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        # A torch.compile wrapper adds "_orig_mod." to names; the file keeps z-lab's plain names.
        weights = {name.replace("_orig_mod.", ""): tensor.detach().to("cpu").contiguous()
                   for name, tensor in drafter.state_dict().items()}
        dtype = next(iter(weights.values())).dtype if weights else None
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(config_json(drafter.config, dtype=dtype))
        torch.save({"step": step, "trainer_state": trainer_state, "optimizer": optimizer_state}, tmp / STATE_FILE)
        files = {name: (tmp / name).stat().st_size for name in (CONFIG_FILE, WEIGHTS_FILE, STATE_FILE)}
        manifest = {
            "format": FORMAT,
            "step": step,
            "saved_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "files": files,
        }
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        for name in (*files, MANIFEST_FILE):
            _fsync_file(tmp / name)
        _fsync_dir(tmp)
        if final.exists():  # the same step saved again (e.g. after a resume): move the old one aside
            old = root / f".old-step-{step}-{os.getpid()}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("checkpoint step %d written to %s", step, final)
    if keep:
        for old_path in list_complete(root)[:-keep]:
            # Rename first: a half-deleted directory must not look like a checkpoint.
            doomed = root / f".old-step-{_step_of(old_path)}-{os.getpid()}"
            old_path.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    return final


# ---- finding and reading ------------------------------------------------------------------


def _step_of(path: Path) -> int:
    match = _STEP_DIR.match(path.name)
    if match is None:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a name like step-<n>)")
    return int(match.group(1))


def _manifest_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None if it is."""
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (not finished)"
    except (OSError, ValueError) as exc:
        return f"{MANIFEST_FILE} unreadable: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MANIFEST_FILE}: unknown format"
    if manifest.get("step") != _step_of(path):
        return f"{MANIFEST_FILE}: step {manifest.get('step')!r} does not match the directory name"
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != {CONFIG_FILE, WEIGHTS_FILE, STATE_FILE}:
        return f"{MANIFEST_FILE}: file list is wrong"
    for name, size in files.items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    return None


def list_complete(root: str | os.PathLike[str]) -> list[Path]:
    """Complete checkpoints under ``root``, oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        if _STEP_DIR.match(entry.name) and entry.is_dir():
            problem = _manifest_problem(entry)
            if problem is None:
                found.append(entry)
            else:
                logger.warning("skipping checkpoint %s: %s", entry, problem)
    return sorted(found, key=_step_of)


def latest_complete(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root`` (never a half-written one), or None."""
    found = list_complete(root)
    return found[-1] if found else None


def _read_config(path: Path) -> DFlashDraftConfig:
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {CONFIG_FILE}") from None
    except ValueError as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: not JSON ({exc})") from None
    try:
        return DFlashDraftConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path / CONFIG_FILE}: {exc}") from None


def load_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Read a complete checkpoint for resuming: config, drafter weights, trainer and optimizer state."""
    path = Path(path)
    problem = _manifest_problem(path) if path.is_dir() else "no such directory"
    if problem is not None:
        raise CheckpointError(f"{path}: not a complete checkpoint: {problem}")
    config = _read_config(path)
    state_dict = load_file(str(path / WEIGHTS_FILE), device=str(map_location))
    try:
        state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError subclasses and RuntimeErrors here
        raise CheckpointError(f"{path / STATE_FILE}: cannot be loaded with weights_only=True: {exc}") from exc
    return Checkpoint(path=path, step=int(state["step"]), config=config, state_dict=state_dict,
                      trainer_state=state["trainer_state"], optimizer_state=state.get("optimizer"))


def load_drafter(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> DFlashDraftModel:
    """A drafter for serving or evaluation, in eval mode. Also reads z-lab's published drafter folders
    (``config.json`` + ``model.safetensors``, no trainer state). Weights must match exactly."""
    path = Path(path)
    config = _read_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE}")
    state_dict = load_file(str(weights_path))
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    # Non-persistent buffers (RoPE frequencies) are not in the file: rebuild them for real.
    model.rotary_emb = type(model.rotary_emb)(config)
    model.to(device=device, dtype=dtype if dtype is not None else next(iter(state_dict.values())).dtype)
    model.requires_grad_(False)
    return model.eval()


# ---- RNG state helpers (for trainer_state) -----------------------------------------------


def rng_state(generator: torch.Generator | None = None) -> dict[str, t.Any]:
    """Python, torch CPU (and CUDA, where present) RNG states, plus a generator's, for trainer_state."""
    state: dict[str, t.Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def restore_rng_state(state: dict[str, t.Any], generator: torch.Generator | None = None) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"].cpu())


def _as_tuple(value: t.Any) -> t.Any:
    # random.setstate needs tuples all the way down; torch.load may hand back lists.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
