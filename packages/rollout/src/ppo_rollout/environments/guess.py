"""Guess a number with feedback every turn: a small multi-turn environment for tests of credit assignment.

The row's ``label`` is the number. Each turn the model answers with a number; a wrong guess is answered
``higher`` or ``lower`` (or the ``higher_text``/``lower_text`` given), a right one ends the trajectory.
Rewards every turn: ``correct_reward`` for the right guess, ``closer_reward`` for a wrong guess nearer
than the one before, ``invalid_reward`` for an answer that is not a number.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..environment import Action, StepResult

__all__ = ["GuessNumberEnvironment"]

_NUMBER = re.compile(r"-?\d+")


class GuessNumberEnvironment:
    def __init__(
        self,
        *,
        higher_text: str = "higher",
        lower_text: str = "lower",
        correct_reward: float = 1.0,
        closer_reward: float = 0.1,
        invalid_reward: float = 0.0,
    ) -> None:
        self.higher_text, self.lower_text = higher_text, lower_text
        self.correct_reward, self.closer_reward = correct_reward, closer_reward
        self.invalid_reward = invalid_reward
        self.target = 0
        self.best: int | None = None

    def reset(self, row: Mapping[str, Any]) -> None:
        self.target = int(row["label"])
        self.best = None

    def step(self, action: Action) -> StepResult:
        found = _NUMBER.findall(action.text)
        if not found:
            return StepResult(observation=self.higher_text, reward=self.invalid_reward, info={"valid": 0.0})
        guess = int(found[-1])
        if guess == self.target:
            return StepResult(reward=self.correct_reward, done=True, info={"valid": 1.0, "solved": 1.0})
        distance = abs(guess - self.target)
        closer = self.best is not None and distance < self.best
        self.best = distance if self.best is None or distance < self.best else self.best
        reply = self.higher_text if guess < self.target else self.lower_text
        reward = self.closer_reward if closer else 0.0
        return StepResult(observation=reply, reward=reward, info={"valid": 1.0, "solved": 0.0})
