"""A reward for the real-model test: ``math_answer``, and a JSON line per sample of what it was given
and gave (``PPO_E2E_REWARD_LOG``), so the test can check the reward was computed on the decoded text.

Used as ``rollout.reward=recording_reward:math_answer_recorded`` with this folder on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from ppo_rollout.rewards import RewardInput, math_answer


def math_answer_recorded(samples: Sequence[RewardInput]) -> list[float]:
    rewards = math_answer(samples)
    with open(os.environ["PPO_E2E_REWARD_LOG"], "a", encoding="utf-8") as fh:
        for s, r in zip(samples, rewards, strict=True):
            record = {
                "prompt": s.prompt,
                "response": s.response,
                "token_ids": list(s.response_token_ids),
                "finish_reason": s.finish_reason,
                "label": s.row["label"],
                "reward": r,
            }
            fh.write(json.dumps(record) + "\n")
    return rewards
