"""Replica averaging on CPU, one tensor slice at a time (Local SGD).

Every replica's trainable tensors (the fp32 master weights when the model trains in bf16) are averaged
element-wise and written back to every replica, through three preallocated CPU fp32 buffers of at most
``chunk_numel`` elements each (pinned when CUDA is there, so the copies run at full speed). Peak extra
memory is those three buffers -- a slice of one tensor -- never a model copy and never anything on a GPU.
The mean is taken as ``r0 + sum(r_i - r0) / n``: replicas that are already identical come back bit for bit
unchanged.

Frozen weights (the target's embedding and lm_head, held by every drafter replica) are never handed to
the averager, so they are never touched.

Optimizer state: each replica keeps its own AdamW moments (as Local SGD / torch's PeriodicModelAverager
do); only the weights are averaged. Averaging the moments would cost a second and third pass over the
model for no measured gain, and resetting them would restart the bias correction every interval.

The caller guarantees no replica is mid-step (the pipeline's barrier).
"""

from __future__ import annotations

import typing as t

import torch

DEFAULT_CHUNK = 1 << 24  # elements: 64 MiB per fp32 buffer


class Averager:
    """Averages lists of same-shaped tensors (one list per replica) in place, through CPU buffers."""

    def __init__(self, max_numel: int, *, chunk_numel: int = DEFAULT_CHUNK, pin: bool | None = None) -> None:
        n = max(1, min(max_numel, chunk_numel))
        pin = torch.cuda.is_available() if pin is None else pin
        self.chunk = n
        self.base = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.stage = torch.empty(n, dtype=torch.float32, pin_memory=pin)
        self.delta = torch.empty(n, dtype=torch.float32, pin_memory=pin)

    @property
    def buffer_bytes(self) -> int:
        return 3 * self.chunk * 4

    @classmethod
    def for_replicas(cls, replicas: t.Sequence[t.Sequence[torch.Tensor]], **kw: t.Any) -> Averager:
        largest = max((p.numel() for rep in replicas for p in rep), default=1)
        return cls(largest, **kw)

    @torch.no_grad()
    def average(self, replicas: t.Sequence[t.Sequence[torch.Tensor]]) -> None:
        """``replicas[r][k]``: tensor k of replica r. Every tensor k ends up equal to the mean over r."""
        if len(replicas) < 2:
            return
        count = len(replicas[0])
        for r, rep in enumerate(replicas):
            if len(rep) != count:
                raise ValueError(f"replica {r} has {len(rep)} tensors, replica 0 has {count}")
        for k in range(count):
            group = [rep[k] for rep in replicas]
            shape = group[0].shape
            for r, p in enumerate(group):
                if p.shape != shape:
                    raise ValueError(f"tensor {k}: replica {r} has shape {tuple(p.shape)}, replica 0 {tuple(shape)}")
            flats = [_flat(p) for p in group]
            numel = group[0].numel()
            for a in range(0, numel, self.chunk):
                b = min(numel, a + self.chunk)
                self._average_slice([f[a:b] for f in flats])
            for p, f in zip(group, flats):
                if f.data_ptr() != p.data_ptr() or not p.is_contiguous():
                    p.copy_(f.view(shape))

    def _average_slice(self, parts: list[torch.Tensor]) -> None:
        m = parts[0].numel()
        base, stage, delta = self.base[:m], self.stage[:m], self.delta[:m]
        base.copy_(parts[0])
        delta.zero_()
        for p in parts[1:]:
            stage.copy_(p)
            delta.add_(stage.sub_(base))
        base.add_(delta, alpha=1.0 / len(parts))
        for p in parts:
            p.copy_(base)


def _flat(p: torch.Tensor) -> torch.Tensor:
    # Parameters are contiguous, so this is a view and the slices write straight into the replica.
    return p.view(-1) if p.is_contiguous() else p.reshape(-1).clone()


def average_modules(modules: t.Sequence[torch.nn.Module], averager: Averager | None = None) -> None:
    """Average the trainable parameters (requires_grad) of same-structured modules; frozen ones untouched."""
    replicas = [[p for p in m.parameters() if p.requires_grad] for m in modules]
    (averager or Averager.for_replicas(replicas)).average(replicas)


__all__ = ["Averager", "DEFAULT_CHUNK", "average_modules"]
