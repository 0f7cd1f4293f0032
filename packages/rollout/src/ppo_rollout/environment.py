"""The environment a user writes for multi-turn rollouts, and the bounded calls the rollout makes to it.

An environment is any object with ``reset(row)`` and ``step(action) -> StepResult``, plain or
``async``; ``rollout.environment: "package.module:factory"`` names a callable that makes one per
trajectory (``rollout.environment_args`` are its keyword arguments)::

    class Guess:
        def reset(self, row):                      # the dataset row (labels, metadata)
            self.target = int(row["label"])
        def step(self, action):                    # action.text, action.token_ids, action.turn
            guess = int(action.text.strip() or -1)
            if guess == self.target:
                return StepResult(reward=1.0, done=True)
            return StepResult(observation="higher" if guess < self.target else "lower")

Every call is bounded by ``rollout.multi_turn.env_timeout_s``; an exception, a timeout or a result of
the wrong type becomes an :class:`EnvironmentFailure` naming the environment, the dataset row and
the turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .specs import import_named

__all__ = [
    "Action",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentFailure",
    "StepResult",
    "bounded_call",
    "check_step_result",
    "resolve_environment",
]


@dataclass(frozen=True)
class Action:
    """The model's turn as the environment sees it."""

    text: str  # the turn's tokens decoded, special tokens removed
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (eos, a stop token or a stop string) or "length"
    turn: int  # 0 for the first turn


@dataclass(frozen=True)
class StepResult:
    """The environment's answer to one turn.

    ``observation``: the text shown to the model before its next turn (``None`` with ``done``);
    ``reward``: this turn's reward (it lands on the turn's last generated token); ``done``: the
    trajectory ends here; ``info``: numbers averaged into the step's metrics as ``rollout/env/<key>``.
    """

    observation: str | None = None
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """One trajectory's environment (methods may be ``async def``)."""

    def reset(self, row: Mapping[str, Any]) -> Any: ...
    def step(self, action: Action) -> Any: ...


EnvironmentFactory = Callable[..., Environment]


class EnvironmentFailure(RuntimeError):
    """The environment raised, timed out or answered with the wrong type (``on_env_error`` decides)."""


def resolve_environment(spec: str) -> EnvironmentFactory:
    """``package.module:factory`` (a class or a function returning an environment), or a built-in name."""
    from .environments import BUILTIN_ENVIRONMENTS

    if spec in BUILTIN_ENVIRONMENTS:
        spec = BUILTIN_ENVIRONMENTS[spec]
    factory = import_named("rollout.environment", spec, "package.module:factory", list(BUILTIN_ENVIRONMENTS))
    if not callable(factory):
        raise ValueError(f"rollout.environment={spec!r}: {type(factory).__name__} is not callable")
    return factory


async def bounded_call(
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float,
    pool: concurrent.futures.Executor,
    where: str,
) -> Any:
    """``fn(*args)`` within ``timeout_s``: awaited when it is a coroutine function, else run on ``pool``
    (so a slow environment never stalls the event loop that feeds the engines)."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout_s)
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(pool, fn, *args), timeout_s)
    except TimeoutError:
        raise EnvironmentFailure(
            f"{where}: did not answer within {timeout_s:g} s (rollout.multi_turn.env_timeout_s)"
        ) from None
    except EnvironmentFailure:
        raise
    except Exception as exc:
        raise EnvironmentFailure(f"{where}: raised {type(exc).__name__}: {exc}") from exc


def check_step_result(result: object, where: str) -> StepResult:
    """``result`` as a ``StepResult``, or an ``EnvironmentFailure`` saying what came instead."""
    if not isinstance(result, StepResult):
        raise EnvironmentFailure(
            f"{where}: step() returned {type(result).__name__}, expected ppo_rollout.StepResult("
            "observation=..., reward=..., done=...)"
        )
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvironmentFailure(f"{where}: step() returned reward={reward!r}; give a finite float")
    if not result.done and not isinstance(result.observation, str):
        raise EnvironmentFailure(
            f"{where}: step() returned done=False without a string observation; return the text the "
            "model should read next, or done=True"
        )
    return result
