"""One checkpoint directory, ``<root>/step-<n>/``, as a reader sees it: the names of its files, its
manifest (``checkpoint.json``, read bounded and field by field) and whether it is complete (sizes).
``dflash.checkpoint.checkpoints`` writes, finds and loads checkpoints, ``dflash.checkpoint.best`` names the best one; both ask
here whether a directory is a complete checkpoint."""

from __future__ import annotations

import re
import typing as t
from pathlib import Path

from dflash import inputs
from dflash.errors import InputError
from dflash.model import hf_remote

__all__ = [
    "CONFIG_FILE",
    "FORMAT",
    "MANIFEST_FILE",
    "STATE_FILE",
    "STEP_DIR",
    "WEIGHTS_FILE",
    "CheckpointError",
    "manifest_problem",
    "read_manifest",
    "step_of",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "trainer_state.pt"
MANIFEST_FILE = "checkpoint.json"
FORMAT = "dflash-checkpoint/1"
STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(InputError, ValueError):
    """A checkpoint directory is missing, incomplete, corrupted or not ours; the message names the path."""


def step_of(path: Path) -> int:
    match = STEP_DIR.match(path.name)
    if match is None:
        raise CheckpointError(f"{path}: not a checkpoint directory (expected a name like step-<n>)")
    return int(match.group(1))


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def read_manifest(path: Path) -> tuple[dict[str, t.Any] | None, str | None]:
    """checkpoint.json, read bounded and field by field: (the manifest, None), or (None, why it is none: a
    half-written checkpoint, another format, a key missing or of the wrong type). Sizes are not compared
    here (``manifest_problem``), nor sums (``dflash.checkpoint.checkpoints``, before a load)."""
    file = path / MANIFEST_FILE
    if not file.exists():
        return None, f"no {MANIFEST_FILE} (not finished)"
    try:
        rec = inputs.read_record(file, MANIFEST_FILE)
        if rec.data.get("format") != FORMAT:
            return None, f"{MANIFEST_FILE}: unknown format"
        rec.integer("step", lo=0)
        files = rec.record("files")
        required = {CONFIG_FILE, WEIGHTS_FILE, STATE_FILE}  # dflash.py: in newer checkpoints only
        if not required <= set(files.data) <= required | {hf_remote.FILE_NAME}:
            return None, f"{MANIFEST_FILE}: file list is wrong"
        for name in files.data:
            files.integer(name, lo=0)
        sums = rec.record("sha256", default=None)  # None: an old manifest, sizes only
        if sums is not None:
            for name in sums.data:
                if name not in files.data or not _SHA256.match(str(sums.data[name])):
                    sums.bad(name, f"the sha256 (64 hex digits) of a file in files ({', '.join(sorted(files.data))})")
        rec.text("run_id", default=None)
    except inputs.InputFileError as exc:
        return None, f"{MANIFEST_FILE} unreadable: {str(exc).removeprefix(MANIFEST_FILE + ': ')}"
    except inputs.RecordError as exc:
        return None, f"{MANIFEST_FILE} unreadable: {str(exc).removeprefix(str(file) + ': ')}"
    return dict(rec.data), None


def manifest_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint, or None if it is (sizes only: ``dflash.checkpoint.checkpoints`` reads the bytes)."""
    manifest, problem = read_manifest(path)
    if manifest is None:
        return problem
    if manifest["step"] != step_of(path):
        return f"{MANIFEST_FILE}: step {manifest['step']!r} does not match the directory name"
    for name, size in manifest["files"].items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    return None
