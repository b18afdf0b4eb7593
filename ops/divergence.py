"""What dflash train says in its log when training diverges, read by the probe and the supervisor. stdlib only.

- the one line a non-finite update ends the run with (``dflash.train.divergence.Diverged.line``, exit 3)::

      dflash: diverged at step 7: loss not finite; last finite checkpoint: /r/checkpoints/step-5 (step 5)

- the warning of a loss far above its running median (``dflash.train.divergence.Spike.line``), never a stop::

      loss spike at step 40: loss 9.500 above 3 x the running median 2.000 for 20 steps
"""

from __future__ import annotations

import re
import typing as t

_DIVERGED = re.compile(
    r"dflash: (?P<what>diverged at step (?P<step>\d+): (?P<figure>[a-z -]+?) not finite.*?; "
    r"last finite checkpoint: (?P<last>.+?))\s*$"
)
_SPIKE = re.compile(r"(?P<what>loss spike at step (?P<step>\d+): .+?)\s*$")
_LAST = re.compile(r"last finite checkpoint: (.+)$")


def diverged_line(lines: t.Sequence[str]) -> tuple[str, str] | None:
    """The last diverged line of a log tail: (what it says without ``dflash: ``, the line), or None."""
    for line in reversed(lines):
        m = _DIVERGED.search(line)
        if m:
            return m.group("what"), m.group(0)
    return None


def loss_spikes(lines: t.Sequence[str]) -> list[tuple[int, str]]:
    """The loss-spike warnings of a log tail: (step, what it says), oldest first."""
    return [(int(m.group("step")), m.group("what")) for m in map(_SPIKE.search, lines) if m]


def last_finite_checkpoint(detail: str | None) -> str | None:
    """The checkpoint a diverged line names as the last finite one (None: ``none``, or no such line)."""
    m = _LAST.search(detail or "")
    return m.group(1).strip() if m and m.group(1).strip() != "none" else None
