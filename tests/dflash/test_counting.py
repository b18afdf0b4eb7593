"""The two counting rules of tau (``spec_decode.step_credits``) on constructed acceptance sequences, and
the seeded sampler of the T > 0 rows: pure functions, no model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash.eval.spec_decode import Sampler, step_credits


def test_a_last_block_past_the_budget_counts_whole_only_for_zlab() -> None:
    # anchors at new tokens 0, 4, 8; the budget of 10 ends at token 9: the third step commits one token
    assert step_credits([3, 3, 7], max_new=10, stop_at=None, rule="dflash") == [4, 4, 1]
    assert step_credits([3, 3, 7], max_new=10, stop_at=None, rule="zlab") == [4, 4, 8]


def test_zlab_runs_a_step_when_only_the_anchor_is_left() -> None:
    # anchor 8 is the budget's last token (max_new 9): z-lab still drafts, verifies and counts a block
    assert step_credits([3, 3, 5], max_new=9, stop_at=None, rule="zlab") == [4, 4, 6]
    assert step_credits([3, 3], max_new=9, stop_at=None, rule="dflash") == [4, 4]


def test_the_stop_step_counts_drafts_accepted_past_eos_only_for_zlab() -> None:
    # EOS is new token 6, inside step 1's accepted block (tokens 5..10)
    assert step_credits([3, 5, 2], max_new=64, stop_at=6, rule="dflash") == [4, 2]
    assert step_credits([3, 5, 2], max_new=64, stop_at=6, rule="zlab") == [4, 6]


def test_eos_from_the_prefill() -> None:
    assert step_credits([2, 1], max_new=64, stop_at=0, rule="dflash") == []
    assert step_credits([2, 1], max_new=64, stop_at=0, rule="zlab") == [3]  # its loop looks after a step


def test_a_bad_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="rule"):
        step_credits([1], max_new=4, stop_at=None, rule="specforge")


# no timing in a test: a loaded 2-core machine draws slowly, which says nothing about the rule
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    accepted=st.lists(st.integers(0, 15), min_size=1, max_size=40),
    max_new=st.integers(1, 200),
    stop=st.one_of(st.none(), st.integers(0, 300)),
)
def test_dflash_credits_add_up_to_the_output_and_zlab_credits_never_less(
    accepted: list[int], max_new: int, stop: int | None
) -> None:
    committed = sum(a + 1 for a in accepted)  # new tokens after the first that the steps wrote
    stop_at = stop if stop is not None and stop <= committed else None
    end = max_new - 1 if stop_at is None else min(max_new - 1, stop_at)
    ours = step_credits(accepted, max_new=max_new, stop_at=stop_at, rule="dflash")
    zlab = step_credits(accepted, max_new=max_new, stop_at=stop_at, rule="zlab")
    assert sum(ours) == min(end, committed)  # tokens per target forward, the output's own count
    assert all(c >= 1 for c in ours) and all(c >= 1 for c in zlab)
    assert len(zlab) >= len(ours) and all(z >= o for z, o in zip(zlab, ours))


def test_sampler_draws_from_the_softmax_at_temperature() -> None:
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5]])
    for temperature in (1.0, 0.5):
        sampler = Sampler(temperature, seed=3)
        draws = torch.cat([sampler.pick(logits, k) for k in range(4000)])
        freq = torch.bincount(draws, minlength=4).float() / 4000
        assert torch.allclose(freq, torch.softmax(logits[0] / temperature, -1), atol=0.03), freq


def test_sampler_draws_depend_on_seed_stream_and_position_only() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    a = Sampler(1.0, seed=7, stream=2)
    block = a.pick(logits, 10)  # six positions scored at once, as a verify forward scores them
    one_by_one = torch.cat([a.pick(logits[j : j + 1], 10 + j) for j in range(6)])
    assert torch.equal(block, one_by_one)
    assert torch.equal(block, Sampler(1.0, seed=7, stream=2).pick(logits, 10))
    others = [Sampler(1.0, seed=8, stream=2).pick(logits, 10), Sampler(1.0, seed=7, stream=3).pick(logits, 10)]
    assert all(not torch.equal(block, o) for o in others)
    with pytest.raises(ValueError, match="T > 0"):
        Sampler(0.0)
