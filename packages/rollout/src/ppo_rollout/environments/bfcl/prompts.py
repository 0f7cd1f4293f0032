"""What the model reads: BFCL's system prompt with the involved classes' function docs, and the user
turns, as BFCL's prompting handlers build them (``model_handler``, ``constants/default_prompts.py``).

The system prompt is BFCL's default (``ret_fmt=python&tool_call_tag=False&func_doc_fmt=json&
prompt_fmt=plaintext&style=classic``) or, with ``calls="json"``, the same asking for BFCL's JSON call
format. ``docs="bfcl"`` writes the docs as BFCL does (indented JSON, 2,000 to 11,000 tokens for a
question's classes); ``docs="compact"`` as one line of JSON without each function's ``response``
schema (about half), for models with short contexts. A ``miss_func`` question's held-back functions are
left out of the first docs and shown in the turn BFCL reveals them, with BFCL's message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from bfcl_eval.constants.default_prompts import (
    DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
    OUTPUT_FORMAT_MAPPING,
    PARAM_TYPE_MAPPING,
    PROMPT_STYLE_TEMPLATES,
    PROMPT_TEMPLATE_MAPPING,
)

from .data import Question, function_docs

__all__ = ["PromptStyle", "first_messages", "function_docs_of", "system_prompt", "user_turn"]


@dataclass(frozen=True)
class PromptStyle:
    """How calls are asked for (``python`` or ``json``) and how the docs are written."""

    calls: Literal["python", "json"] = "python"
    docs: Literal["bfcl", "compact"] = "bfcl"

    def __post_init__(self) -> None:
        if self.calls not in ("python", "json"):
            raise ValueError(f"BFCL call format {self.calls!r}: use 'python' or 'json'")
        if self.docs not in ("bfcl", "compact"):
            raise ValueError(f"BFCL docs style {self.docs!r}: use 'bfcl' or 'compact'")


def function_docs_of(
    question: Question, style: PromptStyle
) -> tuple[list[Mapping[str, Any]], dict[int, list[Mapping[str, Any]]]]:
    """The docs shown from the start, and those held back until a turn (``miss_func``)."""
    shown = [_doc(doc, style) for name in question.involved_classes for doc in function_docs(name)]
    later: dict[int, list[Mapping[str, Any]]] = {}
    for turn, names in question.missed_functions.items():
        for name in names:
            place = next(i for i, doc in enumerate(shown) if doc["name"] == name)
            later.setdefault(turn, []).append(shown.pop(place))
    return shown, later


def _doc(doc: Mapping[str, Any], style: PromptStyle) -> Mapping[str, Any]:
    return doc if style.docs == "bfcl" else {k: v for k, v in doc.items() if k != "response"}


def system_prompt(functions: list[Mapping[str, Any]], style: PromptStyle) -> str:
    """BFCL's ``formulate_system_prompt`` for plaintext, classic style, no tool-call tag, JSON docs."""
    template = PROMPT_STYLE_TEMPLATES["classic"]
    call_format = template["tool_call_no_tag"].format(
        output_format=OUTPUT_FORMAT_MAPPING[style.calls], param_types=PARAM_TYPE_MAPPING[style.calls]
    )
    docs = json.dumps(functions, indent=4) if style.docs == "bfcl" else json.dumps(functions)
    text: str = PROMPT_TEMPLATE_MAPPING["plaintext"].format(
        persona=template["persona"],
        task=template["task"],
        tool_call_format=call_format,
        multiturn_behavior=template["multiturn_behavior"],
        available_tools=template["available_tools"].format(format="json", functions=docs),
    )
    return text


def _turn_messages(question: Question, turn: int, style: PromptStyle) -> list[dict[str, str]]:
    later = function_docs_of(question, style)[1]
    if turn in later:  # BFCL's message revealing the held-back functions (their docs as a Python list)
        text = DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING.format(functions=later[turn])
        return [{"role": "user", "content": text}]
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in question.turns[turn]]


def first_messages(question: Question, style: PromptStyle) -> list[dict[str, str]]:
    """The prompt: the system prompt, then the first turn's messages (a system message of the question's
    own goes after BFCL's, in one message, as BFCL puts it)."""
    prompt = system_prompt(function_docs_of(question, style)[0], style)
    messages = _turn_messages(question, 0, style)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{prompt}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def user_turn(question: Question, turn: int, style: PromptStyle) -> str:
    """The text of user turn ``turn`` (> 0), its messages joined as BFCL joins consecutive ones."""
    return "\n\n".join(m["content"] for m in _turn_messages(question, turn, style))
