"""One step's rollout: every prompt group's rollout function at once, in one event loop.

Each call of the rollout function is bounded (``rollout.multi_turn.rollout_timeout_s``) and named
when it fails; a user's function and every ``async`` environment call are watched for blocking the
loop (``loop_watch``). With ``on_env_error: zero`` the step's environment errors are counted and
bounded (``env_errors``).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from . import env_errors
from .config import MultiTurnSettings
from .environment import EnvironmentFailure
from .generate_client import BatchGenerator, GenerateClient
from .loop_watch import LoopWatch, user_code
from .participant import PARTICIPANT
from .rollout_fns import BUILTIN_ROLLOUT_FUNCTIONS, PromptGroup, RolloutContext, RolloutFn
from .trajectory import Trajectory

T = TypeVar("T")

__all__ = ["RolloutRun", "run_rollout"]


@dataclass(frozen=True)
class RolloutRun:
    """The step's trajectories (prompt-major, each group's in the order its function returned them),
    the wall seconds of the rollout, and the share of engine time no generate call used."""

    trajectories: list[Trajectory]
    seconds: float
    engine_idle_share: float
    engine_calls: int


@dataclass(frozen=True)
class ClientSeeds:
    """Where the client's seeds come from: the run's seed, the step, and the stream (train, eval)."""

    seed: int
    step: int
    stream: int


def run_rollout(
    fn: RolloutFn,
    fn_name: str,
    groups: Sequence[PromptGroup],
    engines: Sequence[BatchGenerator],
    make_context: Callable[[GenerateClient], RolloutContext],
    seeds: ClientSeeds,
    timeout_s: float,
) -> RolloutRun:
    """Runs ``fn`` on every group; the first failure cancels the rest and is raised as it is."""

    async def every_group() -> RolloutRun:
        client = GenerateClient(
            engines, seed=seeds.seed, step=seeds.step, stream=seeds.stream, timeout_s=timeout_s
        )
        ctx = make_context(client)
        limits = ctx.limits
        client.order = limits.turn_order
        bound = rollout_bound(limits, timeout_s)
        started = time.perf_counter()
        calls = [((g.index,), partial(_bounded, fn, fn_name, ctx, g, bound)) for g in groups]
        results = await run_participants(client, limits.env_timeout_s, calls)
        seconds = time.perf_counter() - started
        trajectories: list[Trajectory] = []
        for group, result in zip(groups, results, strict=True):
            trajectories.extend(_checked(result, group, fn_name))
        if limits.on_env_error == "zero":
            env_errors.check_share(trajectories, seeds.step, ctx.environment_name, limits.max_env_error_share)
        return RolloutRun(trajectories, seconds, client.idle_share(seconds), sum(client.calls))

    return asyncio.run(every_group())


async def run_participants(
    client: GenerateClient,
    env_timeout_s: float,
    calls: Sequence[tuple[tuple[int, ...], Callable[[], Coroutine[Any, Any, T]]]],
) -> list[T]:
    """Each call as the task of its participant (``client.join(key)``, ``PARTICIPANT`` set to ``key`` in
    its context), under the environment steps' loop watch; the results in order. The first failure
    cancels the rest, waits out every engine call of the step (``client.drain``) and is raised as it
    is; the client is closed either way."""
    running: list[asyncio.Task[T]] = []
    try:
        watch = LoopWatch(env_timeout_s, "rollout.multi_turn.env_timeout_s")
        async with watch, asyncio.TaskGroup() as tasks:
            for key, make in calls:
                client.join(key)
                context = contextvars.copy_context()
                context.run(PARTICIPANT.set, key)
                running.append(tasks.create_task(make(), context=context))
    except BaseExceptionGroup as group_error:
        await client.drain()  # no engine call of this step may outlive it
        raise group_error.exceptions[0] from None
    finally:
        client.close()
    return [task.result() for task in running]


def rollout_bound(limits: MultiTurnSettings, timeout_s: float) -> float:
    """``rollout_timeout_s``, or what a trajectory of ``max_turns`` full waits could take."""
    if limits.rollout_timeout_s is not None:
        return limits.rollout_timeout_s
    return limits.max_turns * (timeout_s + limits.env_timeout_s) + 2 * limits.env_timeout_s


async def _bounded(
    fn: RolloutFn, fn_name: str, ctx: RolloutContext, group: PromptGroup, bound: float
) -> list[Trajectory]:
    """``fn(ctx, group)`` within ``bound`` seconds; a failure names the function and the prompt."""
    what = f"rollout function {fn_name} (rollout.rollout_function) on prompt {group.index}"
    coro: Coroutine[Any, Any, list[Trajectory]] = fn(ctx, group)
    if fn_name not in BUILTIN_ROLLOUT_FUNCTIONS:
        coro = user_code(coro, what)
    try:
        return await named_within(coro, what, bound, "return")
    finally:
        ctx.client.leave((group.index,))


async def named_within(coro: Coroutine[Any, Any, T], what: str, bound: float, ending: str) -> T:
    """``coro`` within ``bound`` seconds (``rollout.multi_turn.rollout_timeout_s``); a timeout or a
    failure is raised naming ``what``, an environment's own failure as it is (it names the environment,
    the row and the turn)."""
    try:
        return await asyncio.wait_for(coro, bound)
    except TimeoutError:
        raise TimeoutError(
            f"{what}: did not {ending} within {bound:g} s (rollout.multi_turn.rollout_timeout_s)"
        ) from None
    except (EnvironmentFailure, env_errors.EnvErrorShare):
        raise
    except Exception as exc:
        raise RuntimeError(f"{what}: raised {type(exc).__name__}: {exc}") from exc


def _checked(result: object, group: PromptGroup, fn_name: str) -> list[Trajectory]:
    if not isinstance(result, list) or not all(isinstance(t, Trajectory) for t in result):
        raise ValueError(
            f"rollout function {fn_name} returned {type(result).__name__} for prompt {group.index}; "
            "return a list of ppo_rollout.Trajectory"
        )
    if len(result) != group.samples:
        raise ValueError(
            f"rollout function {fn_name} returned {len(result)} trajectories for prompt {group.index}; "
            f"it must return rollout.sampling.n_samples_per_prompt = {group.samples}"
        )
    for t in result:
        if t.prompt_index != group.index or t.num_turns == 0:
            raise ValueError(
                f"rollout function {fn_name}: a trajectory of prompt {group.index} has prompt_index "
                f"{t.prompt_index} and {t.num_turns} turns; build it from the group with at least one turn"
            )
    return result
