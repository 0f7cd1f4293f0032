"""Fault injection for the end-to-end fault tests; never set in a real run.

``PPO_FAULT_NON_FINITE_WEIGHTS=<role>:<step>`` makes that role's workers write a NaN into their first
weight right after the optimizer step of ``step``. The step's loss and gradient norm, computed before,
stay finite, so what stops the run is the check of the weights themselves (at the save, or before the
weight update), as it would be for an update that overflowed. A legal learning rate cannot do this in
one Adam step (each weight moves by about the learning rate), hence the hook.

``PPO_FAULT_TRANSITION=<role>:<action>:<n>`` (action ``sleep`` or ``wake``) makes that role's workers
raise on their ``n``-th call of that transition (counted per worker process, from 1), before anything
moves: a sleep or wake that fails, for the tests of how the driver reports one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

__all__ = ["NON_FINITE_WEIGHTS", "TRANSITION", "after_train", "before_transition"]

NON_FINITE_WEIGHTS = "PPO_FAULT_NON_FINITE_WEIGHTS"
TRANSITION = "PPO_FAULT_TRANSITION"
_calls: dict[str, int] = {}

log = logging.getLogger(__name__)


def after_train(role: str, step: int, weights: Sequence[torch.Tensor]) -> None:
    """Poison ``weights[0]`` (a parameter: the trainer lists parameters before buffers) when asked."""
    wanted = os.environ.get(NON_FINITE_WEIGHTS, "")
    if wanted != f"{role}:{step}" or not weights:
        return
    with torch.no_grad():
        weights[0].view(-1)[0] = float("nan")
    log.warning(
        "%s=%s: wrote a NaN into the %s's weights after step %d", NON_FINITE_WEIGHTS, wanted, role, step
    )


def before_transition(role: str, action: str) -> None:
    """Raise on the worker's ``n``-th ``action`` when ``PPO_FAULT_TRANSITION=<role>:<action>:<n>``."""
    wanted = os.environ.get(TRANSITION, "")
    if not wanted.startswith(f"{role}:{action}:"):
        return
    count = _calls[action] = _calls.get(action, 0) + 1
    if wanted == f"{role}:{action}:{count}":
        raise RuntimeError(f"{TRANSITION}={wanted}: this {role} worker's {action} number {count} fails")
