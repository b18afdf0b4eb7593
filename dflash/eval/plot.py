"""`dflash eval --plot FILE.png [--compare BEFORE.json]`: acceptance by position and the histogram of
accepted drafts per verify step, for one report or two side by side (before / after).

Reads the keys of ``EvalReport.to_json`` (dflash/eval/evaluate.py): ``position_acceptance``,
``accept_histogram``, ``tau``, ``step``, ``untrained``, ``drafter``, ``protocol`` (a one-line warning when
the two reports were measured differently). matplotlib is the ``[plot]`` extra.
"""

from __future__ import annotations

import json
import math
import os
import typing as t

from dflash import inputs, outputs
from dflash.errors import DflashError

EXTRA = "pip install 'dflash[plot]'"
FORMATS = (".png", ".svg")


class PlotError(DflashError):
    """Cannot draw: matplotlib missing, an output format we do not write, an unreadable report (exit 1)."""

    traceback = False


def require_matplotlib() -> t.Any:
    try:  # the optional [plot] extra
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(f"drawing needs matplotlib, which is not installed: {EXTRA}") from None
    return plt


def check_out(out: str) -> None:
    """A format we draw, in a place that takes the file (``outputs.check_out``): said before the eval."""
    if os.path.splitext(out)[1].lower() not in FORMATS:
        raise PlotError(f"--plot {out}: expected a file ending in {', '.join(FORMATS)}")
    outputs.check_out(out, what="eval: --plot", kind="file")


def _numbers(v: t.Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v
    )


def load_report(path: str) -> dict[str, t.Any]:
    """A report `dflash eval --json` wrote (``inputs.read_json``: bounded, finite); one clear line when it is
    not one, or when a figure drawn from it is not a number."""
    try:
        rep = inputs.read_json(path, "--compare")
    except inputs.InputFileError as e:
        raise PlotError(str(e)) from None
    if not isinstance(rep, dict) or not all(k in rep for k in ("position_acceptance", "accept_histogram", "tau")):
        raise PlotError(
            f"--compare {path}: not a `dflash eval --json` report (no position_acceptance, accept_histogram, tau)"
        )
    for key in ("position_acceptance", "accept_histogram"):
        if not _numbers(rep[key]):
            raise PlotError(f"--compare {path}: {key} is not a list of numbers")
    if not _numbers([rep["tau"]]):
        raise PlotError(f"--compare {path}: tau is {json.dumps(rep['tau'])[:40]}, not a number")
    return rep


# what makes two reports' figures comparable; the prompts by content, not by path
PROTOCOL_KEYS = (
    "prompt_format",
    "chat_template_sha256",
    "chat_template_kwargs",
    "tokenizer_sha256",
    "prompts_sha256",
    "num_prompts",
    "max_new_tokens",
    "stop_at_eos",
    "stop_token_ids",
    "decoding",
    "temperature",
    "block_size",
    "target_dtype",
    "drafter_dtype",
)


def protocol_diff(before: t.Mapping[str, t.Any], after: t.Mapping[str, t.Any]) -> list[str]:
    """``key a -> b`` for each protocol key whose values differ."""

    def show(v: t.Any) -> str:
        s = json.dumps(v, sort_keys=True)
        return s[1:13] if isinstance(v, str) and len(v) == 64 else s  # a sha256: its first 12 digits

    return [
        f"{k} {show(before.get(k))} -> {show(after.get(k))}" for k in PROTOCOL_KEYS if before.get(k) != after.get(k)
    ]


def protocol_warning(before: t.Mapping[str, t.Any], after_protocol: t.Mapping[str, t.Any], path: str) -> str | None:
    """One line when the earlier report (``--compare``) was not measured as this one is, else None."""
    proto = before.get("protocol")
    if not isinstance(proto, dict) or not proto:
        return (
            f"dflash: warning: --compare {path} records no protocol (an older dflash eval wrote it): "
            "the two reports may not be comparable"
        )
    diff = protocol_diff(proto, after_protocol)
    if not diff:
        return None
    return f"dflash: warning: --compare {path} was measured differently ({'; '.join(diff)}): tau is not comparable"


def label(rep: t.Mapping[str, t.Any]) -> str:
    who = (
        "untrained"
        if rep.get("untrained")
        else f"step {rep['step']}"
        if rep.get("step") is not None
        else os.path.basename(str(rep.get("drafter") or "drafter"))
    )
    return f"{who}: tau {float(rep['tau']):.2f}"


def series(reps: t.Sequence[t.Mapping[str, t.Any]]) -> list[tuple[str, list[float], list[float]]]:
    """Per report: its label, acceptance at positions 1..B-1, and the share of verify steps that
    accepted 0..B-1 drafts (what is drawn)."""
    out = []
    for rep in reps:
        hist = [float(n) for n in rep["accept_histogram"]]
        total = sum(hist) or 1.0
        out.append((label(rep), [float(a) for a in rep["position_acceptance"]], [n / total for n in hist]))
    return out


def draw(out: str, reps: t.Sequence[t.Mapping[str, t.Any]]) -> None:
    """Two panels; each holds every report (before first), so before/after stand side by side."""
    check_out(out)
    plt = require_matplotlib()
    rows = series(reps)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    n = len(rows)
    width = 0.8 / max(n, 1)
    for i, (name, acc, share) in enumerate(rows):
        left.plot(range(1, len(acc) + 1), acc, "o-", label=name)
        right.bar([k - 0.4 + width * (i + 0.5) for k in range(len(share))], share, width=width, label=name)
    left.set(
        title="acceptance by position",
        xlabel="draft position k (1 = first drafted token)",
        ylabel="P(accepted through k)",
        ylim=(0, 1.02),
    )
    right.set(title="accepted drafts per verify step", xlabel="drafts accepted", ylabel="share of verify steps")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if n == 2:
        fig.suptitle(f"before / after: tau {float(reps[0]['tau']):.2f} -> {float(reps[1]['tau']):.2f}")
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=80)
    except OSError as e:  # checked before the eval; a disk that filled since is still one line
        raise PlotError(f"--plot {out}: cannot write it: {e.strerror or e}") from None
    finally:
        plt.close(fig)


__all__ = [
    "EXTRA",
    "PROTOCOL_KEYS",
    "PlotError",
    "check_out",
    "draw",
    "load_report",
    "protocol_diff",
    "protocol_warning",
    "require_matplotlib",
    "series",
]
