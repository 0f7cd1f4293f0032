"""Partial rollouts of multi-turn trajectories (``rollout.partial`` with ``multi_turn``): trajectories
pause inside a turn or between turns, keep their environment, continue under the next weight version,
and a resumed rollout replays its environments and continues exactly.

Real parts: the guess-a-digit tiny model's generation cores in this process (conftest's in-process
engine, here with the built-in engine's per-request limits, stops and early stop, and a weight version
the test sets), the package's ``guess_number`` environment, the real partial-rollout code.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import LocalEngine

from ppo_rollout.config import MultiTurnSettings, PartialSettings, RolloutConfig, SamplingSettings
from ppo_rollout.engine.core import GenerationCore, GenerationOutput
from ppo_rollout.engine.early_stop import EarlyStop
from ppo_rollout.environment import Action, StepResult
from ppo_rollout.environments.guess import GuessNumberEnvironment
from ppo_rollout.observation import ObservationRenderer
from ppo_rollout.partial import OpenGroups, OpenSample
from ppo_rollout.partial_step import PartialRollout, PartialStep, sample_limits
from ppo_rollout.rollout_fns import ContextEnvironment, ContextTools, PromptGroup, multi_turn
from ppo_rollout.stops import RequestStop
from ppo_rollout.tasks import get_task
from ppo_rollout.trajectory import Trajectory

PROMPTS, SAMPLES = 4, 2


class _Reply:
    def __init__(self, value: str) -> None:
        self.value = value

    def result(self, timeout_s: float) -> str:
        return self.value


class VersionedEngine(LocalEngine):
    """conftest's in-process engine with the options the built-in engine takes (per-request limits,
    stops, an early stop) and a weight version (``version``, set by the test: a weight update)."""

    def __init__(self, core: GenerationCore, name: str) -> None:
        super().__init__(core)
        self.name, self.version = name, 0
        self.requests: list[tuple[list[int], int]] = []  # every request: its input ids and its limit

    def _generate_with(self, prompts: Any, sampling: Any, seed: int, options: dict[str, Any]) -> Any:
        with LocalEngine.COMPUTE:
            return self.core.generate(prompts, sampling, seed, **options)

    def submit_generate(  # type: ignore[override]
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Any,
        seed: int,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[RequestStop] | None = None,
        until: EarlyStop | None = None,
    ) -> Any:
        limits = list(max_new_tokens or [sampling.max_new_tokens] * len(prompts))
        self.requests += [(list(p), n) for p, n in zip(prompts, limits, strict=True)]
        sequences = None if stop is None else [[list(q) for q in s.token_ids] for s in stop]
        options = {"max_new_tokens": max_new_tokens, "stop": sequences, "until": until}
        future = self.pool.submit(self._generate_with, prompts, sampling, seed, options)

        def wait(timeout_s: float) -> list[GenerationOutput]:
            out: list[GenerationOutput] = future.result(timeout_s)
            return out

        return wait

    def endpoint(self) -> VersionedEngine:
        return self

    def get_weight_version(self) -> _Reply:
        return _Reply(str(self.version))


class Guess(GuessNumberEnvironment):
    """The package's guess-a-number environment ("+" higher, "-" lower), each instance numbered and
    every reset and step written down; ``swapped`` turns the replies around (an environment that
    answers otherwise after a resume)."""

    log: ClassVar[list[tuple[int, str, int]]] = []
    serials: ClassVar[Iterator[int]] = itertools.count()
    swapped: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__(higher_text="+", lower_text="-")
        self.serial = next(Guess.serials)

    def reset(self, row: Mapping[str, Any]) -> None:
        Guess.log.append((self.serial, "reset", -1))
        super().reset(row)

    def step(self, action: Action) -> StepResult:
        Guess.log.append((self.serial, "step", action.turn))
        result = super().step(action)
        if Guess.swapped and result.observation in ("+", "-"):
            result = replace(result, observation="-" if result.observation == "+" else "+")
        return result


def _config(tiny: Path, **partial: Any) -> RolloutConfig:
    # Turns of up to 20 tokens ending on one of three digits: some run past the engine's first early
    # stop check (every 16 decode steps in a batch, every 2 in slots), so calls end with turns running.
    settings = {"enabled": True, "finish_fraction": 0.75, "token_budget": 50, "max_staleness": 9, **partial}
    return RolloutConfig(
        model_path=str(tiny),
        task="guess_digit",
        prompts_per_step=PROMPTS,
        sampling=SamplingSettings(
            temperature=1.0, max_new_tokens=20, n_samples_per_prompt=SAMPLES, stop_token_ids=(4, 5, 6)
        ),
        multi_turn=MultiTurnSettings(max_turns=4, max_response_tokens=40, max_observation_tokens=16),
        partial=PartialSettings(**settings),
        eval_prompts=0,
        seed=5,
        timeout_s=60.0,
    )


class Rollout:
    """A partial rollout of ``multi_turn`` against ``Guess`` over two engines, and its steps' prompts."""

    def __init__(self, tiny: Path, tokenizer: Any, **partial: Any) -> None:
        self.config = config = _config(tiny, **partial)
        self.pool = concurrent.futures.ThreadPoolExecutor(4)
        renderer = ObservationRenderer(tokenizer, chat_template=False, max_tokens=16)
        tools = ContextTools(
            tokenizer, config.multi_turn, renderer, ContextEnvironment(Guess, "guess", pool=self.pool)
        )
        limits = sample_limits(multi_turn, config.resolved_rollout_function, config)
        self.partial = PartialRollout(config, limits, 2, tools)
        self.engines = [VersionedEngine(GenerationCore(tiny, refill_every=2), f"e{j}") for j in range(2)]
        self.tokenizer = tokenizer

    def step(self, step: int, version: int) -> PartialStep:
        """Step ``step`` with the engines at weight ``version``."""
        for engine in self.engines:
            engine.version = version
        task = get_task("guess_digit")
        rows = [task.row(10 * step + i, 7) for i in range(PROMPTS)]
        ids = tuple(self.tokenizer(rows[0]["prompt"])["input_ids"])
        new = [PromptGroup(i, row, row["prompt"], ids, SAMPLES) for i, row in enumerate(rows)]
        return self.partial.generate(step, new, self.engines)

    def paused(self) -> list[OpenSample]:
        return [s for g in self.partial.open.groups for s in g.samples if not s.finished]

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        for e in self.engines:
            e.pool.shutdown()


@pytest.fixture
def rollout(tiny: Path, tokenizer: Any) -> Iterator[Rollout]:
    Guess.log, Guess.swapped = [], False
    out = Rollout(tiny, tokenizer)
    yield out
    out.close()


def _inside(s: OpenSample) -> bool:
    """Paused inside a turn: its current turn has tokens."""
    return bool(s.turn_pieces(s.turn))


def _continuation(s: OpenSample, trained: Sequence[Trajectory]) -> Trajectory:
    """The one trained trajectory that goes on from paused ``s``."""
    found = [t for t in trained if t.response_tokens[: len(s.token_ids)] == s.token_ids]
    assert len(found) == 1
    return found[0]


def test_trajectories_pause_inside_and_between_turns_and_continue_under_the_next_version(
    rollout: Rollout,
) -> None:
    paused: list[tuple[int, OpenSample, int]] = []  # (version at the pause, the sample, its env's serial)
    trained: list[Trajectory] = []
    for step in range(1, 9):  # the samples paused at steps 1 and 2 train by step 6
        out = rollout.step(step, version=step - 1)
        m = out.metrics
        # Whole groups train, oldest first, as many as a multiple of 2 (the data-parallel size here).
        assert m["rollout/partial/trained_groups"] == len(out.groups)
        assert len(out.groups) % 2 == 0
        assert [t.prompt_index for t in out.trajectories] == [
            g for g in range(len(out.groups)) for _ in range(2)
        ]
        assert m["rollout/partial/paused_samples"] == len(rollout.paused())
        trained += out.trajectories
        if step < 3:
            paused += [(step - 1, s, s.env.serial) for s in rollout.paused()]
        elif all(
            any(t.response_tokens[: len(s.token_ids)] == s.token_ids for t in trained) for _, s, _ in paused
        ):
            break
    # Both kinds of pause happened: inside a turn (tokens of the current turn kept) and between turns
    # (the environment's reply to the last turn appended, the next turn not begun).
    assert any(_inside(s) for _, s, _ in paused)
    between = [s for _, s, _ in paused if not _inside(s) and s.turn > 0]
    assert between
    assert all(s.pieces[-1].observation for s in between)
    requested = [r for e in rollout.engines for r in e.requests]
    max_new, limit = rollout.config.sampling.max_new_tokens, rollout.config.multi_turn.max_response_tokens
    for version, s, serial in paused:
        t = _continuation(s, trained)
        n = len(s.token_ids)
        # The continuation's first request: the prompt and every token so far, id for id, with the
        # turn's tokens left as its limit.
        made = sum(len(p.token_ids) for p in s.turn_pieces(s.turn))
        assert ([*t.prompt_tokens, *s.token_ids], min(max_new, limit - (n - made)) - made) in requested
        # Tokens and log-probs kept exactly (0 on the environment's replies), the mask on generated ones.
        assert t.rollout_log_probs[:n] == s.log_probs
        assert t.loss_mask[:n] == tuple(int(not p.observation) for p in s.pieces for _ in p.token_ids)
        assert len(t.rollout_log_probs) == len(t.response_tokens) == len(t.loss_mask)
        # Each turn's weight version is its oldest token's: the turns before the pause (and the turn
        # paused inside) were drawn with the version of the pause, the later ones after an update.
        before = s.turn + 1 if _inside(s) else s.turn
        assert t.weight_versions[:before] == (version,) * before
        assert all(v > version for v in t.weight_versions[before:])
        assert t.num_turns > s.turn
        assert t.turn_rewards[: s.turn] == s.rewards
        # The environment lived on: the one made for the trajectory answered its later turns.
        assert [turn for serial_, what, turn in Guess.log if serial_ == serial and what == "step"] == list(
            range(t.num_turns if t.status != "length" or t.finish_reason != "length" else t.num_turns - 1)
        )
    # No environment was made again or reset twice: every trajectory kept its own from its first turn.
    resets = [serial for serial, what, _ in Guess.log if what == "reset"]
    assert len(resets) == len(set(resets))


def _stable(out: PartialStep) -> tuple[list[Trajectory], dict[str, float]]:
    """A step's trajectories and metrics without wall-clock timings."""
    trajectories = [
        replace(t, info={k: v for k, v in t.info.items() if k != "env_seconds"}) for t in out.trajectories
    ]
    return trajectories, out.metrics


@dataclass(frozen=True)
class Checkpoint:
    """A rollout's state after steps 1 and 2 (plain data), its paused samples, and its step 3."""

    state: list[dict[str, Any]]
    paused: list[OpenSample]
    step3: tuple[list[Trajectory], dict[str, float]]


@pytest.fixture(scope="module")
def checkpoint(tiny: Path, tokenizer: Any) -> Checkpoint:
    Guess.log, Guess.swapped = [], False
    rollout = Rollout(tiny, tokenizer)
    try:
        rollout.step(1, version=0)
        rollout.step(2, version=1)
        state = json.loads(json.dumps(rollout.partial.state_dict()))  # plain data: a checkpoint holds it
        paused = rollout.paused()
        return Checkpoint(state, paused, _stable(rollout.step(3, version=2)))
    finally:
        rollout.close()


def _resumed(tiny: Path, tokenizer: Any, checkpoint: Checkpoint) -> PartialStep:
    """Step 3 of a new rollout (new engines, no environments) that loaded the checkpoint."""
    resumed = Rollout(tiny, tokenizer)
    try:
        resumed.partial.load_state_dict(checkpoint.state)
        return resumed.step(3, version=2)
    finally:
        resumed.close()


def test_a_resumed_rollout_replays_its_environments_and_continues_exactly(
    checkpoint: Checkpoint, tiny: Path, tokenizer: Any
) -> None:
    assert any(s.turn > 0 and not _inside(s) for s in checkpoint.paused)  # between turns, replies given
    assert any(s.turn > 0 and _inside(s) for s in checkpoint.paused)  # inside a later turn
    Guess.log, Guess.swapped = [], False
    again = _resumed(tiny, tokenizer, checkpoint)
    assert again.metrics["rollout/partial/replay_restarts"] == 0
    assert _stable(again) == checkpoint.step3
    # Each paused trajectory's environment was made again, reset once and stepped with its turns.
    replayed = sum(s.turn for s in checkpoint.paused)
    assert sum(1 for _, what, _ in Guess.log if what == "step") >= replayed > 0


def test_a_replay_that_answers_otherwise_restarts_the_trajectory_counted(
    checkpoint: Checkpoint, tiny: Path, tokenizer: Any
) -> None:
    answered = [s for s in checkpoint.paused if s.turn > 0]  # their replay steps the environment
    Guess.swapped = True
    try:
        out = _resumed(tiny, tokenizer, checkpoint)
    finally:
        Guess.swapped = False
    assert out.metrics["rollout/partial/replay_restarts"] == len(answered) > 0
    for s in answered:  # started again from the prompt: nothing goes on from its old tokens
        assert not any(t.response_tokens[: len(s.token_ids)] == s.token_ids for t in out.trajectories)
    assert _stable(out) != checkpoint.step3


def test_stale_trajectories_restart_with_a_new_environment(tiny: Path, tokenizer: Any) -> None:
    Guess.log, Guess.swapped = [], False
    rollout = Rollout(tiny, tokenizer, max_staleness=1)
    try:
        rollout.step(1, version=0)
        started = [s for g in rollout.partial.open.groups for s in g.samples if s.pieces]
        assert any(not s.finished for s in started)
        logged = len(Guess.log)
        out = rollout.step(2, version=2)  # version 0's tokens would train 2 versions old
    finally:
        rollout.close()
    assert out.metrics["rollout/partial/restarted_samples"] == len(started)
    assert all(0 not in t.weight_versions for t in out.trajectories)
    later = Guess.log[logged:]
    # A restarted trajectory gets a new environment (reset once); its old one is never called again.
    resets = [serial for serial, what, _ in later if what == "reset"]
    assert len(resets) == len(set(resets)) == PROMPTS * SAMPLES + len(started)
    old = {s.env.serial for s in started if s.env is not None}
    assert not any(serial in old for serial, _, _ in later)


def test_multi_turn_state_is_plain_data_and_older_states_load() -> None:
    groups = OpenGroups()
    state = [
        {
            "row": {"prompt": "?>", "label": "3"},
            "prompt_text": "?>",
            "prompt_ids": [1, 2],
            "born": 1,
            "samples": [
                {
                    "limit": 40,
                    "finish_reason": None,
                    "restarts": 0,
                    "pieces": [
                        [[7, 8], [-0.25, -0.5], 3, 0, False],
                        [[9], [], -1, 0, True],
                        [[4], [-1.0], 4, 1, False],
                    ],
                    "rewards": [0.1],
                    "info": {"valid": 1.0},
                    "status": None,
                },
                {"limit": 40, "finish_reason": "stop", "restarts": 1, "pieces": [[[5], [-0.5], 2]]},  # older
            ],
        }
    ]
    groups.load_state_dict(state)
    paused, older = groups.groups[0].samples
    assert (paused.turn, paused.token_ids, paused.log_probs, paused.oldest) == (
        1,
        (7, 8, 9, 4),
        (-0.25, -0.5, 0.0, -1.0),
        3,
    )
    assert paused.made == 3
    assert [p.turn for p in paused.turn_pieces(1)] == [1]
    assert older.trajectory(0, (1, 2), current=5).weight_versions == (2,)
    assert json.loads(json.dumps(groups.state_dict()))[0]["samples"][0] == state[0]["samples"][0]
    with pytest.raises(ValueError, match="status 'paused' is not one of"):
        groups.load_state_dict([{**state[0], "samples": [{**state[0]["samples"][0], "status": "paused"}]}])


def test_partial_takes_multi_turn_and_refuses_a_function_that_cannot_pause(tiny: Path) -> None:
    config = _config(tiny)
    assert config.resolved_rollout_function == "multi_turn"
    assert sample_limits(multi_turn, "multi_turn", config)(1, 0, 2) == [40, 40]

    async def mine(ctx: Any, group: PromptGroup) -> list[Trajectory]:
        return []

    with pytest.raises(
        ValueError,
        match=r"rollout function 'mine' cannot be paused; use rollout_function=single_turn or multi_turn",
    ):
        sample_limits(mine, "mine", config)
