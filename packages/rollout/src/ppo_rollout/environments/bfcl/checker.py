"""BFCL's multi-turn checker, one user turn at a time, in-process.

``multi_turn_checker`` (bfcl_eval.eval_checker.multi_turn_eval) runs, for each turn: the model's decoded
calls on instances of their own, the turn's gold calls on others, then fails the question when the gold
turn has calls and the model made none, when ``state_checker`` finds an attribute of an instance that
differs from the gold instance's, or when ``response_checker`` finds a gold result missing from the
model's results of every turn so far. This module does the same as each turn ends, with BFCL's own
``state_checker`` and ``response_checker``, against the trajectory's live instances (the model's calls
ran on them, fresh for this trajectory) and gold instances of its own. Gold calls are trusted text from
the package and run unbounded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import response_checker, state_checker

from .calls import parse_gold_call
from .data import Question
from .execution import SimulatedAPIs

__all__ = ["GoldChecker"]


class GoldChecker:
    """The gold side of one trajectory: its instances, and the first failing turn's verdict."""

    def __init__(self, question: Question) -> None:
        self.question = question
        self.gold = SimulatedAPIs(question)
        self.model_results: list[str] = []  # every turn's results so far, as BFCL compares them
        self.failure: Mapping[str, Any] | None = None

    def check_turn(
        self, turn: int, steps: Sequence[Sequence[str]], results: Sequence[str], model: SimulatedAPIs
    ) -> bool:
        """Whether the question still holds after user turn ``turn``: ``steps`` are the model's calls
        of the turn (one list per response with calls), ``results`` what they returned, ``model`` the
        instances they ran on. False from the first failing turn on (BFCL stops there)."""
        self.model_results.extend(results)
        if self.failure is not None:
            return False
        gold_calls = self.question.gold[turn]
        gold_results = [self.gold.run(parse_gold_call(call)) for call in gold_calls]
        verdict = self._verdict(turn, bool(gold_calls), gold_results, steps, model)
        if not verdict["valid"]:
            self.failure = verdict
        return self.failure is None

    def _verdict(
        self,
        turn: int,
        gold_has_calls: bool,
        gold_results: list[str],
        steps: Sequence[Sequence[str]],
        model: SimulatedAPIs,
    ) -> Mapping[str, Any]:
        if model.stopped is not None:
            return {
                "valid": False,
                "error_message": f"{model.stopped} timed out in turn {turn}; the state is unknown",
                "error_type": "bfcl_environment:call_timeout",
            }
        if gold_has_calls and not steps:
            return {
                "valid": False,
                "error_message": f"Model response list is empty for turn {turn}",
                "error_type": "multi_turn:empty_turn_model_response",
            }
        if not gold_has_calls:  # a turn the model should not be able to do: nothing to compare
            return {"valid": True}
        state: Mapping[str, Any] = state_checker(model.instances, self.gold.instances)
        if not state["valid"]:
            return state
        response: Mapping[str, Any] = response_checker(self.model_results, gold_results, turn)
        return response
