"""Fault injection for the end-to-end fault tests; never set in a real run.

``PPO_FAULT_NON_FINITE_WEIGHTS=<role>:<step>`` makes that role's workers write a NaN into their first
weight right after the optimizer step of ``step``. The step's loss and gradient norm, computed before,
stay finite, so what stops the run is the check of the weights themselves (at the save, or before the
weight update), as it would be for an update that overflowed. A legal learning rate cannot do this in
one Adam step (each weight moves by about the learning rate), hence the hook.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

__all__ = ["NON_FINITE_WEIGHTS", "after_train"]

NON_FINITE_WEIGHTS = "PPO_FAULT_NON_FINITE_WEIGHTS"

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
