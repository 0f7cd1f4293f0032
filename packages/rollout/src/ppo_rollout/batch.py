"""The training batch: trajectories -> one dict of fields per data-parallel rank (INTERFACES.md's table).

Every field is a list with one 1-D tensor per sample; the samples of one prompt stay consecutive
and on one rank. Ranks get the same number of prompts (hence of samples); within that, prompts go
to the rank with the fewest tokens so far, longest first, to balance the work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .trajectory import Trajectory

__all__ = ["FIELDS", "balanced_split", "rank_fields", "split_indices", "split_samples"]

FIELDS: tuple[str, ...] = (
    "tokens",
    "response_length",
    "loss_mask",
    "reward",
    "rollout_log_probs",
    "prompt_index",
    "weight_version",
    "turn_rewards",
    "turn_ids",
)


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


def rank_fields(trajectories: Sequence[Trajectory]) -> dict[str, list[torch.Tensor]]:
    """The table's fields for ``trajectories``, in order.

    ``loss_mask`` is 1 on the tokens the policy generated (every one of a single-turn response, the
    final eos included: it teaches the model to stop) and 0 on observation tokens; ``reward`` is the
    outcome reward, ``turn_rewards`` each turn's reward on its last generated token, ``turn_ids`` the
    turn of each response token, ``weight_version`` the oldest weight version any turn was drawn with.
    """
    out: dict[str, list[torch.Tensor]] = {f: [] for f in FIELDS}
    for t in trajectories:
        response = t.response_tokens
        out["tokens"].append(torch.tensor([*t.prompt_tokens, *response], dtype=torch.int64))
        out["response_length"].append(torch.tensor([len(response)], dtype=torch.int64))
        out["loss_mask"].append(torch.tensor(t.loss_mask, dtype=torch.float32))
        out["reward"].append(torch.tensor([t.reward], dtype=torch.float32))
        out["rollout_log_probs"].append(torch.tensor(t.rollout_log_probs, dtype=torch.float32))
        out["prompt_index"].append(torch.tensor([t.prompt_index], dtype=torch.int64))
        out["weight_version"].append(torch.tensor([min(t.weight_versions, default=-1)], dtype=torch.int64))
        out["turn_rewards"].append(torch.tensor(t.token_turn_rewards, dtype=torch.float32))
        out["turn_ids"].append(torch.tensor(t.turn_ids, dtype=torch.int64))
    return out


def split_samples(samples: Sequence[Trajectory], dp_size: int) -> list[list[Trajectory]]:
    """Samples grouped by prompt (consecutive) and spread over ``dp_size`` ranks by :func:`balanced_split`."""
    return [[samples[i] for i in ids] for ids in split_indices(samples, dp_size)]


def split_indices(samples: Sequence[Trajectory], dp_size: int) -> list[list[int]]:
    """:func:`split_samples` as positions in ``samples``: the sample ids each rank holds, in order."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.prompt_index, []).append(i)
    keys = sorted(groups)
    tokens = [sum(samples[i].num_tokens for i in groups[k]) for k in keys]
    return [[i for g in part for i in groups[keys[g]]] for part in balanced_split(tokens, dp_size)]
