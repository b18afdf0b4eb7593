"""``dflash.py``: this project's drafter as a self-contained Hugging Face remote-code module.

Every checkpoint and export folder carries it, and config.json's ``auto_map`` points ``AutoModel`` at its
``DFlashDraftModel``, so ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` loads the drafter
with only torch and transformers installed (no ``dflash`` package). It is generated, not kept as a copy:
the source of ``dflash/model/drafter.py`` with its one import from this package (``build_target_layer_ids``)
replaced by that function's own source. So the served model is the trained model, line for line.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

from dflash.model import target

__all__ = ["FILE_NAME", "source", "write"]

FILE_NAME = "dflash.py"  # the module name config.json's auto_map names ("dflash.DFlashDraftModel")

_IMPORT = "from dflash.model.target import build_target_layer_ids\n"
_HEADER = """# dflash.py: the DFlash drafter as Hugging Face remote code, written by the `dflash` trainer.
# Load with: AutoModel.from_pretrained(folder, trust_remote_code=True) (needs torch and transformers only).
# Generated from the trainer's dflash/drafter.py; edits here are lost at the next export.
"""


@functools.lru_cache(maxsize=1)
def source() -> str:
    """The module's text (built once per process)."""
    drafter = Path(__file__).resolve().parent.parent / "drafter.py"
    text = drafter.read_text(encoding="utf-8")
    if text.count(_IMPORT) != 1:
        raise RuntimeError(f"{drafter}: expected exactly one line {_IMPORT.strip()!r} to inline")
    body = text.replace(_IMPORT, "").rstrip("\n")
    helper = inspect.getsource(target.build_target_layer_ids)
    # The helper goes after the module's imports: before the first top-level definition that needs it.
    anchor = "\nFULL_ATTENTION = "
    if body.count(anchor) != 1:
        raise RuntimeError(f"{drafter}: cannot find where to put build_target_layer_ids")
    body = body.replace(anchor, "\n\n" + helper + anchor, 1)
    if "from dflash" in body or "import dflash" in body:
        raise RuntimeError(f"{drafter}: the remote module would import the dflash package")
    return _HEADER + body + "\n"


def write(folder: str | Path) -> Path:
    """Write ``dflash.py`` into ``folder``; returns its path."""
    path = Path(folder) / FILE_NAME
    path.write_text(source(), encoding="utf-8")
    return path
