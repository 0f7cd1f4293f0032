"""The simulated APIs of one question, made fresh for each trajectory, and calls into them.

The instances are made as BFCL's executor makes them (``multi_turn_utils.execute_multi_turn_func_call``):
each involved class from its module, its scenario loaded from a deep copy of the question's
``initial_config`` (stateless classes take none), the long-context scenario for that category. BFCL
keeps them in its module's globals under a name made of the model and the question; here each
``SimulatedAPIs`` owns its own, so no two trajectories share one.

A call is dispatched by name to a public method of the instances (a later class's method wins a name
two share, as in BFCL); it is never ``eval``-ed. What a call returns is turned into text as BFCL does
(a ``str`` as it is, a ``dict`` as JSON, anything else by ``str``), and an exception becomes
``Error during execution: <message>``, so the checker compares what BFCL would compare.

Each model call runs on a thread of its own within ``timeout_s``. One that does not return in time is
answered with a one-line error naming the call and the setting; the thread cannot be stopped, so it may
still change the instances, and every later call of this trajectory is refused (the checker scores it
0). A call that would hold the interpreter itself for long, a single huge integer power or a precision
of millions of digits (no thread switch happens inside one), is refused before it runs.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import json
import math
import threading
from collections.abc import Callable
from typing import Any

from .calls import Call
from .data import CLASS_FILE_PATH_MAPPING, STATELESS_CLASSES, Question

__all__ = ["BLOCKED", "ERROR_PREFIX", "MAX_POWER_DIGITS", "MAX_PRECISION", "SimulatedAPIs"]

ERROR_PREFIX = "Error during execution: "
BLOCKED = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})  # BFCL's list
MAX_PRECISION = 1000  # digits of MathAPI's logarithm and square_root
MAX_POWER_DIGITS = 100_000  # digits of an integer power's result
# MathAPI.logarithm sets mpmath's precision for the whole process: its calls take turns.
_MPMATH = threading.Lock()


def _instance(class_name: str, question: Question) -> Any:
    module = importlib.import_module(CLASS_FILE_PATH_MAPPING[class_name])
    instance = getattr(module, class_name)()
    if class_name not in STATELESS_CLASSES:
        state = copy.deepcopy(question.initial_config.get(class_name, {}))
        instance._load_scenario(state, long_context=question.long_context)
    return instance


class SimulatedAPIs:
    """The involved classes of ``question``, instantiated afresh; ``instances`` by class name."""

    def __init__(self, question: Question) -> None:
        self.instances: dict[str, Any] = {
            name: _instance(name, question) for name in question.involved_classes
        }
        self.methods: dict[str, tuple[str, Callable[..., Any]]] = {}
        for class_name, instance in self.instances.items():
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = (class_name, method)
        self.stopped: str | None = None  # the call that timed out

    def run(self, call: Call, timeout_s: float | None = None) -> str:
        """The call's result as text (``timeout_s`` None: on this thread, unbounded, for gold calls)."""
        if self.stopped is not None:
            return f"{ERROR_PREFIX}no call runs after {self.stopped} timed out"
        found = self._lookup(call)
        if isinstance(found, str):
            return ERROR_PREFIX + found
        class_name, method = found
        refused = _refusal(class_name, method, call)
        if refused is not None:
            return ERROR_PREFIX + refused

        def work() -> str:
            if class_name != "MathAPI":
                return _invoke(method, call)
            with _MPMATH:
                return _invoke(method, call)

        if timeout_s is None:
            return work()
        result = _bounded(work, timeout_s, call.name)
        if result is None:
            self.stopped = call.short
            return (
                f"{ERROR_PREFIX}{call.short} did not return within {timeout_s:g} s "
                "(rollout.environment_args.call_timeout_s)"
            )
        return result

    def _lookup(self, call: Call) -> tuple[str, Callable[..., Any]] | str:
        parts = call.name.split(".")
        if parts[min(1, len(parts) - 1)] in BLOCKED:  # the name BFCL checks (after an object's name)
            return f"Function call {parts[min(1, len(parts) - 1)]} is not allowed."
        if len(parts) > 1 or call.name not in self.methods:
            return f"name {parts[0]!r} is not defined"  # what BFCL's eval says of an unknown name
        return self.methods[call.name]


def _invoke(method: Callable[..., Any], call: Call) -> str:
    """BFCL's conversion of a result to text, and of an exception to an error line."""
    try:
        result = method(*call.args, **call.kwargs)
        if type(result) is str:
            return result
        if type(result) is dict:
            try:
                return json.dumps(result)
            except Exception:  # an object that is not JSON: BFCL falls back to str
                return str(result)
        return str(result)
    except Exception as exc:
        return f"{ERROR_PREFIX}{exc}"


def _bounded(work: Callable[[], str], timeout_s: float, name: str) -> str | None:
    """``work()`` on a daemon thread; None when it has not returned within ``timeout_s``."""
    box: list[str] = []
    thread = threading.Thread(target=lambda: box.append(work()), name=f"bfcl-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else None


def _refusal(class_name: str, method: Callable[..., Any], call: Call) -> str | None:
    """Why a MathAPI call would hold the interpreter (one C operation) past any time bound, or None."""
    if class_name != "MathAPI":
        return None
    try:
        bound = inspect.signature(method).bind(*call.args, **call.kwargs).arguments
    except TypeError:
        return None  # the call raises it itself, as in BFCL
    precision = bound.get("precision")
    if isinstance(precision, int | float) and abs(precision) > MAX_PRECISION:
        return f"{call.name}: precision={precision!r} is above this environment's bound of {MAX_PRECISION}"
    base, exponent = bound.get("base"), bound.get("exponent")
    if call.name == "power" and isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        digits = exponent * max(1.0, math.log10(abs(base) + 1))
        if digits > MAX_POWER_DIGITS:
            return f"power: the result would have over {MAX_POWER_DIGITS} digits"
    return None
