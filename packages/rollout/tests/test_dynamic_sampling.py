"""Dynamic sampling's selection loop, driven by a scripted rollout: exact group counts, the round
bound, padding that keeps the batch divisible, the raw-score filter with shaped rewards present, and
float32 near-constant groups dropped."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_rollout.batch import split_indices
from ppo_rollout.config import DynamicSamplingSettings, RolloutSettings
from ppo_rollout.dynamic_sampling import DynamicSamplingExhausted, has_signal, raw_score, select_groups
from ppo_rollout.trajectory import Segment, Trajectory

Scores = Sequence[float]


def _group(
    index: int, scores: Scores, rewards: Scores | None = None, turns: Sequence[Scores] = ()
) -> list[Trajectory]:
    out = []
    for k, score in enumerate(scores):
        turn_rewards = tuple(turns[k]) if turns else (0.0,)
        segments = tuple(Segment((5,), True, turn, (-1.0,)) for turn in range(len(turn_rewards)))
        reward = score if rewards is None else rewards[k]
        t = Trajectory(index, (1,), segments, turn_rewards=turn_rewards).with_reward(reward, score=score)
        out.append(t)
    return out


class Script:
    """``roll``: each round hands out the next scripted groups, as many as asked, and records the asks."""

    def __init__(self, rounds: Sequence[Sequence[Scores]]) -> None:
        self.rounds = list(rounds)
        self.asked: list[int] = []

    def __call__(self, round_: int, prompts: int) -> list[list[Trajectory]]:
        assert round_ == len(self.asked)
        self.asked.append(prompts)
        scripted = self.rounds[round_] if round_ < len(self.rounds) else [[0.0, 0.0]] * prompts
        assert len(scripted) == prompts, (round_, prompts, len(scripted))
        return [_group(i, s) for i, s in enumerate(scripted)]


def _scores(groups: Sequence[Sequence[Trajectory]]) -> list[list[float]]:
    return [[t.score for t in g] for g in groups]


VARY_A, VARY_B, VARY_C, VARY_D = [0.0, 1.0], [1.0, 0.0], [0.0, 0.5], [0.5, 1.0]
WRONG, RIGHT = [0.0, 0.0], [1.0, 1.0]


def test_rounds_refill_to_exactly_the_target_in_prompt_order() -> None:
    script = Script([[WRONG, VARY_A, RIGHT, VARY_B, WRONG, VARY_C], [VARY_D, [0.2, 0.3]]])
    chosen = select_groups(script, 4, DynamicSamplingSettings(enabled=True, over_sample=1.5))
    assert script.asked == [6, 2]  # ceil(1.5 x 4), then ceil(1.5 x 1)
    # The three of round 0 and the first of round 1; the extra one is discarded.
    assert _scores(chosen.groups) == [VARY_A, VARY_B, VARY_C, VARY_D]
    assert [[t.prompt_index for t in g] for g in chosen.groups] == [[0, 0], [1, 1], [2, 2], [3, 3]]
    assert chosen.metrics == {
        "rollout/dynamic/all_correct_groups": 1 / 8,
        "rollout/dynamic/all_wrong_groups": 2 / 8,
        "rollout/dynamic/rounds": 2.0,
        "rollout/dynamic/kept_groups": 4.0,
        "rollout/dynamic/padded_groups": 0.0,
        "rollout/dynamic/samples_generated_per_trained": 16 / 8,
    }


def test_one_round_when_the_first_is_enough() -> None:
    script = Script([[VARY_A, VARY_B]])
    chosen = select_groups(script, 2, DynamicSamplingSettings(enabled=True))
    assert script.asked == [2]
    assert chosen.metrics["rollout/dynamic/rounds"] == 1.0
    assert chosen.metrics["rollout/dynamic/samples_generated_per_trained"] == 1.0


def test_stop_after_max_rounds_names_the_setting() -> None:
    script = Script([[WRONG, VARY_A], [RIGHT], [WRONG]])
    with pytest.raises(DynamicSamplingExhausted) as caught:
        select_groups(script, 2, DynamicSamplingSettings(enabled=True, max_rounds=3))
    assert script.asked == [2, 1, 1]  # never a fourth round
    message = str(caught.value)
    assert "\n" not in message
    assert "kept 1 of 2 groups" in message
    assert "rollout.dynamic_sampling.max_rounds=3" in message
    assert "on_exhausted=pad" in message


def test_pad_fills_with_dropped_groups_and_stays_divisible() -> None:
    script = Script([[WRONG, VARY_A, RIGHT, WRONG], [RIGHT, WRONG, WRONG]])
    chosen = select_groups(script, 4, DynamicSamplingSettings(enabled=True, max_rounds=2, on_exhausted="pad"))
    assert script.asked == [4, 3]
    assert _scores(chosen.groups) == [VARY_A, WRONG, RIGHT, WRONG]  # the kept group, then the first dropped
    assert chosen.metrics["rollout/dynamic/kept_groups"] == 1.0
    assert chosen.metrics["rollout/dynamic/padded_groups"] == 3.0
    assert chosen.metrics["rollout/dynamic/all_correct_groups"] == 2 / 7
    assert chosen.metrics["rollout/dynamic/all_wrong_groups"] == 4 / 7
    for dp in (1, 2, 4):
        parts = split_indices(chosen.trajectories, dp)
        assert sorted(i for p in parts for i in p) == list(range(8))
        assert {len(p) for p in parts} == {8 // dp}


def test_the_filter_reads_the_raw_score_not_the_shaped_reward() -> None:
    # All wrong, but overlong penalties make the trained rewards differ: no signal in the task.
    shaped_wrong = _group(0, [0.0, 0.0, 0.0], rewards=[0.0, -0.25, -0.5])
    assert statistics.pstdev(t.reward for t in shaped_wrong) > 0.1
    assert not has_signal(shaped_wrong, 1e-6)
    # Both right, one shaped down: the raw scores agree, dropped as all correct.
    shaped_right = _group(1, [1.0, 1.0], rewards=[1.0, 0.5])
    assert not has_signal(shaped_right, 1e-6)
    # A multi-turn task that scores through its environment: the turn rewards vary, the score does not.
    by_turns = _group(2, [0.0, 0.0], turns=[[0.0, 1.0], [0.1, 0.0]])
    assert [raw_score(t) for t in by_turns] == [1.0, 0.1]
    assert has_signal(by_turns, 1e-6)

    def roll(round_: int, prompts: int) -> list[list[Trajectory]]:
        return [shaped_wrong, shaped_right, by_turns][:prompts]

    chosen = select_groups(roll, 1, DynamicSamplingSettings(enabled=True, over_sample=3.0))
    assert [raw_score(t) for t in chosen.trajectories] == [1.0, 0.1]
    assert {t.prompt_index for t in chosen.trajectories} == {0}
    assert chosen.metrics["rollout/dynamic/all_wrong_groups"] == 1 / 3
    assert chosen.metrics["rollout/dynamic/all_correct_groups"] == 1 / 3


def test_float32_near_constant_groups_are_dropped() -> None:
    # One reward computed in float32, the others in float64: equal to the eye, not bitwise.
    scores = [float(np.float32(0.1)), 0.1, 0.1, 0.1]
    assert statistics.pstdev(scores) > 0  # an exact `std != 0` test would keep this group
    assert not has_signal(_group(0, scores), 1e-6)
    assert has_signal(_group(0, [0.1, 0.1, 0.1, 0.1 + 1e-3]), 1e-6)


def test_a_single_sample_group_never_varies_and_the_config_says_so() -> None:
    assert not has_signal(_group(0, [1.0]), 0.0)
    with pytest.raises(
        ValueError, match=r"dynamic_sampling.enabled needs rollout.sampling.n_samples_per_prompt >= 2"
    ):
        RolloutSettings(sampling={"n_samples_per_prompt": 1}, dynamic_sampling={"enabled": True})  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    rounds=st.lists(
        st.lists(st.sampled_from([WRONG, RIGHT, VARY_A, VARY_C]), min_size=8, max_size=8),
        min_size=1,
        max_size=4,
    ),
    target=st.integers(1, 4),
    over_sample=st.sampled_from([1.0, 1.5, 2.0]),
    on_exhausted=st.sampled_from(["stop", "pad"]),
)
def test_the_batch_is_exact_or_the_run_stops(
    rounds: list[list[list[float]]], target: int, over_sample: float, on_exhausted: str
) -> None:
    asked: list[int] = []

    def roll(round_: int, prompts: int) -> list[list[Trajectory]]:
        asked.append(prompts)
        return [_group(i, s) for i, s in enumerate(rounds[round_][:prompts])]

    config = DynamicSamplingSettings(
        enabled=True,
        max_rounds=len(rounds),
        over_sample=over_sample,
        on_exhausted=on_exhausted,  # type: ignore[arg-type]
    )
    varying = sum(has_signal(_group(0, s), 1e-6) for r in rounds for s in r)
    try:
        chosen = select_groups(roll, target, config)
    except DynamicSamplingExhausted:
        assert on_exhausted == "stop"
        assert len(asked) == len(rounds)
        return
    assert len(chosen.groups) == target
    kept = int(chosen.metrics["rollout/dynamic/kept_groups"])
    assert all(has_signal(g, 1e-6) for g in chosen.groups[:kept])
    assert not any(has_signal(g, 1e-6) for g in chosen.groups[kept:])
    assert kept == target or (on_exhausted == "pad" and len(asked) == len(rounds) and kept < target)
    assert kept <= varying
    assert [t.prompt_index for t in chosen.trajectories] == [i for i in range(target) for _ in range(2)]
    assert len(asked) <= len(rounds)
