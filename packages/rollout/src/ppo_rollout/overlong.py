"""DAPO's overlong shaping applied to a step's trajectories (``rollout.overlong``).

Each trajectory's outcome ``reward`` gets :func:`reward_shaping.overlong_penalty` of its generated
tokens: the tokens the policy wrote, every turn's; observation tokens (tool and environment replies)
do not count, as DAPO counts the response the model generated. ``max_len`` is the rollout's
``train_response_limit``. ``score`` keeps the raw task score, so accuracy and dynamic sampling never
see the penalty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .config import OverlongSettings
from .reward_shaping import overlong_penalty
from .trajectory import Trajectory

__all__ = ["shape_overlong"]


def shape_overlong(
    trajectories: Sequence[Trajectory], settings: OverlongSettings | None, max_len: int
) -> list[Trajectory]:
    """``trajectories`` with the overlong penalty added to each outcome reward; unchanged when
    ``settings`` is ``None`` or off (``buffer_len`` or ``penalty_factor`` 0)."""
    if settings is None or not settings.active:
        return list(trajectories)
    return [
        replace(
            t,
            reward=t.reward
            + overlong_penalty(t.generated_tokens, max_len, settings.buffer_len, settings.penalty_factor),
        )
        for t in trajectories
    ]
