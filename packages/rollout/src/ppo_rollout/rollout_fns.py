"""Rollout functions: how one prompt's samples become trajectories, chosen by name like the reward.

A rollout function is ``async def fn(ctx: RolloutContext, group: PromptGroup) -> list[Trajectory]``
returning ``group.samples`` trajectories. ``rollout.rollout_function`` names a built-in one
(``single_turn``, ``multi_turn``) or ``package.module:function``. The rollout calls it once per prompt
of the step, all of them at once in one event loop: while one waits for its environment, the
others' generation requests keep the engines busy (``generate_client``).

``ctx.generate(ids)`` continues from token ids and returns the engine's ids and log-probs as they
are; a rollout function builds the response from them and from observation ids
(``ctx.observation_ids``), never by encoding text the model wrote (``trajectory.TrajectoryBuilder``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from . import env_errors
from .config import MultiTurnSettings, SamplingConfig, SamplingSettings
from .environment import (
    Action,
    Environment,
    EnvironmentFactory,
    EnvironmentFailure,
    EnvironmentStop,
    StepResult,
    bounded_call,
    check_step_result,
)
from .observation import ObservationRenderer
from .participant import PARTICIPANT
from .specs import import_named
from .stops import RequestStop, stop_token_sequences
from .trajectory import Trajectory, TrajectoryBuilder

if TYPE_CHECKING:  # torch-free at import: the pre-flight resolves rollout functions by name
    from transformers import PreTrainedTokenizerBase

    from .generate_client import GenerateClient

__all__ = [
    "ContextCall",
    "ContextEnvironment",
    "ContextTools",
    "PromptGroup",
    "RolloutContext",
    "RolloutFn",
    "Turn",
    "cut_at_stop",
    "multi_turn",
    "register_rollout_function",
    "resolve_rollout_function",
    "single_turn",
]


@dataclass(frozen=True)
class PromptGroup:
    """One prompt of the step and how many trajectories to roll out from it."""

    index: int  # the prompt's index in the step: its samples form one group
    row: Mapping[str, Any]  # the dataset row (labels, metadata)
    prompt_text: str  # as rendered (chat template applied when on)
    prompt_ids: tuple[int, ...]
    samples: int


@dataclass(frozen=True)
class Turn:
    """One generated continuation: the engine's ids and log-probs, cut after a stop string."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str  # "stop" or "length"
    weight_version: int
    text: str  # decoded, special tokens removed


def cut_at_stop(
    token_ids: Sequence[int], stops: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> int | None:
    """The length of the shortest prefix of ``token_ids`` whose text holds one of ``stops`` (the
    token completing the stop string is kept), or ``None`` when none occurs."""
    if not stops or not any(s in decode(token_ids) for s in stops):
        return None
    low, high = 1, len(token_ids)  # binary search: once a prefix holds a stop string, longer ones do
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(token_ids[:mid]) for s in stops):
            high = mid
        else:
            low = mid + 1
    return low


@dataclass(frozen=True)
class ContextEnvironment:
    """The configured environment as a rollout function gets it: the factory (``None``: none set),
    its name (for messages), its keyword arguments (``rollout.environment_args``), and the thread pool
    plain ``def`` environments run on."""

    factory: EnvironmentFactory | None = None
    name: str = ""
    args: Mapping[str, Any] = field(default_factory=dict)
    pool: concurrent.futures.Executor | None = None


@dataclass(frozen=True)
class ContextTools:
    """What stays the same through a run: the tokenizer, the turn limits, the observation renderer,
    the environment, and whether stop strings go to the engines (``engine_stops``)."""

    tokenizer: PreTrainedTokenizerBase
    limits: MultiTurnSettings
    observations: ObservationRenderer | None = None
    environment: ContextEnvironment = field(default_factory=ContextEnvironment)
    engine_stops: bool = True


@dataclass(frozen=True)
class ContextCall:
    """What one rollout call sets: the sampling, each engine's weight version, the step."""

    sampling: SamplingSettings
    versions: tuple[int, ...]
    step: int = 0


class RolloutContext:
    """What a rollout function may use: the engines, the tokenizer, observations, the environment.

    ``tools`` stay the same through a run; ``call`` is this rollout call's sampling, weight versions
    and step. Their fields read as the context's own (``ctx.tokenizer``, ``ctx.limits``, ``ctx.step``).
    """

    def __init__(self, client: GenerateClient, tools: ContextTools, call: ContextCall) -> None:
        self.client = client
        self.tools = tools
        self.call = call
        self._stop: RequestStop | None = None

    # -- what the context was given -------------------------------------------------------------------
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.tools.tokenizer

    @property
    def limits(self) -> MultiTurnSettings:
        return self.tools.limits

    @property
    def observations(self) -> ObservationRenderer | None:
        return self.tools.observations

    @property
    def engine_stops(self) -> bool:
        return self.tools.engine_stops

    @property
    def environment(self) -> EnvironmentFactory | None:
        return self.tools.environment.factory

    @property
    def environment_name(self) -> str:
        return self.tools.environment.name

    @property
    def environment_args(self) -> dict[str, Any]:
        return dict(self.tools.environment.args)

    @property
    def env_pool(self) -> concurrent.futures.Executor | None:
        return self.tools.environment.pool

    @property
    def sampling(self) -> SamplingSettings:
        return self.call.sampling

    @property
    def versions(self) -> list[int]:
        return list(self.call.versions)

    @property
    def step(self) -> int:
        return self.call.step

    # -- generation ----------------------------------------------------------------------------------
    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    async def generate(
        self, input_ids: Sequence[int], *, n: int = 1, max_new_tokens: int | None = None
    ) -> list[Turn]:
        """``n`` continuations of ``input_ids``, each ending at eos, a stop token, a stop string
        (``rollout.multi_turn.stop``) or ``max_new_tokens`` (default ``rollout.sampling``'s)."""
        limit = self.sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
        sampling = SamplingConfig.of(
            replace(self.sampling, max_new_tokens=limit, n_samples_per_prompt=n), seed=0
        )
        outputs = await self.client.generate(input_ids, sampling, self.request_stop())
        return [self._turn(o.token_ids, o.log_probs, o.finish_reason, o.engine) for o in outputs]

    def request_stop(self) -> RequestStop | None:
        """The stop strings as the engines take them (``stops``), made once per context; None without
        stop strings or with ``engine_stops`` off (the engines then decode to each turn's limit).

        Either way each turn is cut at the first stop string in its text (:meth:`_turn`): an engine
        stop only saves the tokens after it.
        """
        if not self.limits.stop or not self.engine_stops:
            return None
        if self._stop is None:
            sequences = stop_token_sequences(
                self.limits.stop,
                lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                self.decode,
            )
            self._stop = RequestStop(tuple(self.limits.stop), sequences)
        return self._stop

    def _turn(self, ids: tuple[int, ...], log_probs: tuple[float, ...], finish: str, engine: int) -> Turn:
        cut = cut_at_stop(ids, self.limits.stop, self.decode)
        if cut is not None:
            ids, log_probs, finish = ids[:cut], log_probs[:cut], "stop"
        return Turn(ids, log_probs, finish, self.call.versions[engine], self.decode(ids))

    # -- the environment ---------------------------------------------------------------------------
    async def make_environment(self, where: str) -> Environment:
        """:meth:`new_environment` within ``env_timeout_s``, on the environments' threads (a factory
        that hangs or raises stops the run, naming the environment, whatever ``on_env_error`` says)."""
        try:
            env: Environment = await bounded_call(
                self.new_environment, timeout_s=self.limits.env_timeout_s, pool=self._pool(), where=where
            )
        except EnvironmentFailure as exc:
            cause = exc.__cause__
            raise EnvironmentStop(str(cause) if isinstance(cause, ValueError) else str(exc)) from cause
        return env

    def new_environment(self) -> Environment:
        if self.environment is None:
            raise ValueError(
                "this rollout function needs an environment: set rollout.environment (a built-in name or "
                "'package.module:factory')"
            )
        try:
            return self.environment(**self.environment_args)
        except Exception as exc:
            raise ValueError(
                f"rollout.environment={self.environment_name!r} could not be made with "
                f"rollout.environment_args={self.environment_args}: {type(exc).__name__}: {exc}"
            ) from exc

    def where(self, group: PromptGroup, sample: int, turn: int) -> str:
        row = group.row.get("index", group.row.get("id"))
        which = f"row {row}" if row is not None else f"prompt {group.prompt_text[-60:]!r}"
        return (
            f"environment {self.environment_name} on {which} (step {self.step}, prompt {group.index}, "
            f"sample {sample}), turn {turn}"
        )

    async def reset(self, env: Environment, row: Mapping[str, Any], where: str) -> float:
        """Calls ``env.reset(row)`` within the bound; returns the seconds it took."""
        started = time.perf_counter()
        await bounded_call(
            env.reset, row, timeout_s=self.limits.env_timeout_s, pool=self._pool(), where=where
        )
        return time.perf_counter() - started

    async def step_env(self, env: Environment, action: Action, where: str) -> tuple[StepResult, float]:
        """``env.step(action)`` within the bound, checked; and the seconds it took."""
        started = time.perf_counter()
        result = await bounded_call(
            env.step, action, timeout_s=self.limits.env_timeout_s, pool=self._pool(), where=where
        )
        return check_step_result(result, where), time.perf_counter() - started

    def _pool(self) -> concurrent.futures.Executor:
        if self.env_pool is None:
            raise RuntimeError("the rollout context has no thread pool for environment calls")
        return self.env_pool

    def observation_ids(self, text: str, turn_ids: Sequence[int]) -> list[int]:
        """The ids appended after the model's turn ``turn_ids`` for the environment's reply ``text``."""
        if self.observations is None:
            raise RuntimeError("the rollout context has no observation renderer")
        return self.observations.ids(text, turn_ids)


RolloutFn = Callable[[RolloutContext, PromptGroup], Coroutine[Any, Any, list[Trajectory]]]

_REGISTRY: dict[str, RolloutFn] = {}
BUILTIN_ROLLOUT_FUNCTIONS: frozenset[str] = frozenset({"single_turn", "multi_turn"})


def register_rollout_function(name: str) -> Callable[[RolloutFn], RolloutFn]:
    """Decorator: register a rollout function under ``name``."""

    def deco(fn: RolloutFn) -> RolloutFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"a rollout function named {name!r} is already registered; pick another name")
        _REGISTRY[name] = fn
        return fn

    return deco


def resolve_rollout_function(spec: str) -> RolloutFn:
    """A registered name or ``package.module:function``."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    fn = import_named("rollout.rollout_function", spec, "package.module:function", list(_REGISTRY))
    if not asyncio.iscoroutinefunction(fn):
        raise ValueError(f"rollout.rollout_function={spec!r}: not an 'async def (ctx, group)' function")
    return fn


@register_rollout_function("single_turn")
async def single_turn(ctx: RolloutContext, group: PromptGroup) -> list[Trajectory]:
    """One generation per sample: the prompt's ``samples`` continuations in one request."""
    turns = await ctx.generate(group.prompt_ids, n=group.samples)
    out = []
    for turn in turns:
        builder = TrajectoryBuilder(group.index, group.prompt_ids)
        builder.add_turn(turn.token_ids, turn.log_probs, turn.weight_version)
        out.append(builder.build("length" if turn.finish_reason == "length" else "done", turn.finish_reason))
    return out


@register_rollout_function("multi_turn")
async def multi_turn(ctx: RolloutContext, group: PromptGroup) -> list[Trajectory]:
    """Turns against ``rollout.environment`` until it says done or a limit ends the trajectory."""
    samples = [(group.index, i) for i in range(group.samples)]
    ctx.client.fork((group.index,), samples)  # each sample's turns are a participant of their own
    return list(await asyncio.gather(*(_episode(ctx, group, i) for i in range(group.samples))))


async def _episode(ctx: RolloutContext, group: PromptGroup, sample: int) -> Trajectory:
    key = (group.index, sample)
    PARTICIPANT.set(key)  # this task's requests are this sample's (turn_order: fixed)
    try:
        return await _turns(ctx, group, sample)
    finally:
        ctx.client.leave(key)


async def _turns(ctx: RolloutContext, group: PromptGroup, sample: int) -> Trajectory:
    limits, builder = ctx.limits, TrajectoryBuilder(group.index, group.prompt_ids)
    # The first turn is requested before the environment resets: every trajectory's first turn goes
    # out in the step's first wave of requests.
    pending = asyncio.ensure_future(ctx.generate(builder.input_ids, max_new_tokens=_budget(ctx, builder)))
    failure: EnvironmentFailure | None = None
    try:
        env = await ctx.make_environment(ctx.where(group, sample, 0))
        builder.count("env_seconds", await ctx.reset(env, group.row, ctx.where(group, sample, 0)))
    except EnvironmentFailure as exc:
        if isinstance(exc, EnvironmentStop):
            pending.cancel()
            raise
        failure = exc
    while True:
        (turn,) = await pending
        builder.add_turn(turn.token_ids, turn.log_probs, turn.weight_version)
        if failure is not None:
            return _failed(ctx, builder, failure, turn.finish_reason)
        if turn.finish_reason == "length":  # a cut turn runs no tool
            return builder.build("length", "length")
        action = Action(turn.text, turn.token_ids, turn.finish_reason, builder.turn - 1)
        try:
            result, seconds = await ctx.step_env(env, action, ctx.where(group, sample, builder.turn - 1))
        except EnvironmentFailure as exc:
            return _failed(ctx, builder, exc, turn.finish_reason)
        builder.count("env_seconds", seconds)
        builder.reward_last_turn(result.reward)
        for key, value in result.info.items():
            builder.count(key, float(value))
        if result.done:
            return builder.build("done", turn.finish_reason)
        if builder.turn >= limits.max_turns:
            return builder.build("max_turns", turn.finish_reason)
        observation = ctx.observation_ids(str(result.observation), turn.token_ids)
        if builder.response_length + len(observation) >= limits.max_response_tokens:
            return builder.build("length", turn.finish_reason)  # no room for the reply and a turn
        builder.add_observation(observation)
        budget = _budget(ctx, builder)
        pending = asyncio.ensure_future(ctx.generate(builder.input_ids, max_new_tokens=budget))


def _budget(ctx: RolloutContext, builder: TrajectoryBuilder) -> int:
    """The next turn's token limit: the per-turn one, within what the trajectory has left."""
    left = ctx.limits.max_response_tokens - builder.response_length
    return min(ctx.sampling.max_new_tokens, left)


def _failed(
    ctx: RolloutContext, builder: TrajectoryBuilder, failure: EnvironmentFailure, finish: str
) -> Trajectory:
    if ctx.limits.on_env_error == "stop" or isinstance(failure, EnvironmentStop):
        raise failure
    env_errors.record(str(failure))
    builder.count("env_errors")
    return builder.build("env_error", finish)
