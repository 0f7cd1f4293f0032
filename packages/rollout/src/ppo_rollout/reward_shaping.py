"""Reward shaping that depends on the response alone, as pure functions.

``overlong_penalty`` is DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13): a response
is not penalised up to ``max_len - buffer_len`` tokens, then linearly more, down to ``-penalty_factor``
at ``max_len``. It follows verl's ``overlong_buffer.{len, penalty_factor}``
(https://github.com/volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7,
``verl/workers/reward_manager/dapo.py``: ``min(-(L - (max_resp_len - len)) / len * penalty_factor, 0)``)
and OpenRLHF's ``--reward.overlong_buffer_len`` / ``--reward.overlong_penalty_factor``
(https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
``openrlhf/trainer/ppo_utils/length_penalty.py``), which also caps a length beyond ``max_len`` at
``-penalty_factor``, as here. The penalty is added to the task's reward; dynamic sampling filters on
the raw task score, not on the shaped reward.
"""

from __future__ import annotations


def overlong_penalty(response_length: int, max_len: int, buffer_len: int, penalty_factor: float) -> float:
    """The penalty (``<= 0``) of a response of ``response_length`` tokens::

        0                                                 for L <= max_len - buffer_len
        -(L - (max_len - buffer_len)) / buffer_len * penalty_factor   up to L = max_len
        -penalty_factor                                   for L >= max_len

    ``max_len`` is the longest response the rollout allows (its total response tokens), ``buffer_len``
    the tokens before it over which the penalty grows (``0 < buffer_len <= max_len``). A bad argument
    raises a ``ValueError`` naming it.
    """
    if response_length < 0:
        raise ValueError(f"response_length={response_length} must be >= 0")
    if max_len < 1:
        raise ValueError(f"max_len={max_len} must be >= 1 (the longest response the rollout allows)")
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"buffer_len={buffer_len} must be in (0, max_len={max_len}]: the tokens before max_len over "
            "which the penalty grows"
        )
    if not penalty_factor >= 0:
        raise ValueError(
            f"penalty_factor={penalty_factor} must be >= 0 (the penalty at max_len is its negative)"
        )
    exceed = min(response_length - (max_len - buffer_len), buffer_len)
    if exceed <= 0:
        return 0.0
    return -exceed / buffer_len * penalty_factor


__all__ = ["overlong_penalty"]
