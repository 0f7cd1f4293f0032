"""Which participant of a rollout the running task is: ``(prompt,)``, or ``(prompt, sample)`` once a
prompt's samples run as trajectories of their own. The generate client orders each wave of requests
by it (``rollout.multi_turn.turn_order: fixed``)."""

from __future__ import annotations

import contextvars

__all__ = ["PARTICIPANT", "Key"]

Key = tuple[int, ...]
PARTICIPANT: contextvars.ContextVar[Key] = contextvars.ContextVar("ppo_rollout_participant", default=())
