"""The ``bfcl_multi_turn`` environment: a BFCL multi-turn question played turn by turn, scored by BFCL's
checker.

The row (written by ``python -m ppo_rollout.environments.bfcl.dataset``) names the question by its BFCL
``id``; its prompt is the system prompt with the function docs and the first user turn. Each model turn:

- with calls (``calls.parse_calls``): they run, in order, on this trajectory's own simulated APIs, and
  the model reads their results as BFCL's prompting handlers show them, a Python list of
  ``{"role": "tool", "name": <call>, "content": <result>}``;
- malformed (an attempt at calls that does not parse): the model reads why, and the turn counts as a step;
- with no call: the model has answered the user. The turn is checked against the gold calls
  (``checker.GoldChecker``), and the next user turn is the observation; after the last one the
  trajectory ends with reward 1 when every turn passed, else 0.

As in BFCL's inference, a user turn is cut after ``max_steps_per_turn`` responses with calls (its
``MAXIMUM_STEP_LIMIT``, 20): the trajectory ends with reward 0. ``info`` per trajectory: ``solved``,
``turns_passed`` (the share of user turns passed before the first failing one), ``calls``,
``call_errors``, ``call_timeouts``, ``malformed_calls``, ``step_limit``, and ``tool_calls`` /
``tool_valid`` (responses that tried to call, and those that parsed: ``rollout/tool_call_validity``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...environment import Action, StepResult
from .calls import Call, Malformed, parse_calls
from .checker import GoldChecker
from .data import Question, question
from .execution import ERROR_PREFIX, SimulatedAPIs
from .prompts import PromptStyle, user_turn

__all__ = ["BFCLMultiTurnEnvironment", "results_text"]


def results_text(calls: list[Call], results: list[str]) -> str:
    """The results as BFCL's prompting handlers show them (``format_execution_results_prompting``)."""
    return repr([{"role": "tool", "name": c.text, "content": r} for c, r in zip(calls, results, strict=True)])


class BFCLMultiTurnEnvironment:
    """One trajectory of a BFCL multi-turn question (``rollout.environment: bfcl_multi_turn``).

    ``call_timeout_s``: the bound of each function call; ``max_steps_per_turn``: responses with calls
    (or malformed ones) per user turn before the trajectory is cut; ``end_on_failed_turn``: end the
    trajectory (reward 0) at the first user turn the checker fails, instead of playing the rest as BFCL
    does (the reward cannot change after it).
    """

    def __init__(
        self, *, call_timeout_s: float = 2.0, max_steps_per_turn: int = 20, end_on_failed_turn: bool = False
    ) -> None:
        if isinstance(call_timeout_s, bool) or not isinstance(call_timeout_s, int | float):
            raise ValueError(f"rollout.environment_args.call_timeout_s={call_timeout_s!r}: give seconds")
        if not (math.isfinite(call_timeout_s) and call_timeout_s > 0):
            raise ValueError(
                f"rollout.environment_args.call_timeout_s={call_timeout_s!r}: give a positive number of "
                "seconds"
            )
        if (
            isinstance(max_steps_per_turn, bool)
            or not isinstance(max_steps_per_turn, int)
            or max_steps_per_turn < 1
        ):
            raise ValueError(
                f"rollout.environment_args.max_steps_per_turn={max_steps_per_turn!r}: give an integer >= 1"
            )
        self.call_timeout_s = float(call_timeout_s)
        self.max_steps_per_turn = max_steps_per_turn
        self.end_on_failed_turn = bool(end_on_failed_turn)

    def reset(self, row: Mapping[str, Any]) -> None:
        question_id = row.get("id")
        if not isinstance(question_id, str):
            raise ValueError(
                f"a bfcl_multi_turn row needs the BFCL question's 'id' (row keys: {sorted(row)}); write the "
                "rows with `python -m ppo_rollout.environments.bfcl.dataset`"
            )
        self.question: Question = question(question_id)
        self.style = PromptStyle(calls=row.get("call_format", "python"), docs=row.get("docs", "bfcl"))
        self.apis = SimulatedAPIs(self.question)  # this trajectory's own instances
        self.checker = GoldChecker(self.question)
        self.turn, self.steps = 0, 0
        self.turn_steps: list[list[str]] = []
        self.turn_results: list[str] = []

    def step(self, action: Action) -> StepResult:
        parsed = parse_calls(action.text)
        if isinstance(parsed, Malformed):
            return self._counted(self._malformed(parsed))
        if not parsed:
            return self._end_turn()
        return self._counted(self._execute(parsed))

    def _malformed(self, parsed: Malformed) -> StepResult:
        expected = (
            "[func_name(param=value, ...), ...]"
            if self.style.calls == "python"
            else '[{"function": "func_name", "parameters": {"param": "value"}}]'
        )
        text = f"Error: your function calls could not be read: {parsed.reason}. Write only the calls, as "
        text += f"{expected}."
        return StepResult(
            observation=text, info={"tool_calls": 1.0, "tool_valid": 0.0, "malformed_calls": 1.0}
        )

    def _execute(self, calls: list[Call]) -> StepResult:
        running = self.apis.stopped is None
        results = [self.apis.run(call, self.call_timeout_s) for call in calls]
        self.turn_steps.append([call.text for call in calls])
        self.turn_results.extend(results)
        timeouts = int(running and self.apis.stopped is not None)
        info = {
            "tool_calls": 1.0,
            "tool_valid": 1.0,
            "calls": float(len(calls)),
            "call_errors": float(sum(r.startswith(ERROR_PREFIX) for r in results)),
            "call_timeouts": float(timeouts),
        }
        return StepResult(observation=results_text(calls, results), info=info)

    def _counted(self, result: StepResult) -> StepResult:
        """``result``, or the end of the trajectory when the user turn has had too many steps."""
        self.steps += 1
        if self.steps <= self.max_steps_per_turn:
            return result
        return StepResult(done=True, info={**result.info, "step_limit": 1.0, "solved": 0.0})

    def _end_turn(self) -> StepResult:
        passed = self.checker.check_turn(self.turn, self.turn_steps, self.turn_results, self.apis)
        turns = len(self.question.turns)
        info = {"turns_passed": 1.0 / turns if passed else 0.0}
        self.turn, self.steps = self.turn + 1, 0
        self.turn_steps, self.turn_results = [], []
        if self.turn == turns or (not passed and self.end_on_failed_turn):
            solved = float(passed and self.turn == turns)
            return StepResult(reward=solved, done=True, info={**info, "solved": solved})
        return StepResult(observation=user_turn(self.question, self.turn, self.style), info=info)
