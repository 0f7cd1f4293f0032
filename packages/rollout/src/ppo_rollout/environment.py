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

Every call -- the factory, ``reset``, ``step`` -- is bounded by ``rollout.multi_turn.env_timeout_s``;
an exception, a timeout or a result of the wrong type (a reward or an ``info`` value that is not a
finite number, an observation that is not valid text) becomes an :class:`EnvironmentFailure` naming
the environment, the dataset row and the turn. Plain functions run on daemon threads
(:class:`DaemonThreadPool`): one that never returns is left behind and cannot keep the process from
exiting. An ``async def`` that blocks the event loop instead of awaiting (``time.sleep``) is caught by
``loop_watch``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .specs import import_named
from .user_marks import user_code

__all__ = [
    "Action",
    "DaemonThreadPool",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentFailure",
    "EnvironmentStop",
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


class EnvironmentStop(EnvironmentFailure):
    """A failure that stops the run whatever ``on_env_error`` says: the environment could not be made,
    or an ``async`` method blocked the event loop (every trajectory of the step waited on it)."""


class DaemonThreadPool(concurrent.futures.Executor):
    """Runs plain-function environment calls on daemon threads, as many as calls wait at once.

    Unlike ``ThreadPoolExecutor`` (whose workers the interpreter joins at exit), a call that never
    returns -- its ``env_timeout_s`` already reported -- holds one thread and nothing else: the run
    still stops, and the process exits. A free thread takes the next call; a new one starts when
    none is free.
    """

    def __init__(self, name: str = "environment") -> None:
        self._name = name
        self._calls: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._closed = False

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise RuntimeError("the environment thread pool is shut down")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call = (lambda: fn(*args, **kwargs)) if kwargs else fn
        with self._lock:
            start = self._idle == 0
            if start:
                self._threads += 1
            else:
                self._idle -= 1
        self._calls.put((future, call, () if kwargs else args))
        if start:
            name = f"{self._name}_{self._threads}"
            threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the caller, as ThreadPoolExecutor does
                    future.set_exception(exc)
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Ends the idle threads; a thread still inside a call ends when (if ever) it returns."""
        self._closed = True
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._calls.put(None)


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
    (so a slow environment never stalls the event loop that feeds the engines). A coroutine runs
    marked as ``where`` for ``loop_watch``, which names it if it blocks the loop."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(user_code(fn(*args), where), timeout_s)
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
    if isinstance(result.observation, str):
        try:
            result.observation.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise EnvironmentFailure(
                f"{where}: step() returned an observation that is not valid text ({exc.reason}: "
                f"{result.observation[exc.start : exc.end]!r} at character {exc.start}); return UTF-8 "
                "text (decode bytes with errors='replace')"
            ) from None
    _check_info(result.info, where)
    return result


def _check_info(info: object, where: str) -> None:
    if not isinstance(info, Mapping):
        raise EnvironmentFailure(f"{where}: step() returned info={info!r}; give a dict of str to number")
    for key, value in info.items():
        if not isinstance(key, str):
            raise EnvironmentFailure(f"{where}: step() returned an info key {key!r}; keys are strings")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise EnvironmentFailure(
                f"{where}: step() returned info[{key!r}]={value!r} ({type(value).__name__}); info values "
                "are finite numbers (they are averaged into the step's metrics)"
            )
