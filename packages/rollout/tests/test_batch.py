"""The training batch table and the per-rank split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ppo_rollout.batch import FIELDS, balanced_split, rank_fields, split_indices, split_samples
from ppo_rollout.trajectory import Segment, Trajectory, TrajectoryBuilder, with_outcome


@given(
    st.integers(1, 4).flatmap(
        lambda d: st.tuples(
            st.just(d),
            st.lists(st.integers(1, 200), min_size=d, max_size=8 * d).filter(lambda xs: len(xs) % d == 0),
        )
    )
)
def test_balanced_split_equal_counts_each_group_once(case: tuple[int, list[int]]) -> None:
    dp, tokens = case
    parts = balanced_split(tokens, dp)
    assert len(parts) == dp
    assert sorted(g for p in parts for g in p) == list(range(len(tokens)))
    assert {len(p) for p in parts} == {len(tokens) // dp}
    loads = [sum(tokens[g] for g in p) for p in parts]
    # greedy longest-first: the spread is at most the largest group
    assert max(loads) - min(loads) <= max(tokens)


def test_balanced_split_rejects_uneven_counts() -> None:
    with pytest.raises(ValueError, match="5 prompts cannot be split evenly over 2"):
        balanced_split([1] * 5, 2)


def _sample(i: int, plen: int, rlen: int) -> Trajectory:
    segment = Segment(tuple(range(10, 10 + rlen)), True, 0, tuple(-0.5 for _ in range(rlen)))
    return Trajectory(i, tuple(range(1, plen + 1)), (segment,), reward=float(i), finish_reason="length")


def test_fields_follow_the_table() -> None:
    fields = rank_fields([_sample(3, 2, 4), _sample(3, 2, 1)])
    assert tuple(fields) == FIELDS
    assert fields["tokens"][0].tolist() == [1, 2, 10, 11, 12, 13]
    assert fields["tokens"][0].dtype == torch.int64
    assert fields["response_length"][1].tolist() == [1]
    assert fields["loss_mask"][0].dtype == torch.float32
    assert fields["loss_mask"][0].tolist() == [1.0] * 4
    assert fields["reward"][0].tolist() == [3.0]
    assert fields["rollout_log_probs"][0].shape == (4,)
    assert fields["prompt_index"][1].tolist() == [3]
    assert fields["weight_version"][0].tolist() == [-1]  # not recorded by this hand-made sample
    assert fields["turn_rewards"][0].tolist() == [0.0] * 4
    assert fields["turn_ids"][0].tolist() == [0] * 4


def test_multi_turn_fields_mask_observations_and_place_turn_rewards() -> None:
    builder = TrajectoryBuilder(5, (1, 2))
    builder.add_turn((10, 11), (-0.1, -0.2), weight_version=7)
    builder.reward_last_turn(0.5)
    builder.add_observation((20, 21, 22))
    builder.add_turn((12,), (-0.3,), weight_version=8)
    builder.reward_last_turn(-1.0)
    trajectory = builder.build("done", "stop").with_reward(2.0)
    fields = rank_fields([trajectory])
    assert fields["tokens"][0].tolist() == [1, 2, 10, 11, 20, 21, 22, 12]
    assert fields["response_length"][0].tolist() == [6]
    assert fields["loss_mask"][0].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert fields["rollout_log_probs"][0].tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0, -0.3])
    assert fields["turn_rewards"][0].tolist() == [0.0, 0.5, 0.0, 0.0, 0.0, -1.0]
    assert fields["turn_ids"][0].tolist() == [0, 0, 0, 0, 0, 1]
    assert fields["reward"][0].tolist() == [2.0]
    assert fields["weight_version"][0].tolist() == [7]  # the oldest turn's
    assert trajectory.total_reward == pytest.approx(1.5)


def test_split_indices_are_split_samples_positions() -> None:
    samples = [_sample(i, 2 + i, 1 + (i * 3) % 5) for i in range(6) for _ in range(2)]
    for dp in (1, 2, 3):
        ids = split_indices(samples, dp)
        assert [[samples[i] for i in part] for part in ids] == split_samples(samples, dp)
        assert sorted(i for part in ids for i in part) == list(range(len(samples)))


def test_split_keeps_groups_together_and_consecutive() -> None:
    samples = [_sample(i, 2 + i, 1 + (i * 3) % 5) for i in range(6) for _ in range(3)]
    parts = split_samples(samples, 3)
    assert sorted(s.prompt_index for p in parts for s in p) == sorted(s.prompt_index for s in samples)
    for part in parts:
        ids = [s.prompt_index for s in part]
        assert len(ids) == 6
        # each prompt's samples are consecutive
        assert ids == sorted(ids)
        assert all(ids.count(i) == 3 for i in set(ids))


def test_segment_checks_log_prob_count() -> None:
    with pytest.raises(ValueError, match="3 generated tokens but 2 log-probs"):
        Segment((1, 2, 3), True, 0, (0.0, 0.0))
    with pytest.raises(ValueError, match="observation segment carries no log-probs"):
        Segment((1,), False, 0, (0.0,))


def test_trajectory_checks_turn_counts() -> None:
    segment = Segment((1,), True, 0, (0.0,))
    with pytest.raises(ValueError, match="2 turn rewards for 1 turns"):
        Trajectory(0, (1,), (segment,), turn_rewards=(0.0, 1.0))


@pytest.mark.parametrize(
    ("status", "score_unfinished", "reward", "turn_rewards"),
    [
        ("done", False, 1.0, (0.5, 0.0)),
        ("max_turns", False, 0.0, (0.5, 0.0)),  # no final answer: no outcome reward, turn rewards stay
        ("length", False, 0.0, (0.5, 0.0)),
        ("max_turns", True, 1.0, (0.5, 0.0)),
        ("env_error", True, 0.0, (0.0, 0.0)),  # on_env_error: zero
    ],
)
def test_the_outcome_reward_needs_a_finished_trajectory(
    status: str, score_unfinished: bool, reward: float, turn_rewards: tuple[float, ...]
) -> None:
    builder = TrajectoryBuilder(0, (1,))
    builder.add_turn((5,), (-0.1,), weight_version=1)
    builder.reward_last_turn(0.5)
    builder.add_observation((6,))
    builder.add_turn((7,), (-0.2,), weight_version=1)
    t = with_outcome(builder.build(status, "stop"), 1.0, score_unfinished=score_unfinished)  # type: ignore[arg-type]
    assert t.reward == reward
    assert t.turn_rewards == turn_rewards
    assert t.score == (0.0 if status == "env_error" else 1.0)
