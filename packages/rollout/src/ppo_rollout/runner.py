"""One step's rollout: every prompt group's rollout function at once, in one event loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .generate_client import BatchGenerator, GenerateClient
from .rollout_fns import PromptGroup, RolloutContext, RolloutFn
from .trajectory import Trajectory

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
        started = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tasks:
                running: list[asyncio.Task[list[Trajectory]]] = [
                    tasks.create_task(fn(ctx, group)) for group in groups
                ]
        except BaseExceptionGroup as group_error:
            await client.drain()  # no engine call of this step may outlive it
            raise group_error.exceptions[0] from None
        finally:
            client.close()
        seconds = time.perf_counter() - started
        trajectories: list[Trajectory] = []
        for group, task in zip(groups, running, strict=True):
            trajectories.extend(_checked(task.result(), group, fn_name))
        return RolloutRun(trajectories, seconds, client.idle_share(seconds), sum(client.calls))

    return asyncio.run(every_group())


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
