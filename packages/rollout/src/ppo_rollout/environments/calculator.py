"""A calculator tool: ``<calc>expression</calc>`` in a model turn is answered by ``<result>value</result>``.

The expression is evaluated by :func:`evaluate`, which knows numbers, ``+ - * / // %``, ``**`` with a
small exponent, unary signs and parentheses, and nothing else: names, calls, attributes, subscripts and
strings are refused before anything runs, and every operand and result is held to a size bound, so
``__import__('os')``, ``().__class__`` and ``9**9**9`` are answered with an error in microseconds.

A turn without a ``<calc>`` call is the final answer: the trajectory ends and the run's reward (for
example ``math_answer``) scores that turn.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from ..environment import Action, StepResult

__all__ = ["CALL_PATTERN", "CalculatorEnvironment", "CalculatorError", "evaluate", "format_value"]

CALL_PATTERN = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_MAGNITUDE = 1e15  # every operand and intermediate result
MAX_EXPONENT = 12
TIME_LIMIT_S = 0.05

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the model reads."""


def evaluate(expression: str, *, time_limit_s: float = TIME_LIMIT_S) -> int | float:
    """The value of an arithmetic ``expression``, or ``CalculatorError`` saying why not."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, *_BINARY, *_UNARY)
    for node in nodes:
        if not isinstance(node, allowed):
            raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")
    deadline = time.monotonic() + time_limit_s
    return _eval(tree.body, deadline)


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return value


def _eval(node: ast.expr, deadline: float) -> int | float:
    if time.monotonic() > deadline:
        raise CalculatorError("took too long")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError("only numbers are allowed")
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp):
        return _checked(_UNARY[type(node.op)](_eval(node.operand, deadline)))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, deadline), _eval(node.right, deadline)
        if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or abs(left) > MAX_MAGNITUDE**0.5):
            raise CalculatorError(f"exponent above {MAX_EXPONENT} or base too large")
        if isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")


def format_value(value: int | float) -> str:
    """Integers as they are; other values to 10 significant digits, an integral float as an integer."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class CalculatorEnvironment:
    """The ``calculator`` environment: one tool call per turn, answered; a turn without one ends it.

    ``info`` per turn: ``tool_calls`` (1 when the turn called the tool) and ``tool_valid`` (1 when the
    call evaluated), so the step's metrics show the share of valid calls.
    """

    def reset(self, row: Mapping[str, Any]) -> None:
        self.row = row

    def step(self, action: Action) -> StepResult:
        calls = CALL_PATTERN.findall(action.text)
        if not calls:
            return StepResult(done=True, info={"tool_calls": 0.0, "tool_valid": 0.0})
        try:
            reply, valid = f"<result>{format_value(evaluate(calls[-1]))}</result>", 1.0
        except CalculatorError as exc:
            reply, valid = f"<result>error: {exc}</result>", 0.0
        return StepResult(observation=reply, info={"tool_calls": 1.0, "tool_valid": valid})
