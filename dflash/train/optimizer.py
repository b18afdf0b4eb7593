"""The drafter replica's optimizer: AdamW on every trainable master, or Muon on the hidden matrices and AdamW
on the rest (``optim.name``).

Muon (``torch.optim.Muon``) orthogonalises each 2-D update by Newton-Schulz; it takes matrices only, so,
as speculators' default does (``split_named_params_for_muon``), it gets the drafter's 2-D weights with both
sides > 1 except embedding-like tables (names with ``embed``, ``lm_head``, ``codebook``: rows indexed by
token, not a linear map) and AdamW gets the rest: norms, biases, DFlash2's codebooks and 3-D conv kernel.

Learning rate: Muon runs with ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's rule, 0.2 x sqrt(max(A, B))),
which scales its update to AdamW's RMS, so ``optim.lr``, its warmup and decay and ``optim.weight_decay``
carry over unchanged; ``optim.muon_lr`` (default: ``optim.lr``) sets Muon's peak apart, on the same
schedule (speculators defaults to 10 x lr with the same rule). Momentum 0.95, Nesterov, 5 Newton-Schulz
steps: torch's defaults, not keys.

A non-finite update never reaches the weights: AdamW alone skips on the device (the fused kernel's
``found_inf``, no host sync); Muon has no such input (and reads a tensor lr on the host anyway), so with
Muon one host read of the step's code decides, and both optimizers skip (Muon's momentum and AdamW's step
count stay as they were).

State: ``state_dict`` is AdamW's own for ``adamw`` (checkpoints as before) and ``{"muon": ..., "adamw":
...}`` for ``muon``; ``kind_of`` tells a saved one apart, so a resume with the other optimizer is refused
in one line rather than loaded into the wrong shapes.
"""

from __future__ import annotations

import typing as t

import torch

from dflash.config import OptimConfig

# devices with a fused AdamW kernel (torch >= 2.4 has CPU and CUDA ones)
FUSED_ADAMW = ("cuda", "cpu")
# 2-D parameters that stay on AdamW: tables indexed by token (speculators' and Keller Jordan's rule)
ADAMW_NAMES = ("embed", "lm_head", "codebook")
MUON_LR_RULE = "match_rms_adamw"


def muon_split(named: t.Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], list[int]]:
    """The indices of ``named`` that go to Muon and those that go to AdamW."""
    muon: list[int] = []
    adamw: list[int] = []
    for i, (name, p) in enumerate(named):
        matrix = p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in ADAMW_NAMES)
        (muon if matrix else adamw).append(i)
    return muon, adamw


def kind_of(state: t.Mapping[str, t.Any]) -> str:
    """Which optimizer wrote ``state`` (a ``DrafterOptimizer.state_dict``)."""
    return "muon" if "muon" in state else "adamw"


class DrafterOptimizer:
    """One update of a replica's fp32 masters by AdamW, or by Muon + AdamW; ``names`` are the masters' names."""

    def __init__(
        self, names: t.Sequence[str], masters: t.Sequence[torch.Tensor], o: OptimConfig, *, device: str
    ) -> None:
        self.name = o.name
        self.lr = o.lr
        self.muon_lr = o.muon_lr if o.muon_lr is not None else o.lr
        # fused: one kernel for all tensors, and the step counters stay on the device (the default
        # for-each/single-tensor paths read them on the host per parameter)
        self.fused = torch.device(device).type in FUSED_ADAMW
        if o.name == "muon":
            muon_idx, adamw_idx = muon_split(list(zip(names, masters)))
        else:
            muon_idx, adamw_idx = [], list(range(len(masters)))
        self.muon_names = [names[i] for i in muon_idx]
        self.adamw: torch.optim.AdamW | None = None
        self.muon: torch.optim.Muon | None = None
        if adamw_idx:
            self.adamw = torch.optim.AdamW(
                [masters[i] for i in adamw_idx],
                lr=o.lr,
                betas=o.betas,
                eps=o.eps,
                weight_decay=o.weight_decay,
                fused=self.fused or None,
                foreach=None if self.fused else True,
            )
        if muon_idx:
            self.muon = torch.optim.Muon(
                [masters[i] for i in muon_idx],
                lr=self.muon_lr,
                weight_decay=o.weight_decay,
                adjust_lr_fn=MUON_LR_RULE,
            )

    def _all(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.muon, self.adamw) if o is not None]

    @property
    def state(self) -> dict[torch.Tensor, t.Any]:
        """Every master's state (AdamW's moments and step, Muon's ``momentum_buffer``)."""
        return {p: s for o in self._all() for p, s in o.state.items()}

    def set_lr(self, lr: float) -> None:
        """The schedule's lr for this step: AdamW's as is, Muon's scaled by ``muon_lr / lr``."""
        for group in self.adamw.param_groups if self.adamw is not None else ():
            group["lr"] = lr
        for group in self.muon.param_groups if self.muon is not None else ():
            group["lr"] = lr * self.muon_lr / self.lr

    def step(self, code: torch.Tensor) -> None:
        """The update, skipped when the step's non-finite ``code`` (``divergence.nonfinite_code``) is not 0."""
        if self.muon is None and self.adamw is not None and self.fused:
            self.adamw.found_inf = (code > 0).to(torch.float32)  # type: ignore[attr-defined]
            self.adamw.step()
        elif not bool(code):  # no device-side skip without fused AdamW alone: one host read
            for o in self._all():
                o.step()

    def zero_grad(self) -> None:
        for o in self._all():
            o.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, t.Any]:
        if self.name == "adamw":
            return self.adamw.state_dict() if self.adamw is not None else {}
        return {o: opt.state_dict() for o, opt in (("muon", self.muon), ("adamw", self.adamw)) if opt is not None}

    def load_state_dict(self, state: t.Mapping[str, t.Any]) -> None:
        if self.name == "adamw":
            if self.adamw is not None:
                self.adamw.load_state_dict(dict(state))
            return
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if opt is not None and key in state:
                opt.load_state_dict(state[key])


__all__ = ["ADAMW_NAMES", "FUSED_ADAMW", "DrafterOptimizer", "kind_of", "muon_split"]
