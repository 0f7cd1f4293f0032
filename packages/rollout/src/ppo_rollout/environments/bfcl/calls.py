"""The model's function calls, parsed from its text in the two formats BFCL documents for models, and
never evaluated: every argument must be a literal (numbers, strings, lists, dicts, tuples, True, False,
None), read by ``ast.literal_eval``.

- Python call syntax (BFCL's default, ``ret_fmt=python``): ``[func(a=1), g(b="x")]``; one call may come
  without the brackets, as BFCL's decoder allows. Positional arguments are kept (BFCL's gold answers use
  them, e.g. ``sort('final_report.pdf')``).
- JSON (``ret_fmt=json``): ``[{"function": "func", "parameters": {"a": 1}}]``, or one such object.

Either may sit in a Markdown code fence. A turn is an *attempt* at calls when (after the fence) it
starts with ``[`` or ``{`` or with a name directly followed by ``(``; an attempt that does not parse
is ``Malformed`` (the model reads why). Any other text, and ``[]``, is no call: the model's answer to
the user, which ends the user's turn (BFCL goes on to the next turn when a response decodes to no
call).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["Call", "Malformed", "parse_calls", "parse_gold_call"]

_FENCE = re.compile(r"^```[\w-]*[ \t]*\n?(.*?)\n?```$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_PYTHON_START = re.compile(r"^\[?\s*[A-Za-z_][\w.]*\(")
_JSON_START = re.compile(r"^\[?\s*\{")


@dataclass(frozen=True)
class Call:
    """One function call: its name, positional and keyword arguments (literal values)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def text(self) -> str:
        """The call in Python syntax, as BFCL's decoder writes it (``f(a=1, b='x')``)."""
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"

    @property
    def short(self) -> str:
        """``text`` cut to 60 characters, for one-line messages."""
        return self.text if len(self.text) <= 60 else f"{self.text[:57]}..."


@dataclass(frozen=True)
class Malformed:
    """A turn that tried to call functions and could not be read; ``reason`` says why."""

    reason: str


def parse_calls(text: str) -> list[Call] | Malformed:
    """The calls of a model turn (``[]``: no call), or ``Malformed``."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced is not None:
        body = fenced.group(1).strip()
    if body in ("", "[]"):
        return []
    if _JSON_START.match(body):
        return _json_calls(body)
    if _PYTHON_START.match(body):
        return _python_calls(body)
    return []


def parse_gold_call(text: str) -> Call:
    """One gold call of BFCL's answers (Python syntax); ``ValueError`` if it is not one."""
    parsed = _python_calls(text)
    if isinstance(parsed, Malformed) or len(parsed) != 1:
        raise ValueError(f"BFCL gold call {text!r} is not one function call: {parsed}")
    return parsed[0]


def _python_calls(body: str) -> list[Call] | Malformed:
    # As BFCL's decoder: brackets added when missing, then a list of calls.
    source = body if body.startswith("[") else f"[{body}"
    source = source if source.endswith("]") else f"{source}]"
    try:
        tree = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        detail = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        return Malformed(f"not Python call syntax ({detail})")
    elements = tree.elts if isinstance(tree, ast.List | ast.Tuple) else [tree]
    calls: list[Call] = []
    for i, element in enumerate(elements):
        if not isinstance(element, ast.Call):
            return Malformed(f"item {i + 1} of the list is not a function call")
        call = _python_call(element)
        if isinstance(call, Malformed):
            return call
        calls.append(call)
    return calls


def _python_call(node: ast.Call) -> Call | Malformed:
    name = ast.unparse(node.func)
    if not _NAME.match(name):
        return Malformed(f"{name!r} is not a function name")
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Starred):
            return Malformed(f"{name}: *arguments are not allowed")
        value = _literal(arg, f"{name}: argument {i + 1}")
        if isinstance(value, Malformed):
            return value
        args.append(value)
    for keyword in node.keywords:
        if keyword.arg is None:
            return Malformed(f"{name}: **arguments are not allowed")
        value = _literal(keyword.value, f"{name}: argument {keyword.arg}")
        if isinstance(value, Malformed):
            return value
        kwargs[keyword.arg] = value
    return Call(name, tuple(args), kwargs)


def _literal(node: ast.expr, where: str) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as exc:
        detail = str(exc) if "digits" in str(exc) else "not a literal value"
        return Malformed(f"{where} is {detail}: write numbers, strings, lists, dicts, True, False or None")


def _json_calls(body: str) -> list[Call] | Malformed:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        return Malformed(f"not JSON ({exc})")
    items = data if isinstance(data, list) else [data]
    calls: list[Call] = []
    for i, item in enumerate(items):
        if not (isinstance(item, dict) and isinstance(item.get("function"), str)):
            return Malformed(f'item {i + 1} is not an object with a "function" name and "parameters"')
        name, parameters = item["function"], item.get("parameters", {})
        if not _NAME.match(name):
            return Malformed(f"{name!r} is not a function name")
        if not isinstance(parameters, dict):
            return Malformed(f'{name}: "parameters" must be an object of argument names to values')
        calls.append(Call(name, (), parameters))
    return calls
