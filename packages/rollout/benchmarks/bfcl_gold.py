"""The ``bfcl_multi_turn`` environment against bfcl-eval's gold answers, every multi-turn category.

For each question: the gold calls replayed through the environment (each user turn's calls as one
response, then an answer without calls) must score 1; then the gold and two wrong sequences (a turn's
last call left out, the turn's calls all left out) are scored both by the environment and by BFCL's own
``multi_turn_checker`` (which ``eval``s the calls on instances in its module's globals), and their
verdicts and error types compared. Prints one JSON line per category and the seconds taken.

    uv run python packages/rollout/benchmarks/bfcl_gold.py
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

from ppo_rollout.environment import Action, StepResult
from ppo_rollout.environments.bfcl.data import CATEGORIES, Question, questions
from ppo_rollout.environments.bfcl.environment import BFCLMultiTurnEnvironment


def play(q: Question, turns: list[tuple[str, ...]]) -> tuple[float, str | None]:
    env = BFCLMultiTurnEnvironment()
    env.reset({"id": q.id})
    result = StepResult()
    for calls in turns:
        if calls:
            env.step(Action("[" + ", ".join(calls) + "]", (), "stop", 0))
        result = env.step(Action("Done.", (), "stop", 0))
    failure = env.checker.failure
    return result.reward, None if failure is None else str(failure["error_type"])


def bfcl(q: Question, turns: list[tuple[str, ...]]) -> dict[str, Any]:
    model = f"bench_{uuid.uuid4().hex}"
    entry = {"id": q.id, "initial_config": q.initial_config, "involved_classes": list(q.involved_classes)}
    decoded = [[list(calls)] if calls else [] for calls in turns]
    try:
        verdict: dict[str, Any] = multi_turn_checker(
            decoded, [list(g) for g in q.gold], entry, q.category, model
        )
        return verdict
    finally:
        for name in [name for name in vars(multi_turn_utils) if model in name]:
            del vars(multi_turn_utils)[name]


def variants(q: Question) -> list[list[tuple[str, ...]]]:
    first = next(i for i, calls in enumerate(q.gold) if calls)
    short, skipped = list(q.gold), list(q.gold)
    short[first] = short[first][:-1]
    skipped[first] = ()
    return [list(q.gold), short, skipped]


def category(name: str) -> dict[str, Any]:
    started = time.perf_counter()
    failed = [q.id for q in questions(name).values() if play(q, list(q.gold))[0] != 1.0]
    replay_s = time.perf_counter() - started
    compared, disagree = 0, []
    for q in questions(name).values():
        for turns in variants(q):
            expected = bfcl(q, turns)
            reward, error = play(q, turns)
            compared += 1
            same = (reward == 1.0) == expected["valid"] and (
                expected["valid"] or error == expected["error_type"]
            )
            if not same:
                disagree.append(q.id)
    return {
        "category": name,
        "questions": len(questions(name)),
        "gold_scored_1": len(questions(name)) - len(failed),
        "gold_failed": failed,
        "replay_s": round(replay_s, 2),
        "verdicts_compared": compared,
        "verdicts_agree": compared - len(disagree),
        "disagree": disagree,
    }


def main() -> None:
    for name in CATEGORIES:
        print(json.dumps(category(name)))


if __name__ == "__main__":
    main()
