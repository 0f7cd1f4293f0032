"""Multi-turn rollouts on the real tiny model: token in, token out, limits, environments, the client.

The engines are the built-in generation core in this process (no Ray), behind the one method the
generate client uses; every call they receive is recorded, so the tests see exactly which ids each
turn continued from.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest
from conftest import LocalEngine
from conftest import guess_groups as _groups

from ppo_rollout.config import MultiTurnSettings, SamplingConfig, SamplingSettings
from ppo_rollout.engine.core import GenerationOutput
from ppo_rollout.environment import Action, EnvironmentFailure, StepResult
from ppo_rollout.environments.guess import GuessNumberEnvironment
from ppo_rollout.generate_client import GenerateClient, call_seed
from ppo_rollout.observation import ObservationRenderer
from ppo_rollout.rollout_fns import (
    ContextCall,
    ContextEnvironment,
    ContextTools,
    PromptGroup,
    RolloutContext,
    multi_turn,
    single_turn,
)
from ppo_rollout.runner import ClientSeeds, run_rollout
from ppo_rollout.trajectory import Trajectory


def _run(
    fn: Any,
    groups: Sequence[PromptGroup],
    engines: Sequence[LocalEngine],
    tokenizer: Any,
    *,
    sampling: SamplingSettings,
    limits: MultiTurnSettings,
    environment: Any = None,
    chat_template: bool = False,
) -> list[Trajectory]:
    pool = concurrent.futures.ThreadPoolExecutor(8)
    renderer = ObservationRenderer(
        tokenizer, chat_template=chat_template, max_tokens=limits.max_observation_tokens
    )

    def context(client: GenerateClient) -> RolloutContext:
        seat = ContextEnvironment(environment, "test-env", pool=pool)
        tools = ContextTools(tokenizer, limits, renderer, seat)
        return RolloutContext(client, tools, ContextCall(sampling, (11, 12), step=3))

    try:
        run = run_rollout(fn, "fn", groups, engines, context, ClientSeeds(5, 3, 0), timeout_s=120)
    finally:
        pool.shutdown(wait=False)
    return run.trajectories


SAMPLING = SamplingSettings(temperature=1.0, max_new_tokens=3, n_samples_per_prompt=2)
# Ids 4-13 are the digits: a turn ends on a digit (or eos), or is cut after max_new_tokens.
DIGIT_STOPS = tuple(range(4, 14))
# Every id stops: each turn is one token long and ends with "stop" (the environment always runs).
ONE_TOKEN = SamplingSettings(max_new_tokens=2, n_samples_per_prompt=1, stop_token_ids=tuple(range(20)))


# -- the generate client ------------------------------------------------------------------------------
def test_requests_made_together_go_out_as_one_batch_per_engine(
    engines: list[LocalEngine], tokenizer: Any
) -> None:
    groups = _groups(tokenizer, 5, 2)
    trajectories = _run(
        single_turn, groups, engines, tokenizer, sampling=SAMPLING, limits=MultiTurnSettings()
    )
    # One call per engine: contiguous chunks of the prompts, n samples each, the engine's first seed.
    bounds = [0, 2, 5]  # round(j * 5 / 2)
    expected: list[GenerationOutput] = []
    sampling = SamplingConfig.of(SAMPLING, 0)
    for j, engine in enumerate(engines):
        (prompts, _, seed) = engine.calls[0]
        assert len(engine.calls) == 1
        assert prompts == [list(g.prompt_ids) for g in groups[bounds[j] : bounds[j + 1]]]
        assert seed == call_seed(5, 3, j, 0, 0)
        expected += engine.core.generate(prompts, sampling, seed)
    assert [t.response_tokens for t in trajectories] == [o.token_ids for o in expected]
    for t, o in zip(trajectories, expected, strict=True):  # the same draws; kernels may round alike or not
        assert t.rollout_log_probs == pytest.approx(o.log_probs, abs=1e-5)
    assert [t.prompt_index for t in trajectories] == [i for i in range(5) for _ in range(2)]
    assert {t.weight_versions for t in trajectories[:4]} == {(11,)}  # engine 0's version
    assert {t.weight_versions for t in trajectories[4:]} == {(12,)}


def test_an_engine_failure_reaches_every_request_of_its_call(tokenizer: Any) -> None:
    class Broken:
        def submit_generate(self, prompts: Any, sampling: Any, seed: int) -> Any:
            def wait(timeout_s: float) -> Any:
                raise RuntimeError("engine rollout-0: generate failed: boom")

            return wait

    groups = _groups(tokenizer, 2, 1)
    with pytest.raises(RuntimeError, match="boom"):
        _run(single_turn, groups, [Broken()], tokenizer, sampling=SAMPLING, limits=MultiTurnSettings())  # type: ignore[list-item]


# -- multi-turn: token in, token out ----------------------------------------------------------------
class RecordingGuess(GuessNumberEnvironment):
    steps: ClassVar[list[Action]] = []

    def __init__(self) -> None:
        super().__init__(higher_text="+", lower_text="-")

    def step(self, action: Action) -> StepResult:
        RecordingGuess.steps.append(action)
        return super().step(action)


def _turn_starts(t: Trajectory) -> list[int]:
    starts, position = [], 0
    for segment in t.segments:
        if segment.generated:
            starts.append(position)
        position += len(segment.token_ids)
    return starts


def test_each_turn_continues_from_the_exact_ids_so_far(engines: list[LocalEngine], tokenizer: Any) -> None:
    RecordingGuess.steps = []
    limits = MultiTurnSettings(max_turns=4, max_response_tokens=40, max_observation_tokens=16)
    groups = _groups(tokenizer, 6, 2)
    sampling = SamplingSettings(max_new_tokens=2, n_samples_per_prompt=2, stop_token_ids=DIGIT_STOPS)
    trajectories = _run(
        multi_turn, groups, engines, tokenizer, sampling=sampling, limits=limits, environment=RecordingGuess
    )
    sent = [tuple(p) for e in engines for prompts, _, _ in e.calls for p in prompts]
    assert len(trajectories) == 12
    for t in trajectories:
        response = t.response_tokens
        # Turn k + 1's input is the prompt and every earlier turn and observation, id for id.
        for start in _turn_starts(t):
            assert (*t.prompt_tokens, *response[:start]) in sent
        # One log-prob per generated token, 0 on observations; the loss mask is 1 exactly on generated tokens.
        assert len(t.rollout_log_probs) == len(response) == len(t.loss_mask) == len(t.turn_ids)
        for segment in t.segments:
            assert len(segment.log_probs) == (len(segment.token_ids) if segment.generated else 0)
        expected_mask = [int(s.generated) for s in t.segments for _ in s.token_ids]
        assert list(t.loss_mask) == expected_mask
        assert all(lp == 0.0 for lp, m in zip(t.rollout_log_probs, t.loss_mask, strict=True) if not m)
        # Limits: turns, total length, observations (no chat template: exactly their tokens).
        assert 1 <= t.num_turns <= 4
        assert len(response) <= 40
        assert all(len(s.token_ids) <= 16 for s in t.segments if not s.generated)
        if t.status == "max_turns":
            assert t.num_turns == 4
        assert t.weight_versions
        assert set(t.weight_versions) <= {11, 12}
    # A turn cut by its token limit runs no tool: the environment saw exactly the other turns.
    stepped = sum(
        1
        for t in trajectories
        for k, s in enumerate(x for x in t.segments if x.generated)
        if not (k == t.num_turns - 1 and t.status == "length" and t.finish_reason == "length")
    )
    assert len(RecordingGuess.steps) == stepped
    # The case is not vacuous: some trajectories took several turns, some turns were cut.
    assert max(t.num_turns for t in trajectories) > 1
    assert any(t.status == "length" for t in trajectories)
    assert any(t.observation_tokens > 0 for t in trajectories)


def test_max_turns_ends_a_trajectory_that_never_finishes(engines: list[LocalEngine], tokenizer: Any) -> None:
    class Never:
        def reset(self, row: Mapping[str, Any]) -> None:
            pass

        def step(self, action: Action) -> StepResult:
            return StepResult(observation="+", reward=0.25)

    limits = MultiTurnSettings(max_turns=3, max_response_tokens=200)
    trajectories = _run(
        multi_turn,
        _groups(tokenizer, 4, 1),
        engines,
        tokenizer,
        sampling=ONE_TOKEN,
        limits=limits,
        environment=Never,
    )
    for t in trajectories:
        assert t.status == "max_turns"
        assert t.num_turns == 3
        assert t.turn_rewards == (0.25, 0.25, 0.25)
        assert t.token_turn_rewards == (0.25, 0.0, 0.25, 0.0, 0.25)
        assert t.loss_mask == (1, 0, 1, 0, 1)
        assert t.turn_ids == (0, 0, 1, 1, 2)
        assert t.segments[-1].generated  # no reply after the last turn
        assert [len(s.token_ids) for s in t.segments] == [1, 1, 1, 1, 1]


def test_max_response_tokens_ends_with_length(engines: list[LocalEngine], tokenizer: Any) -> None:
    class Chatty(Raises):
        def step(self, action: Action) -> StepResult:
            return StepResult(observation="++")

    limits = MultiTurnSettings(max_turns=10, max_response_tokens=7)
    trajectories = _run(
        multi_turn,
        _groups(tokenizer, 3, 1),
        engines,
        tokenizer,
        sampling=ONE_TOKEN,
        limits=limits,
        environment=Chatty,
    )
    for t in trajectories:
        # 1 + 2 + 1 + 2 = 6 tokens; a third reply would leave no room for a turn: it is not appended.
        assert [len(s.token_ids) for s in t.segments] == [1, 2, 1, 2, 1]
        assert t.status == "length"
        assert len(t.response_tokens) <= 7


# -- environments that fail ---------------------------------------------------------------------------
class Raises:
    """An environment whose every step raises."""

    def reset(self, row: Mapping[str, Any]) -> None:
        pass

    def step(self, action: Action) -> StepResult:
        raise KeyError("missing tool")


class Hangs(Raises):
    def step(self, action: Action) -> StepResult:
        time.sleep(3)
        return StepResult(done=True)


class WrongType(Raises):
    def step(self, action: Action) -> Any:
        return {"observation": "x"}


class AsyncHangs(Raises):
    async def step(self, action: Action) -> StepResult:  # type: ignore[override]
        await asyncio.sleep(3)
        return StepResult(done=True)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (Raises, r"raised KeyError: 'missing tool'"),
        (Hangs, r"did not answer within 0.2 s \(rollout.multi_turn.env_timeout_s\)"),
        (AsyncHangs, r"did not answer within 0.2 s"),
        (WrongType, r"step\(\) returned dict, expected ppo_rollout.StepResult"),
    ],
)
def test_a_failing_environment_is_named_with_row_and_turn(
    engines: list[LocalEngine], tokenizer: Any, env: Any, message: str
) -> None:
    limits = MultiTurnSettings(env_timeout_s=0.2)
    where = r"environment test-env on row \d+ \(step 3, prompt \d, sample 0\), turn 0: "
    with pytest.raises(EnvironmentFailure, match=where + message):
        _run(
            multi_turn,
            _groups(tokenizer, 2, 1),
            engines,
            tokenizer,
            sampling=ONE_TOKEN,
            limits=limits,
            environment=env,
        )


def test_on_env_error_zero_scores_the_trajectory_and_goes_on(
    engines: list[LocalEngine], tokenizer: Any
) -> None:
    limits = MultiTurnSettings(env_timeout_s=5, on_env_error="zero", max_env_error_share=1.0)
    trajectories = _run(
        multi_turn,
        _groups(tokenizer, 2, 2),
        engines,
        tokenizer,
        sampling=ONE_TOKEN,
        limits=limits,
        environment=Raises,
    )
    assert [t.status for t in trajectories] == ["env_error"] * 4
    assert all(t.info["env_errors"] == 1.0 and t.num_turns == 1 for t in trajectories)
