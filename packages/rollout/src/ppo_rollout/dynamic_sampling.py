"""DAPO's dynamic sampling (``rollout.dynamic_sampling``): keep only groups whose raw scores vary.

A group whose samples all score alike gives every GRPO-family advantage zero: it costs a training
step's compute and carries no signal. Each step rolls out groups, keeps those whose raw-score std
exceeds ``std_tolerance``, and draws more prompts until exactly ``prompts_per_step`` groups are kept
(Yu et al. 2025, "DAPO", section 3.2). verl's ``algorithm.filter_groups``
(https://github.com/volcengine/verl, commit 004c888001c88628b98fbc5fdee9c3e9b8898800,
``recipe/dapo/dapo_ray_trainer.py``) keeps groups with ``np.std(...) > 0``, keeps the first
``train_batch_size`` groups and raises after ``max_num_gen_batches``; here the test has a tolerance
and running out may also pad.

- The filter reads the raw score (``Trajectory.score`` plus the environment's turn rewards), never the
  shaped outcome reward: an overlong penalty that varies within an all-wrong group must not keep it.
- The std is taken in float64 and compared with a tolerance: scores computed in float32 need not be
  bit-equal for a constant group.
- Rounds are bounded (``max_rounds``); when they run out, ``stop`` raises and ``pad`` fills the batch
  with dropped groups, first generated first, so the step always has ``prompts_per_step`` groups (a
  multiple of every role's data-parallel size, checked by the manager).
- Kept groups beyond the target are discarded in generation order (round, then prompt order), and the
  step's groups are renumbered 0..n-1 (``Trajectory.prompt_index``).

Everything here is pure: ``roll(round, prompts)`` (the manager's rollout of freshly drawn prompts)
is the only effect, so a scripted ``roll`` tests the loop.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from .config import DynamicSamplingSettings
from .trajectory import Trajectory

__all__ = [
    "CORRECT_SCORE",
    "DynamicSamplingExhausted",
    "Selection",
    "has_signal",
    "raw_score",
    "round_prompts",
    "select_groups",
]

# A sample is correct when its raw score reaches it (as eval/accuracy counts).
CORRECT_SCORE = 1.0

Group = Sequence[Trajectory]
RollFn = Callable[[int, int], Sequence[Group]]


class DynamicSamplingExhausted(RuntimeError):
    """``max_rounds`` rounds kept too few groups and ``on_exhausted`` is ``stop``."""


@dataclass(frozen=True)
class Selection:
    """The step's groups (renumbered 0..n-1, kept ones first, then any padding) and the metrics."""

    groups: list[list[Trajectory]]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]


def raw_score(t: Trajectory) -> float:
    """What the trajectory earned before any shaping: the task score and the environment's turn rewards
    (a multi-turn task may reward through its environment alone)."""
    return t.score + math.fsum(t.turn_rewards)


def has_signal(group: Group, std_tolerance: float) -> bool:
    """Whether the group's raw scores vary: population std (float64) above ``std_tolerance``."""
    return len(group) > 1 and statistics.pstdev(raw_score(t) for t in group) > std_tolerance


def round_prompts(missing: int, over_sample: float) -> int:
    """Prompts a round draws: ``ceil(over_sample * missing)``, at least one."""
    return max(1, math.ceil(over_sample * missing - 1e-9))


def select_groups(roll: RollFn, target: int, settings: DynamicSamplingSettings) -> Selection:
    """Rolls out rounds through ``roll(round, prompts)`` until ``target`` groups with signal are kept.

    ``roll`` returns one group per drawn prompt, in prompt order. Metrics (``rollout/dynamic/...``):
    ``all_correct_groups`` and ``all_wrong_groups``, the shares of every generated group whose samples
    all score alike at or above :data:`CORRECT_SCORE` and below it; ``rounds``; ``kept_groups`` (groups
    with signal in the batch); ``padded_groups``; ``samples_generated_per_trained``.
    """
    if target < 1:
        raise ValueError(f"target={target} must be >= 1 (rollout.prompts_per_step)")
    kept: list[list[Trajectory]] = []
    dropped: list[list[Trajectory]] = []
    generated = samples = all_correct = all_wrong = rounds = 0
    while len(kept) < target and rounds < settings.max_rounds:
        groups = roll(rounds, round_prompts(target - len(kept), settings.over_sample))
        rounds += 1
        for group in groups:
            generated += 1
            samples += len(group)
            if has_signal(group, settings.std_tolerance):
                if len(kept) < target:
                    kept.append(list(group))
                continue
            dropped.append(list(group))
            if min(raw_score(t) for t in group) >= CORRECT_SCORE:
                all_correct += 1
            else:
                all_wrong += 1
    with_signal = len(kept)
    if with_signal < target:
        if settings.on_exhausted == "stop":
            raise DynamicSamplingExhausted(
                f"dynamic sampling kept {with_signal} of {target} groups with varying scores in "
                f"rollout.dynamic_sampling.max_rounds={settings.max_rounds} rounds ({generated} groups "
                "generated); raise max_rounds or over_sample, or set on_exhausted=pad"
            )
        kept.extend(dropped[: target - with_signal])
    batch = [[replace(t, prompt_index=i) for t in g] for i, g in enumerate(kept)]
    trained = sum(len(g) for g in batch)
    metrics = {
        "rollout/dynamic/all_correct_groups": all_correct / max(1, generated),
        "rollout/dynamic/all_wrong_groups": all_wrong / max(1, generated),
        "rollout/dynamic/rounds": float(rounds),
        "rollout/dynamic/kept_groups": float(with_signal),
        "rollout/dynamic/padded_groups": float(target - with_signal),
        "rollout/dynamic/samples_generated_per_trained": samples / trained,
    }
    return Selection(batch, metrics)
