"""Held-out evaluation: reward, accuracy and response length on ``eval_prompts`` fixed prompts."""

from __future__ import annotations

import statistics
from dataclasses import replace

from .config import SamplingSettings
from .generation import Generation
from .rollout_metrics import multi_turn_metrics

__all__ = ["CORRECT_REWARD", "evaluate"]

# The reward from which an evaluation sample counts as correct (eval/accuracy).
CORRECT_REWARD = 1.0


def evaluate(generation: Generation) -> dict[str, float]:
    """Twice over the held-out prompts: greedy (``eval_sampling`` when set; ``eval/reward_mean``,
    ``eval/accuracy``, ...) and with the training sampling (``eval/sampled_reward_mean``, ...). A
    sample is correct when its reward (all its turns' together) is at least 1 (``exact_match``,
    ``math_answer``: 1 is right). Every evaluation draws alike (below)."""
    cfg = generation.config
    greedy = cfg.eval_sampling or SamplingSettings(
        temperature=0.0,
        max_new_tokens=cfg.sampling.max_new_tokens,
        stop_token_ids=cfg.sampling.stop_token_ids,
        n_samples_per_prompt=1,
    )
    prompts = generation.groups(generation.source.eval_rows(cfg.eval_prompts), 1)
    metrics: dict[str, float] = {}
    for prefix, sampling, stream in (("", greedy, 1), ("sampled_", cfg.sampling, 2)):
        groups = [replace(g, samples=sampling.n_samples_per_prompt) for g in prompts]
        # Seeded as step 0 at every evaluation: the same draws each time, so the curve shows the
        # policy's change and not the sampling noise.
        run = generation.rollout(groups, sampling, 0, stream=stream)
        trajectories = generation.scorer.rewarded(groups, run.trajectories)
        rewards = [t.total_reward for t in trajectories]
        metrics |= {
            f"eval/{prefix}reward_mean": statistics.fmean(rewards),
            f"eval/{prefix}accuracy": sum(r >= CORRECT_REWARD for r in rewards) / len(rewards),
            f"eval/{prefix}response_length_mean": statistics.fmean(
                len(t.response_tokens) for t in trajectories
            ),
            f"eval/{prefix}samples": float(len(trajectories)),
        }
        if generation.parts.multi_turn:
            metrics |= multi_turn_metrics(trajectories, prefix=f"eval/{prefix}")
    return metrics
