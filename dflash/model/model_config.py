"""A model folder's config.json as dflash reads it without loading the model: the run's target (for the
serving contract an export checks, the vocabulary prepare-data checks) and ``export --verifier``.

The file is a user's (or a download's): read bounded (``inputs.read_record``) and field by field, so a
string-valued, negative, missing or absurd size is one line naming the file and the key, never a traceback
nor a figure taken as it came. A multimodal config keeps the language model's sizes under ``text_config``
(Qwen3.5, Llama 4): read from there; ``architectures`` is the top level's.
"""

from __future__ import annotations

import dataclasses
import typing as t
from pathlib import Path

from dflash import inputs

__all__ = ["CONFIG_FILE", "ModelConfig", "read", "read_vocab_size"]

CONFIG_FILE = "config.json"
# far above any model's, far below what would make a figure silently wrong (a size that overflows a shape)
MAX_VOCAB = 1 << 24
MAX_HIDDEN = 1 << 18
MAX_LAYERS = 4096


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What a model folder's config.json says of the model: sizes checked, architectures None when absent."""

    path: Path  # the config.json
    vocab_size: int
    hidden_size: int
    num_layers: int
    architectures: tuple[str, ...] | None


def _text(folder: str | Path, what: str) -> tuple[Path, inputs.Record, inputs.Record]:
    path = Path(folder).expanduser() / CONFIG_FILE
    rec = inputs.read_record(path, what)
    return path, rec, rec.record("text_config") if isinstance(rec.data.get("text_config"), dict) else rec


def read(folder: str | Path, what: str = CONFIG_FILE) -> ModelConfig:
    """``folder``/config.json, checked (``inputs.InputFileError`` starting with ``what``, or
    ``inputs.RecordError`` with the file's path: one line)."""
    path, rec, text = _text(folder, what)
    archs = rec.texts("architectures", default=None)
    return ModelConfig(
        path=path,
        vocab_size=text.integer("vocab_size", lo=1, hi=MAX_VOCAB),
        hidden_size=text.integer("hidden_size", lo=1, hi=MAX_HIDDEN),
        num_layers=text.integer("num_hidden_layers", lo=1, hi=MAX_LAYERS),
        architectures=tuple(archs) if archs is not None else None,
    )


def read_vocab_size(folder: str | Path, what: str = CONFIG_FILE) -> int:
    """Only the vocabulary of ``folder``/config.json, checked like ``read``'s."""
    return t.cast(int, _text(folder, what)[2].integer("vocab_size", lo=1, hi=MAX_VOCAB))
