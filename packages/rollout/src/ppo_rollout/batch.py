"""The training batch: samples -> one dict of fields per data-parallel rank (INTERFACES.md's table).

Every field is a list with one 1-D tensor per sample; the samples of one prompt stay consecutive
and on one rank. Ranks get the same number of prompts (hence of samples); within that, prompts go
to the rank with the fewest tokens so far, longest first, to balance the work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["FIELDS", "Sample", "balanced_split", "rank_fields", "split_indices", "split_samples"]

FIELDS: tuple[str, ...] = (
    "tokens",
    "response_length",
    "loss_mask",
    "reward",
    "rollout_log_probs",
    "prompt_index",
    "weight_version",
)


@dataclass(frozen=True)
class Sample:
    prompt_index: int  # the prompt's index within its step: the GRPO group
    prompt_tokens: tuple[int, ...]
    response_tokens: tuple[int, ...]
    rollout_log_probs: tuple[float, ...]
    reward: float
    finish_reason: str
    weight_version: int = -1  # the engine's weight version that generated it (-1: not a number)

    def __post_init__(self) -> None:
        if len(self.response_tokens) != len(self.rollout_log_probs):
            raise ValueError(
                f"prompt {self.prompt_index}: {len(self.response_tokens)} response tokens but "
                f"{len(self.rollout_log_probs)} log-probs"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.response_tokens)


def balanced_split(group_tokens: Sequence[int], dp_size: int) -> list[list[int]]:
    """Indices of groups per rank: equal counts, token totals balanced greedily (longest first)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    n = len(group_tokens)
    if n % dp_size:
        raise ValueError(
            f"{n} prompts cannot be split evenly over {dp_size} data-parallel ranks; make prompts_per_step "
            f"a multiple of dp_size"
        )
    capacity = n // dp_size
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for g in sorted(range(n), key=lambda i: (-group_tokens[i], i)):
        open_ranks = [r for r in range(dp_size) if len(ranks[r]) < capacity]
        r = min(open_ranks, key=lambda r: (load[r], r))
        ranks[r].append(g)
        load[r] += group_tokens[g]
    return [sorted(r) for r in ranks]


def rank_fields(samples: Sequence[Sample]) -> dict[str, list[torch.Tensor]]:
    """The table's fields for ``samples``, in order."""
    out: dict[str, list[torch.Tensor]] = {f: [] for f in FIELDS}
    for s in samples:
        n = len(s.response_tokens)
        out["tokens"].append(torch.tensor([*s.prompt_tokens, *s.response_tokens], dtype=torch.int64))
        out["response_length"].append(torch.tensor([n], dtype=torch.int64))
        # Every generated token is trained, the final eos included (it teaches the model to stop).
        out["loss_mask"].append(torch.ones(n, dtype=torch.float32))
        out["reward"].append(torch.tensor([s.reward], dtype=torch.float32))
        out["rollout_log_probs"].append(torch.tensor(s.rollout_log_probs, dtype=torch.float32))
        out["prompt_index"].append(torch.tensor([s.prompt_index], dtype=torch.int64))
        out["weight_version"].append(torch.tensor([s.weight_version], dtype=torch.int64))
    return out


def split_samples(samples: Sequence[Sample], dp_size: int) -> list[list[Sample]]:
    """Samples grouped by prompt (consecutive) and spread over ``dp_size`` ranks by :func:`balanced_split`."""
    return [[samples[i] for i in ids] for ids in split_indices(samples, dp_size)]


def split_indices(samples: Sequence[Sample], dp_size: int) -> list[list[int]]:
    """:func:`split_samples` as positions in ``samples``: the sample ids each rank holds, in order."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_index, []).append(i)
    keys = sorted(groups)
    tokens = [sum(samples[i].num_tokens for i in groups[k]) for k in keys]
    return [[i for g in part for i in groups[keys[g]]] for part in balanced_split(tokens, dp_size)]
