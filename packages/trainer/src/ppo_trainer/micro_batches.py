"""Micro-batches by token budget (``train.max_tokens_per_micro_batch``), balanced by token count.

A fixed number of samples per micro-batch makes small forwards of short samples (a 135M model at
8 x 80 tokens keeps an H200 busy with kernel launches) and large ones of long samples. A token budget
instead fills each forward with about the same work: the samples of a mini-batch are cut into the
fewest micro-batches that each fit the budget, balanced so that their token counts are close.

The partition is the Karmarkar-Karp largest differencing method, as verl's
``get_seqlen_balanced_partitions`` / ``rearrange_micro_batches`` (volcengine/verl,
``verl/utils/seqlen_balancing.py`` at 0d04d640ffa39a1dec7c68d05dc866014ab91304), which starts from
``ceil(tokens / budget)`` parts and takes the largest count over data-parallel ranks. Unlike verl,
the count grows until every part fits the budget (balanced parts may not), and a sample longer than
the budget is a ``ValueError``.

A micro-batch's cost is its real tokens when sequences are packed, and its samples times its longest
sample when they are padded. The loss is unaffected by the split: every micro-batch term is divided
by the count of the whole mini-batch (``TorchTrainer._global_counts``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from ppo_trainer.batch import Samples, chunks
from ppo_trainer.config import TrainSettings

Parts = list[list[int]]


def balanced_partition(weights: Sequence[int], parts: int) -> Parts:
    """Indices of ``weights`` in ``parts`` groups of near-equal weight sums (largest differencing).

    Each group is sorted; groups come heaviest first. Every group is non-empty when the weights are
    positive and ``parts <= len(weights)``. Deterministic: ties break by index.
    """
    if not 1 <= parts <= max(len(weights), 1):
        raise ValueError(f"parts={parts} must be between 1 and the number of items ({len(weights)})")
    order = itertools.count()
    # A state: ``parts`` groups (sum, indices), heaviest first; the heap pops the widest spread first.
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for index, weight in sorted(enumerate(weights), key=lambda item: (item[1], item[0])):
        groups = [(int(weight), [index])] + [(0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-int(weight), next(order), groups))
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        # The heaviest group of one state takes the lightest of the other: their difference cancels.
        merged = [(a + b, ia + ib) for (a, ia), (b, ib) in zip(first, reversed(second), strict=True)]
        merged.sort(key=lambda group: group[0], reverse=True)
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], next(order), merged))
    if not heap:
        return [[] for _ in range(parts)]
    return [sorted(indices) for _, indices in heap[0][2]]


def cost(lengths: Sequence[int], part: Sequence[int], padded: bool) -> int:
    """Tokens a forward over ``part`` computes: the real ones packed, samples x longest padded."""
    if not part:
        return 0
    if padded:
        return len(part) * max(lengths[i] for i in part)
    return sum(lengths[i] for i in part)


def plan(lengths: Sequence[int], max_tokens: int, padded: bool, at_least: int = 1) -> Parts:
    """Positions in ``lengths`` grouped into micro-batches of at most ``max_tokens`` tokens each
    (:func:`cost`), at least ``at_least`` of them where there are that many samples, balanced.

    ``ValueError`` when one sample alone is over the budget.
    """
    if max_tokens < 1:
        raise ValueError(f"train.max_tokens_per_micro_batch={max_tokens} must be >= 1")
    n = len(lengths)
    if n == 0:
        return []
    longest = max(lengths)
    if longest > max_tokens:
        raise ValueError(
            f"a sample of {longest} tokens does not fit train.max_tokens_per_micro_batch={max_tokens}; "
            "raise the budget to at least the longest sample (prompt + response)"
        )
    parts = min(n, max(at_least, math.ceil(sum(lengths) / max_tokens)))
    while True:
        groups = balanced_partition(lengths, parts)
        if parts == n or all(cost(lengths, g, padded) <= max_tokens for g in groups):
            return groups
        parts += 1


def global_max(
    value: int, rank: int, world_size: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
) -> int:
    """The largest ``value`` over data-parallel ranks, through a sum all-reduce (one slot per rank)."""
    if world_size == 1:
        return value
    slots = torch.zeros(world_size, dtype=torch.float64)
    slots[rank] = float(value)
    return int(all_reduce(slots).max().item())


def split_by_tokens(
    rows: Sequence[int],
    lengths: Sequence[int],
    max_tokens: int,
    padded: bool,
    count_over_ranks: Callable[[int], int] = lambda count: count,
) -> Parts:
    """``rows`` (with their token ``lengths``) cut into balanced micro-batches within ``max_tokens``.

    ``count_over_ranks``: the micro-batch count every data-parallel rank will use, given this rank's
    (:func:`global_max` over the ranks): ranks that shard their models run each forward together, so
    all of them run as many micro-batches.
    """
    local = plan(lengths, max_tokens, padded)
    count = count_over_ranks(len(local))
    groups = local if count <= len(local) else plan(lengths, max_tokens, padded, at_least=count)
    return [[rows[i] for i in group] for group in groups]


def for_rows(
    settings: TrainSettings,
    samples: Samples,
    rows: Sequence[int],
    rank: int = 0,
    world_size: int = 1,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> Parts:
    """``rows`` of ``samples`` in micro-batches: ``micro_batch_size`` samples each, or within
    ``max_tokens_per_micro_batch`` tokens (:func:`split_by_tokens`; as many on every rank)."""
    budget = settings.max_tokens_per_micro_batch
    if budget is None:
        return chunks(list(rows), settings.micro_batch_size)
    return split_by_tokens(
        list(rows),
        [samples.tokens[i].numel() for i in rows],
        budget,
        padded=not settings.pack_sequences,
        count_over_ranks=lambda n: global_max(n, rank, world_size, all_reduce),
    )
