"""The published tau of DFlash drafters, and which of them a measured target can be set beside.

The figures are z-lab's README tables (z-lab/dflash README at bb48ef9, 2026-01, the paper's Table 1):
the b16 drafters of Qwen3-8B and Qwen3-4B, greedy (T=0) and sampled (T=1), on the suites of
``dflash.eval.suites``, measured as ``run_benchmark.sh`` did: ``--max-new-tokens 2048``, thinking off, the
suites' sample counts, tau counted z-lab's way (``--count zlab``). A figure is shown beside ours only for
the same target, block size and temperature; what else differs (thinking, max new tokens, samples, the
counting rule) is said next to it.

The same target: the name the target folder goes by, read from its path (an HF cache folder
``models--Qwen--Qwen3-8B/snapshots/<sha>`` or a folder named ``Qwen3-8B``, any case; else the config's
``_name_or_path``), matched exactly to a published target's name (``Qwen3-8B-Base`` or ``Qwen3-8B-FP8``
are other targets), and only if the config has that target's shape (layers, width, vocabulary): a
folder renamed after a model it is not gets no figure.
"""

from __future__ import annotations

import dataclasses
import typing as t
from pathlib import PurePath

__all__ = ["PUBLISHED", "Published", "TARGET_SHAPES", "figure", "identify_target"]

SOURCE = "z-lab/dflash README @bb48ef9 (2026-01; the paper's Table 1)"
PROTOCOL = {"max_new_tokens": 2048, "enable_thinking": False, "count": "zlab"}
SAMPLES = {
    "gsm8k": 128,
    "math500": 128,
    "aime24": 30,
    "aime25": 30,
    "humaneval": 164,
    "mbpp": 128,
    "livecodebench": 128,
    "swe-bench": 128,
    "mt-bench": 80,
    "alpaca": 128,
}

# (num_hidden_layers, hidden_size, vocab_size) of each published target
TARGET_SHAPES: dict[str, tuple[int, int, int]] = {
    "Qwen/Qwen3-8B": (36, 4096, 151936),
    "Qwen/Qwen3-4B": (36, 2560, 151936),
}


@dataclasses.dataclass(frozen=True)
class Published:
    target: str
    drafter: str
    block_size: int
    temperature: float
    tau: dict[str, float]
    source: str = SOURCE


_ORDER = (
    "gsm8k",
    "math500",
    "aime24",
    "aime25",
    "humaneval",
    "mbpp",
    "livecodebench",
    "swe-bench",
    "mt-bench",
    "alpaca",
)


def _row(target: str, temperature: float, *taus: float) -> Published:
    name = target.split("/")[1]
    return Published(target, f"z-lab/{name}-DFlash-b16", 16, temperature, dict(zip(_ORDER, taus)))


PUBLISHED: tuple[Published, ...] = (
    _row("Qwen/Qwen3-8B", 0.0, 6.55, 7.87, 7.48, 7.31, 6.55, 6.00, 7.12, 3.69, 4.25, 3.16),
    _row("Qwen/Qwen3-4B", 0.0, 6.50, 7.84, 7.47, 7.28, 6.63, 6.19, 6.97, 3.70, 4.35, 3.10),
    _row("Qwen/Qwen3-8B", 1.0, 6.04, 6.57, 5.06, 5.03, 5.40, 5.17, 6.79, 2.82, 3.74, 2.88),
    _row("Qwen/Qwen3-4B", 1.0, 5.98, 6.67, 4.97, 5.01, 6.05, 5.55, 6.60, 3.09, 4.03, 2.99),
)


def _names(path: str, config: t.Any) -> list[str]:
    """Candidate model names for a target folder, best first."""
    parts = PurePath(path).parts
    out = [p.split("--", 2)[2] for p in parts if p.startswith("models--") and p.count("--") >= 2]
    if len(parts) >= 2 and parts[-2] == "snapshots":
        pass  # the sha: the name is the models--ORG--NAME folder above it, taken already
    elif parts:
        out.append(parts[-1])
    name_or_path = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if isinstance(name_or_path, str) and name_or_path:
        out.append(PurePath(name_or_path).name)
    return out


def identify_target(path: str | None, config: t.Any) -> str | None:
    """The published target (``"Qwen/Qwen3-8B"``) this folder and config are, or None (module doc)."""
    if not path:
        return None
    for name in _names(path, config):
        for target, shape in TARGET_SHAPES.items():
            if name.lower() != target.split("/")[1].lower():
                continue
            text = config.get_text_config() if hasattr(config, "get_text_config") else config
            have = tuple(getattr(text, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
            return target if have == shape else None
    return None


def figure(target: str | None, block_size: int, temperature: float, suite: str) -> tuple[float, Published] | None:
    """The published tau of ``suite`` for that target, block size and temperature, or None."""
    if target is None:
        return None
    for row in PUBLISHED:
        if (row.target, row.block_size, row.temperature) == (target, block_size, float(temperature)):
            tau = row.tau.get(suite)
            return (tau, row) if tau is not None else None
    return None
