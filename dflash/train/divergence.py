"""Divergence: an update whose loss or gradient norm is not finite, and a loss spike short of that.

Every drafter update computes, on its device, a code of what went bad (``nonfinite_code``: 0 finite,
1 the loss, 2 the gradient norm) and hands it to AdamW as ``found_inf`` (the fused kernel's own skip, the
one ``torch.amp.GradScaler`` uses): a non-finite update never reaches the weights, and no host sync is
added (with Muon, which has no such input, one host read per update decides: ``dflash.train.optimizer``).
The codes are read with the step's other figures, where the step line reads them (``dflash.train.metrics``),
and at every checkpoint barrier before anything is written (``Run.save``). There the ``NonfiniteGuard``
applies ``[train] on_nonfinite``: ``"stop"`` (the default) ends the run with ``Diverged`` (exit 3, one line,
no checkpoint); ``"skip"`` counts the skipped update (a ``nonfinite-skip`` record) and stops after
``nonfinite_limit`` in a row. ``LossSpike`` watches the finite losses: ``spike_steps`` steps in a row above
``spike_factor`` x the median of the last ``spike_window`` is a warning line and a ``loss-spike`` record,
never a stop.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
import typing as t

import torch

from dflash.errors import EXIT_DIVERGED, DflashError

# What a step's code says went bad (a float on the device, read with the step's figures).
FINITE = 0
BAD_LOSS = 1
BAD_GRAD_NORM = 2
FIGURES = {BAD_LOSS: "loss", BAD_GRAD_NORM: "grad-norm"}
AVERAGED = "averaged weights"
WEIGHTS = "weights"


class Diverged(DflashError):
    """A non-finite update (or weights) stopped the run: one line, exit 3, no checkpoint written after it.

    The line (dflashctl's probe reads it: keep its form)::

        dflash: diverged at step 7: loss not finite; last finite checkpoint: /r/checkpoints/step-5 (step 5)
    """

    exit_code = EXIT_DIVERGED
    traceback = False
    fatal = True  # the pipeline stops every worker, not only the one that raised

    def __init__(self, step: int, figure: str, last_finite: str, why: str = "") -> None:
        self.step = step
        self.figure = figure
        self.last_finite = last_finite
        self.why = why
        super().__init__(self.line())

    def line(self) -> str:
        why = f" ({self.why})" if self.why else ""
        return (
            f"dflash: diverged at step {self.step}: {self.figure} not finite{why}; "
            f"last finite checkpoint: {self.last_finite}"
        )


def nonfinite_code(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor:
    """0 (finite), 1 (the loss is NaN/inf) or 2 (the gradient norm is): a float32 0-dim tensor on the
    loss's device, computed there (no host sync)."""
    bad_loss = ~torch.isfinite(loss.detach())
    code = bad_loss.to(torch.float32) * BAD_LOSS
    if grad_norm is not None:
        bad_norm = ~torch.isfinite(grad_norm.detach().to(loss.device))
        code = torch.where(bad_loss, code, bad_norm.to(torch.float32) * BAD_GRAD_NORM)
    return code.reshape(())


def all_finite(tensors: t.Iterable[torch.Tensor]) -> bool:
    """Every element of every tensor is finite (one host read per device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for x in tensors:
        if x.is_floating_point() or x.is_complex():
            by_device.setdefault(x.device, []).append(torch.isfinite(x.detach()).all())
    return all(bool(torch.stack(flags).all()) for flags in by_device.values())


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """What the guard made of a bad step: a skip to record (the run goes on)."""

    step: int
    figure: str
    in_row: int
    total: int

    def record(self) -> dict[str, t.Any]:
        return {"event": "nonfinite-skip", "step": self.step, "figure": self.figure, "in_row": self.in_row,
                "skipped": self.total}  # fmt: skip

    def line(self) -> str:
        return (
            f"step {self.step}: {self.figure} not finite; update skipped "
            f"({self.in_row} in a row, {self.total} in this attempt)"
        )


class NonfiniteGuard:
    """``on_nonfinite``: "stop" raises ``Diverged`` at the first bad step; "skip" counts and raises after
    ``limit`` bad steps in a row. ``last_finite()`` names the last finite checkpoint for the line."""

    def __init__(self, mode: str, limit: int, last_finite: t.Callable[[], str]) -> None:
        self.mode = mode
        self.limit = limit
        self.last_finite = last_finite
        self.in_row = 0
        self.total = 0

    def finite(self) -> None:
        self.in_row = 0

    def bad(self, step: int, code: float) -> Verdict:
        figure = FIGURES.get(int(code), "loss")
        if self.mode != "skip":
            raise Diverged(step, figure, self.last_finite())
        self.in_row += 1
        self.total += 1
        if self.in_row >= self.limit:
            raise Diverged(step, figure, self.last_finite(), f"{self.in_row} updates in a row skipped")
        return Verdict(step, figure, self.in_row, self.total)


@dataclasses.dataclass(frozen=True, slots=True)
class Spike:
    step: int
    loss: float
    median: float
    factor: float
    steps: int

    def record(self) -> dict[str, t.Any]:
        return {"event": "loss-spike", "step": self.step, "loss": round(self.loss, 6),
                "median": round(self.median, 6), "factor": self.factor, "steps": self.steps}  # fmt: skip

    def line(self) -> str:
        return (
            f"loss spike at step {self.step}: loss {self.loss:.3f} above {self.factor:g} x the running "
            f"median {self.median:.3f} for {self.steps} steps"
        )


class LossSpike:
    """``steps`` finite losses in a row above ``factor`` x the median of the last ``window`` before them:
    one ``Spike`` per episode (the next needs a loss back under the bar first). A spike's own losses stay
    out of the window (a long spike does not raise its own bar); an excursion too short to be one joins it."""

    def __init__(self, *, factor: float, steps: int, window: int) -> None:
        self.factor = factor
        self.steps = steps
        self.window: collections.deque[float] = collections.deque(maxlen=window)
        self._sorted: list[float] = []
        self._above: list[float] = []
        self._told = False

    def median(self) -> float | None:
        s = self._sorted
        if len(s) < min(self.steps, self.window.maxlen or 1):
            return None
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

    def _push(self, loss: float) -> None:
        if len(self.window) == self.window.maxlen:
            old = self.window[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self.window.append(loss)
        bisect.insort(self._sorted, loss)

    def observe(self, step: int, loss: float) -> Spike | None:
        if not self.factor or not math.isfinite(loss):
            return None
        med = self.median()
        if med is not None and med > 0 and loss > self.factor * med:
            self._above.append(loss)
            if len(self._above) >= self.steps and not self._told:
                self._told = True
                return Spike(step, loss, med, self.factor, len(self._above))
            return None
        if not self._told:  # a short excursion joins the window; a told spike's losses do not raise the bar
            for x in self._above:
                self._push(x)
        self._above.clear()
        self._told = False
        self._push(loss)
        return None


__all__ = [
    "AVERAGED",
    "BAD_GRAD_NORM",
    "BAD_LOSS",
    "FIGURES",
    "FINITE",
    "WEIGHTS",
    "Diverged",
    "LossSpike",
    "NonfiniteGuard",
    "Spike",
    "Verdict",
    "all_finite",
    "nonfinite_code",
]
