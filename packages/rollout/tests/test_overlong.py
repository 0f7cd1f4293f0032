"""rollout.overlong applied to trajectories: the penalty of the generated tokens lands on the outcome
reward, observation tokens do not count, and the raw score stays."""

from __future__ import annotations

import pytest

from ppo_rollout.config import OverlongSettings, RolloutSettings
from ppo_rollout.overlong import shape_overlong
from ppo_rollout.trajectory import Segment, Trajectory


def _trajectory(generated: list[int], observations: list[int] = (), reward: float = 1.0) -> Trajectory:
    """Turns of ``generated[k]`` tokens, turn ``k``'s reply ``observations[k]`` tokens long."""
    segments: list[Segment] = []
    for turn, n in enumerate(generated):
        segments.append(Segment(tuple(range(n)), True, turn, (-0.5,) * n))
        if turn < len(observations):
            segments.append(Segment((7,) * observations[turn], False, turn))
    return Trajectory(0, (1, 2), tuple(segments)).with_reward(reward)


# max_len 10, buffer 4, factor 0.5: free up to 6 tokens, then -0.125 a token down to -0.5 at 10.
@pytest.mark.parametrize(
    ("length", "expected"), [(0, 0.0), (6, 0.0), (7, -0.125), (8, -0.25), (9, -0.375), (10, -0.5)]
)
def test_penalty_of_the_generated_tokens_lands_on_the_reward(length: int, expected: float) -> None:
    (shaped,) = shape_overlong(
        [_trajectory([length])], OverlongSettings(buffer_len=4, penalty_factor=0.5), 10
    )
    assert shaped.reward == pytest.approx(1.0 + expected)
    assert shaped.score == 1.0  # raw, for accuracy and dynamic sampling


def test_observation_tokens_do_not_count() -> None:
    settings = OverlongSettings(buffer_len=4, penalty_factor=1.0)
    # 3 + 3 generated tokens around a 20-token reply: 6 generated, within the free part.
    (shaped,) = shape_overlong([_trajectory([3, 3], [20], reward=0.0)], settings, 10)
    assert shaped.reward == 0.0
    (longer,) = shape_overlong([_trajectory([4, 4], [20], reward=0.0)], settings, 10)
    assert longer.reward == pytest.approx(-0.5)  # 8 generated: 2 of 4 buffer tokens
    assert longer.score == 0.0
    assert longer.segments == _trajectory([4, 4], [20]).segments


@pytest.mark.parametrize(
    "settings", [None, OverlongSettings(buffer_len=0), OverlongSettings(buffer_len=4, penalty_factor=0)]
)
def test_off(settings: OverlongSettings | None) -> None:
    t = _trajectory([10])
    assert shape_overlong([t], settings, 10) == [t]


def test_buffer_longer_than_the_response_limit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"rollout.overlong.buffer_len=9 exceeds the response limit 8"):
        RolloutSettings(sampling={"max_new_tokens": 8}, overlong={"buffer_len": 9})  # type: ignore[arg-type]
    assert RolloutSettings(sampling={"max_new_tokens": 8}, overlong={"buffer_len": 8}).overlong  # type: ignore[arg-type]
