"""Replica averaging on CPU: exact for identical replicas, the mean for diverged ones, frozen weights untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dflash.averaging import Averager, average_modules


class Replica(nn.Module):
    """Trainable layers plus a frozen "target head", like a drafter replica holding the target's head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 16, bias=False)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 40)
        self.head.requires_grad_(False)


def replicas(n: int, *, diverge: bool, seed: int = 0) -> list[Replica]:
    torch.manual_seed(seed)
    base = Replica()
    out = [copy.deepcopy(base) for _ in range(n)]
    if diverge:
        g = torch.Generator().manual_seed(seed + 1)
        for m in out:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g))  # frozen ones too: each replica's head differs
    return out


def state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("n", [2, 3, 5])
def test_identical_replicas_stay_bit_identical(n: int) -> None:
    models = replicas(n, diverge=False)
    before = state(models[0])
    average_modules(models)
    for m in models:
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k  # equal, not close: r0 + sum(r_i - r0)/n with r_i == r0


def test_diverged_replicas_become_their_mean_and_frozen_weights_stay() -> None:
    models = replicas(3, diverge=True)
    before = [state(m) for m in models]
    average_modules(models)
    for name, p in models[0].named_parameters():
        if p.requires_grad:
            mean = torch.stack([b[name] for b in before]).mean(0)
            for m in models:
                got = dict(m.named_parameters())[name]
                assert torch.allclose(got, mean, atol=1e-6), name
                assert torch.equal(got, dict(models[0].named_parameters())[name]), "all replicas hold the same bits"
    for r, m in enumerate(models):
        for name in ("head.weight", "head.bias"):
            assert torch.equal(m.state_dict()[name], before[r][name]), f"frozen {name} of replica {r} was touched"


def test_chunked_buffers_give_the_same_result() -> None:
    whole, chunked = replicas(3, diverge=True), replicas(3, diverge=True)
    average_modules(whole)
    params = [[p for p in m.parameters() if p.requires_grad] for m in chunked]
    small = Averager.for_replicas(params, chunk_numel=7)  # slices of 7 elements through tensors of 384
    assert small.chunk == 7 and small.buffer_bytes == 3 * 7 * 4
    small.average(params)
    for a, b in zip(whole, chunked):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), name


def test_buffers_hold_one_tensor_not_a_model() -> None:
    models = replicas(4, diverge=True)
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    avg = Averager.for_replicas(params)
    largest = max(p.numel() for p in params[0])
    model_numel = sum(p.numel() for p in params[0])
    assert avg.chunk == largest < model_numel
    assert avg.buffer_bytes == 3 * largest * 4


def test_bf16_replicas_are_averaged_in_fp32() -> None:
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125, 2.0, 3.0], dtype=torch.bfloat16)  # one bf16 ulp above 1.0
    c = torch.tensor([1.0078125, 2.0, 3.0], dtype=torch.bfloat16)
    Averager(3).average([[a], [b], [c]])
    # fp32 mean 1.0052 rounds to the nearest bf16 (1.0078125); summing in bf16 would have lost it
    assert a.tolist() == b.tolist() == c.tolist() == [1.0078125, 2.0, 3.0]


def test_mismatched_replicas_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor 0: replica 1 has shape \(3,\), replica 0 \(2,\)"):
        Averager(4).average([[torch.zeros(2)], [torch.zeros(3)]])
    with pytest.raises(ValueError, match="replica 1 has 2 tensors, replica 0 has 1"):
        Averager(4).average([[torch.zeros(2)], [torch.zeros(2), torch.zeros(2)]])


def test_one_replica_is_left_alone() -> None:
    x = torch.randn(5)
    before = x.clone()
    Averager(5).average([[x]])
    assert torch.equal(x, before)
