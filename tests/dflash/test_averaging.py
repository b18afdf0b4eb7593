"""Replica averaging on CPU: exact for identical replicas, the mean for diverged ones, frozen weights untouched.

The CUDA half of the engine (pinned staging, copy streams, events) runs only on a GPU: bench/gpu_smoke.py
checks it there (replicas bit-identical and equal to this CPU path after a round)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from dflash.train.averaging import MIN_SPLIT, Averager, average_modules


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
    assert small.chunk == 7
    small.average(params)
    # CPU replicas are read in place: one fp32 accumulator slice + one scratch block (fp64-sized)
    assert small.buffer_bytes == 7 * 4 + 7 * 8
    assert small.last_round is not None and small.last_round.slices == -(-384 // 7) + 2 * -(-16 // 7)
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
    avg.average(params)
    # on CPU: one fp32 accumulator slice + one fp64-sized scratch block, the seed's bound of 3 fp32 slices
    assert avg.buffer_bytes == largest * 4 + largest * 8 == 3 * largest * 4
    avg.average(params)  # buffers are reused, not grown
    assert avg.buffer_bytes == largest * 4 + largest * 8
    assert avg.last_round is not None and avg.last_round.bytes_moved == 2 * 4 * model_numel * 4


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


def test_mismatched_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"tensor 0: replica 1 has dtype torch.bfloat16, replica 0 torch.float32"):
        Averager(4).average([[torch.zeros(2)], [torch.zeros(2, dtype=torch.bfloat16)]])


def test_host_threads_split_a_slice_into_the_same_result() -> None:
    # Big enough that 2 threads each reduce half (blocks of BLOCK elements), small enough to stay cheap.
    g = torch.Generator().manual_seed(3)
    n = MIN_SPLIT * 2 + 12345
    a = [[torch.randn(n, generator=g), torch.randn(7, generator=g)] for _ in range(3)]
    b = [[x.clone() for x in rep] for rep in a]
    Averager.for_replicas(a, threads=1).average(a)
    two = Averager.for_replicas(b, threads=2)
    two.average(b)
    assert two._pool is not None, "the slice was split across threads"
    two.close()
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            assert torch.equal(x, y)
    assert all(torch.equal(x, y) for x, y in zip(a[0], a[2]))


def test_fp64_and_non_contiguous_tensors() -> None:
    g = torch.Generator().manual_seed(4)
    reps = [[torch.randn(5, 3, dtype=torch.float64, generator=g), torch.randn(3, 4, generator=g).t()] for _ in range(3)]
    mean = [torch.stack([r[k] for r in reps]).mean(0) for k in range(2)]
    Averager.for_replicas(reps, chunk_numel=4).average(reps)
    for r in reps:
        assert r[0].dtype == torch.float64 and not r[1].is_contiguous()
        assert torch.allclose(r[0], mean[0], atol=1e-12) and torch.allclose(r[1], mean[1], atol=1e-6)
        assert torch.equal(r[0], reps[0][0]) and torch.equal(r[1], reps[0][1])


def test_cross_reduce_hook_sees_every_slice_in_order_and_sets_the_global_mean() -> None:
    """The multi-node hook: here a fake "other node" with 2 replicas whose mean is 10 everywhere."""
    calls: list[tuple[int, int]] = []

    def other_node(local_mean: torch.Tensor, count: int) -> None:
        calls.append((local_mean.numel(), count))
        local_mean.mul_(count).add_(torch.full_like(local_mean, 10.0), alpha=2).div_(count + 2)

    models = replicas(3, diverge=True)
    before = [state(m) for m in models]
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    Averager.for_replicas(params, chunk_numel=100, cross_reduce=other_node).average(params)
    assert calls == [(100, 3), (100, 3), (100, 3), (84, 3), (16, 3), (16, 3)]  # fc 384 = 3 x 100 + 84, norm
    for name, p in models[0].named_parameters():
        if p.requires_grad:
            want = (torch.stack([b[name] for b in before]).sum(0) + 20.0) / 5
            for m in models:
                got = dict(m.named_parameters())[name]
                assert torch.allclose(got, want, atol=1e-5), name
                assert torch.equal(got, p), name


def test_a_failing_hook_raises_and_leaves_the_slices_from_its_failure_on_untouched() -> None:
    calls = []

    def broken(local_mean: torch.Tensor, count: int) -> None:
        calls.append(local_mean.numel())
        if len(calls) == 2:
            raise RuntimeError("peer gone")

    models = replicas(3, diverge=True)
    before = [state(m) for m in models]
    params = [[p for p in m.parameters() if p.requires_grad] for m in models]
    with pytest.raises(RuntimeError, match="peer gone"):
        Averager.for_replicas(params, chunk_numel=200, cross_reduce=broken).average(params)
    assert calls == [200, 184]
    fc = [m.fc.weight.view(-1) for m in models]
    assert all(torch.equal(fc[0][:200], w[:200]) for w in fc)  # slice 1: averaged everywhere
    for m, b in zip(models, before):  # slice 2 (the failure) and everything after it: as they were
        assert torch.equal(m.fc.weight.view(-1)[200:], b["fc.weight"].view(-1)[200:])
        for k in ("norm.weight", "norm.bias"):
            assert torch.equal(m.state_dict()[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_slot_staging_pipeline_gives_the_direct_result(dtype: torch.dtype) -> None:
    """CUDA replicas go through two staging slots (gather slice i+1 while reducing slice i); here CPU
    replicas are forced through the same slots, so the bookkeeping (which slot, which buffer) is tested."""
    g = torch.Generator().manual_seed(5)
    direct = [
        [
            torch.randn(23, generator=g).to(dtype),
            torch.randn(3, 5, generator=g).to(dtype),
            torch.randn(9, generator=g).to(dtype),
        ]
        for _ in range(3)
    ]
    staged = [[x.clone() for x in rep] for rep in direct]
    Averager.for_replicas(direct, chunk_numel=4).average(direct)
    avg = Averager.for_replicas(staged, chunk_numel=4)
    avg._stage_host = True
    avg.average(staged)
    assert avg.last_round is not None and avg.last_round.slices == 6 + 4 + 3
    # two slots x (3 staging slices + 1 accumulator) of 4 fp32 elements, + the fp32 path's scratch block
    # (numpy) or the bf16 path's output slice in the replicas' dtype (torch)
    extra = 4 * 8 if dtype == torch.float32 else 2 * 16
    assert avg.buffer_bytes == 2 * (3 + 1) * 16 + extra
    for rd, rs in zip(direct, staged):
        for x, y in zip(rd, rs):
            assert torch.equal(x, y)


def test_one_local_replica_still_takes_the_global_mean_through_the_hook() -> None:
    """A node of a group with a single drafter: its replica is its local mean, and the hook must still run
    (before the node group, a single replica returned early and never met the other nodes)."""
    calls: list[tuple[int, int]] = []

    def other_node(local_mean: torch.Tensor, count: int) -> None:
        calls.append((local_mean.numel(), count))
        local_mean.mul_(count).add_(torch.full_like(local_mean, 10.0), alpha=3).div_(count + 3)

    (model,) = replicas(1, diverge=True)
    before = state(model)
    params = [[p for p in model.parameters() if p.requires_grad]]
    Averager.for_replicas(params, chunk_numel=100, cross_reduce=other_node).average(params)
    assert calls == [(100, 1), (100, 1), (100, 1), (84, 1), (16, 1), (16, 1)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p, (before[name] + 30.0) / 4, atol=1e-5), name
    assert torch.equal(model.head.weight, before["head.weight"])  # frozen: never handed to the averager
