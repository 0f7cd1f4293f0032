"""A step's rollout metrics, from its trajectories."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .trajectory import STATUSES, Trajectory

__all__ = ["multi_turn_metrics", "sample_metrics"]


def sample_metrics(trajectories: Sequence[Trajectory], prefix: str = "rollout/") -> dict[str, float]:
    """Reward, response length and truncation: the metrics every rollout reports."""
    rewards = [t.total_reward for t in trajectories]
    lengths = [len(t.response_tokens) for t in trajectories]
    return {
        f"{prefix}reward_mean": statistics.fmean(rewards),
        f"{prefix}reward_std": statistics.pstdev(rewards),
        f"{prefix}response_length_mean": statistics.fmean(lengths),
        f"{prefix}truncated_fraction": sum(t.status == "length" for t in trajectories) / len(trajectories),
        f"{prefix}samples": float(len(trajectories)),
    }


def multi_turn_metrics(trajectories: Sequence[Trajectory], prefix: str = "rollout/") -> dict[str, float]:
    """Turns, observation tokens, statuses, the environment's counters (``info``: per-trajectory
    means as ``env/<key>``), tool-call validity and environment errors and seconds."""
    n = len(trajectories)
    turns = [t.num_turns for t in trajectories]
    out = {
        f"{prefix}turns_mean": statistics.fmean(turns),
        f"{prefix}turns_max": float(max(turns)),
        f"{prefix}observation_tokens_mean": statistics.fmean(t.observation_tokens for t in trajectories),
        f"{prefix}generated_tokens_mean": statistics.fmean(t.generated_tokens for t in trajectories),
    }
    out |= {f"{prefix}status/{s}": sum(t.status == s for t in trajectories) / n for s in STATUSES}
    totals: dict[str, float] = {}
    for t in trajectories:
        for key, value in t.info.items():
            totals[key] = totals.get(key, 0.0) + value
    out |= {f"{prefix}env/{key}": value / n for key, value in sorted(totals.items())}
    calls = totals.get("tool_calls", 0.0)
    if calls > 0:
        out[f"{prefix}tool_call_validity"] = totals.get("tool_valid", 0.0) / calls
    return out
