"""BFCL's multi-turn questions, gold answers and function docs, read from the installed bfcl-eval, and
the held-out split by question.

A question (``BFCL_v4_multi_turn_<kind>.json``) holds its user turns, the initial state of the
simulated APIs it involves and, for ``miss_func``, the functions held back until a later turn; its gold
answer (``possible_answer/``) is one list of Python calls per turn. The four categories share their
scenarios: ``multi_turn_base_7`` and ``multi_turn_miss_func_7`` are one question asked two ways, so the
split goes by the number after the category and a question is held out in every category or in none.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from bfcl_eval.constants.executable_backend_config import (
    CLASS_FILE_PATH_MAPPING,
    MULTI_TURN_FUNC_DOC_FILE_MAPPING,
    STATELESS_CLASSES,
)

__all__ = [
    "CATEGORIES",
    "CLASS_FILE_PATH_MAPPING",
    "STATELESS_CLASSES",
    "Question",
    "category_of",
    "function_docs",
    "question",
    "questions",
    "split_ids",
]

CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)


@dataclass(frozen=True)
class Question:
    """One BFCL multi-turn question and its gold calls."""

    id: str
    turns: tuple[tuple[Mapping[str, str], ...], ...]  # each user turn's messages (empty: a held-back turn)
    initial_config: Mapping[str, Any]  # class name -> the state its _load_scenario takes
    involved_classes: tuple[str, ...]
    missed_functions: Mapping[int, tuple[str, ...]]  # turn -> names of the functions revealed there
    gold: tuple[tuple[str, ...], ...]  # each turn's calls, in BFCL's Python call syntax

    @property
    def category(self) -> str:
        return category_of(self.id)

    @property
    def long_context(self) -> bool:
        """BFCL loads the long-context scenario into the APIs of this category."""
        return "long_context" in self.category


def category_of(question_id: str) -> str:
    """``multi_turn_base_12`` -> ``multi_turn_base``."""
    return question_id.rsplit("_", 1)[0]


def _lines(path: str) -> list[dict[str, Any]]:
    text = (resources.files("bfcl_eval") / "data" / path).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@cache
def questions(category: str) -> Mapping[str, Question]:
    """Every question of ``category`` (one of ``CATEGORIES``) by id, in the package's order."""
    if category not in CATEGORIES:
        raise ValueError(f"BFCL category {category!r} is not a multi-turn one; use one of {list(CATEGORIES)}")
    answers = {a["id"]: a["ground_truth"] for a in _lines(f"possible_answer/BFCL_v4_{category}.json")}
    out: dict[str, Question] = {}
    for entry in _lines(f"BFCL_v4_{category}.json"):
        missed = entry.get("missed_function", {})
        out[entry["id"]] = Question(
            id=entry["id"],
            turns=tuple(tuple(turn) for turn in entry["question"]),
            initial_config=entry.get("initial_config", {}),
            involved_classes=tuple(entry["involved_classes"]),
            missed_functions={int(turn): tuple(names) for turn, names in missed.items()},
            gold=tuple(tuple(calls) for calls in answers[entry["id"]]),
        )
    return out


def question(question_id: str) -> Question:
    """The question with id ``question_id``, or a ``ValueError`` naming it."""
    category = category_of(question_id)
    if category not in CATEGORIES:
        raise ValueError(
            f"row id {question_id!r} is not a BFCL multi-turn question (ids look like multi_turn_base_0; "
            f"categories {list(CATEGORIES)}); write the rows with `python -m "
            "ppo_rollout.environments.bfcl.dataset`"
        )
    found = questions(category).get(question_id)
    if found is None:
        raise ValueError(f"row id {question_id!r}: bfcl-eval has no such question in {category}")
    return found


@cache
def function_docs(class_name: str) -> tuple[Mapping[str, Any], ...]:
    """BFCL's documentation of the functions of ``class_name`` (``multi_turn_func_doc/``)."""
    return tuple(_lines(f"multi_turn_func_doc/{MULTI_TURN_FUNC_DOC_FILE_MAPPING[class_name]}"))


def _number(question_id: str) -> str:
    return question_id.rsplit("_", 1)[1]


def _rank(number: str, seed: int) -> str:
    return hashlib.sha256(f"bfcl/{seed}/{number}".encode()).hexdigest()


def split_ids(ids: Iterable[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """``ids`` as (training, held out): the ``round(fraction x the numbers)`` question numbers whose hash
    with ``seed`` sorts first are held out, in every category at once; each list keeps ``ids``' order."""
    if not 0 <= fraction < 1:
        raise ValueError(f"the held-out fraction must be in [0, 1); got {fraction}")
    ids = list(ids)
    numbers = sorted({_number(i) for i in ids}, key=lambda n: _rank(n, seed))
    chosen = set(numbers[: round(fraction * len(numbers))])
    return [i for i in ids if _number(i) not in chosen], [i for i in ids if _number(i) in chosen]
