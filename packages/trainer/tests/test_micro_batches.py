"""Token-budget micro-batches: every sample exactly once, each micro-batch within the budget, the
counts balanced and equal over data-parallel ranks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer import micro_batches as mbs

lengths_st = st.lists(st.integers(2, 300), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, parts=st.integers(1, 60))
def test_balanced_partition_covers_every_item_once_in_non_empty_groups(
    lengths: list[int], parts: int
) -> None:
    parts = min(parts, len(lengths))
    groups = mbs.balanced_partition(lengths, parts)
    assert len(groups) == parts
    assert all(groups)
    assert all(g == sorted(g) for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert sums == sorted(sums, reverse=True)
    # Largest differencing never leaves a spread wider than the largest item.
    assert max(sums) - min(sums) <= max(lengths)
    assert mbs.balanced_partition(lengths, parts) == groups  # deterministic


def test_balanced_partition_balances_better_than_consecutive_chunks() -> None:
    # Sorted long to short, as a rollout's responses may come: consecutive chunks of three sum to
    # 570, 300, 180 and 90 tokens; the balanced groups are within 10 of the mean, 285.
    lengths = [200, 190, 180, 170, 60, 70, 80, 90, 10, 20, 30, 40]
    groups = mbs.balanced_partition(lengths, 4)
    sums = sorted(sum(lengths[i] for i in g) for g in groups)
    assert sums[-1] - sums[0] <= 10, sums
    with pytest.raises(ValueError, match="parts=0"):
        mbs.balanced_partition(lengths, 0)


@settings(max_examples=80, deadline=None)
@given(lengths=lengths_st, budget=st.integers(300, 3000), padded=st.booleans(), at_least=st.integers(1, 8))
def test_plan_fits_the_budget_with_few_micro_batches(
    lengths: list[int], budget: int, padded: bool, at_least: int
) -> None:
    groups = mbs.plan(lengths, budget, padded, at_least=at_least)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(mbs.cost(lengths, g, padded) <= budget for g in groups)
    assert len(groups) >= min(len(lengths), max(at_least, math.ceil(sum(lengths) / budget)))
    if not padded and at_least == 1:
        # Balanced, not greedy: at most one more micro-batch than the largest-first packing needs
        # (verl's count, ceil(tokens / budget), when every part fits it).
        assert len(groups) <= 2 * math.ceil(sum(lengths) / budget) + 1


def test_plan_refuses_a_sample_over_the_budget_and_handles_empty() -> None:
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch=100.*longest"):
        mbs.plan([50, 101], 100, padded=False)
    with pytest.raises(ValueError, match=">= 1"):
        mbs.plan([5], 0, padded=False)
    assert mbs.plan([], 10, padded=True) == []


def test_padded_cost_counts_the_padding() -> None:
    lengths = [100, 10, 10, 10]
    assert mbs.cost(lengths, [0, 1, 2, 3], padded=False) == 130
    assert mbs.cost(lengths, [0, 1, 2, 3], padded=True) == 400
    assert all(mbs.cost(lengths, g, True) <= 200 for g in mbs.plan(lengths, 200, padded=True))


def test_global_max_over_ranks_through_a_sum() -> None:
    # Three ranks' one-hot slots, summed as an all-reduce would.
    values = [3, 7, 5]

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        total = torch.zeros_like(t)
        for rank, v in enumerate(values):
            total[rank] += v
        return total

    assert mbs.global_max(3, 0, 3, all_reduce) == 7
    assert mbs.global_max(9, 0, 1, all_reduce) == 9


def test_split_by_tokens_takes_the_ranks_count_and_maps_rows() -> None:
    rows = [10, 11, 12, 13, 14, 15]
    lengths = [40, 40, 40, 40, 40, 40]
    own = mbs.split_by_tokens(rows, lengths, 120, padded=False)
    assert len(own) == 2
    assert sorted(r for g in own for r in g) == rows
    more = mbs.split_by_tokens(rows, lengths, 120, padded=False, count_over_ranks=lambda n: 5)
    assert len(more) == 5
    assert sorted(r for g in more for r in g) == rows
