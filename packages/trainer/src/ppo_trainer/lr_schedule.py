"""The learning rate of each training step: linear warm-up, then constant or cosine decay to a floor.

A pure function of the step, so a resumed run sets exactly the rates of an uninterrupted one with no
state of its own to save. Both backends call :func:`lr_factor` once per training step (the worker
passes the driver's step) and scale their optimizer's base rate by it.

Cosine follows OpenRLHF's ``cosine_with_min_lr`` (the floor is ``min_lr_ratio`` times the rate) and
verl's ``lr_scheduler_type: cosine`` with ``min_lr_ratio``; ``constant`` after warm-up is verl's default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ppo_trainer.config import LrSchedule, TrainerConfig


def lr_factor(
    step: int,
    *,
    schedule: LrSchedule,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> float:
    """The multiplier of the base learning rate at training step ``step`` (1-based).

    - warm-up: ``step / warmup_steps`` for the first ``warmup_steps`` steps;
    - ``constant``: 1 after warm-up;
    - ``cosine``: from 1 at the first step after warm-up down to ``min_lr_ratio`` at ``total_steps``,
      ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with ``p`` the share of the decay
      steps done. Without ``total_steps`` (a trainer used outside a run of known length) it holds 1.
    """
    if step < 1:
        raise ValueError(f"step={step}: training steps count from 1")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant" or total_steps is None:
        return 1.0
    decay_steps = total_steps - warmup_steps - 1
    if decay_steps <= 0:
        return 1.0
    done = min(max(step - warmup_steps - 1, 0), decay_steps) / decay_steps
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))


def scheduled_factor(config: TrainerConfig, step: int) -> float:
    """:func:`lr_factor` with a role's settings (``lr_schedule``, warm-up, floor, the run's length)."""
    return lr_factor(
        step,
        schedule=config.lr_schedule,
        warmup_steps=config.lr_warmup_steps,
        total_steps=config.total_steps,
        min_lr_ratio=config.min_lr_ratio,
    )


def set_scheduled_lr(config: TrainerConfig, step: int, param_groups: Iterable[dict[str, Any]]) -> float:
    """The role's rate at training step ``step`` (``config.lr`` times :func:`scheduled_factor`) into
    every optimizer param group of ``param_groups``; returns it. Both backends set it so, once per
    step: megatron's own ``OptimizerParamScheduler`` is not used (nor its ``lr_mult`` / ``wd_mult``)."""
    lr = config.lr * scheduled_factor(config, step)
    for group in param_groups:
        group["lr"] = lr
    return lr
