"""`dflash eval --plot FILE.png [--compare BEFORE.json]`: acceptance by position and the histogram of
accepted drafts per verify step, for one report or two side by side (before / after).

Reads the keys of ``EvalReport.to_json`` (dflash/evaluate.py): ``position_acceptance``,
``accept_histogram``, ``tau``, ``step``, ``untrained``, ``drafter``. matplotlib is the ``[plot]`` extra.
"""

from __future__ import annotations

import json
import os
import typing as t

EXTRA = "pip install 'dflash[plot]'"
FORMATS = (".png", ".svg")


class PlotError(Exception):
    """Cannot draw: matplotlib missing, an output format we do not write, an unreadable report."""


def require_matplotlib() -> t.Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(f"drawing needs matplotlib, which is not installed: {EXTRA}") from None
    return plt


def check_out(out: str) -> None:
    if os.path.splitext(out)[1].lower() not in FORMATS:
        raise PlotError(f"--plot {out}: expected a file ending in {', '.join(FORMATS)}")


def load_report(path: str) -> dict[str, t.Any]:
    """A report `dflash eval --json` wrote; one clear line when it is not one."""
    try:
        with open(path) as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        raise PlotError(f"--compare {path}: cannot read an eval report: {e}") from None
    if not isinstance(rep, dict) or not all(k in rep for k in ("position_acceptance", "accept_histogram", "tau")):
        raise PlotError(f"--compare {path}: not a `dflash eval --json` report (no position_acceptance, "
                        "accept_histogram, tau)")
    return rep


def label(rep: t.Mapping[str, t.Any]) -> str:
    who = "untrained" if rep.get("untrained") else f"step {rep['step']}" if rep.get("step") is not None else \
        os.path.basename(str(rep.get("drafter") or "drafter"))
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
    left.set(title="acceptance by position", xlabel="draft position k (1 = first drafted token)",
             ylabel="P(accepted through k)", ylim=(0, 1.02))
    right.set(title="accepted drafts per verify step", xlabel="drafts accepted", ylabel="share of verify steps")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if n == 2:
        fig.suptitle(f"before / after: tau {float(reps[0]['tau']):.2f} -> {float(reps[1]['tau']):.2f}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


__all__ = ["EXTRA", "PlotError", "check_out", "draw", "load_report", "require_matplotlib", "series"]
