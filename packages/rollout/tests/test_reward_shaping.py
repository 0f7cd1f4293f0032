"""DAPO's overlong penalty against a hand table and the references' formulas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_rollout.reward_shaping import overlong_penalty


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (5, 0.0),
        (6, 0.0),  # max_len - buffer_len: the last length without a penalty
        (7, -0.25),
        (8, -0.5),
        (9, -0.75),
        (10, -1.0),  # max_len: the whole penalty
        (11, -1.0),  # beyond it: capped
        (50, -1.0),
    ],
)
def test_hand_table_max_10_buffer_4_factor_1(length: int, expected: float) -> None:
    assert overlong_penalty(length, max_len=10, buffer_len=4, penalty_factor=1.0) == expected


@pytest.mark.parametrize(
    ("length", "max_len", "buffer_len", "factor", "expected"),
    [
        (3000, 4096, 1024, 1.0, 0.0),
        (3072, 4096, 1024, 1.0, 0.0),
        (3584, 4096, 1024, 1.0, -0.5),
        (4096, 4096, 1024, 0.5, -0.5),
        (8, 8, 8, 2.0, -2.0),  # the buffer spans the whole length: linear from 0 tokens
        (2, 8, 8, 2.0, -0.5),
        (9, 10, 4, 0.0, 0.0),  # factor 0: no shaping
    ],
)
def test_hand_table_other_settings(
    length: int, max_len: int, buffer_len: int, factor: float, expected: float
) -> None:
    assert overlong_penalty(length, max_len, buffer_len, factor) == pytest.approx(expected)


def verl_overlong(valid_response_length: int, max_resp_len: int, buffer_len: int, factor: float) -> float:
    """verl's DAPO reward manager (commit b178a3cd56f58b2d502255daba591e92833930a7,
    verl/workers/reward_manager/dapo.py)."""
    expected_len = max_resp_len - buffer_len
    exceed_len = valid_response_length - expected_len
    return min(-exceed_len / buffer_len * factor, 0)


def openrlhf_overlong(
    valid_response_length: int, max_new_tokens: int, buffer_len: int, factor: float
) -> float:
    """OpenRLHF's apply_overlong_penalty (commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
    openrlhf/trainer/ppo_utils/length_penalty.py): the excess capped at the buffer."""
    expected_len = max_new_tokens - buffer_len
    if valid_response_length > expected_len:
        exceed_len = min(valid_response_length - expected_len, buffer_len)
        return -exceed_len / buffer_len * factor
    return 0.0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.data(), st.floats(0, 4))
def test_matches_verl_up_to_max_len_and_openrlhf_everywhere(
    max_len: int, data: st.DataObject, factor: float
) -> None:
    buffer_len = data.draw(st.integers(1, max_len))
    length = data.draw(st.integers(0, 2 * max_len))
    ours = overlong_penalty(length, max_len, buffer_len, factor)
    assert ours == pytest.approx(openrlhf_overlong(length, max_len, buffer_len, factor), abs=1e-12)
    if length <= max_len:
        assert ours == pytest.approx(verl_overlong(length, max_len, buffer_len, factor), abs=1e-12)
    assert -factor <= ours <= 0.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 10, 4, 1.0), "response_length=-1"),
        ((5, 0, 1, 1.0), "max_len=0"),
        ((5, 10, 0, 1.0), r"buffer_len=0 must be in \(0, max_len=10\]"),
        ((5, 10, 11, 1.0), r"buffer_len=11 must be in \(0, max_len=10\]"),
        ((5, 10, 4, -0.5), "penalty_factor=-0.5"),
    ],
)
def test_bad_arguments_are_named(args: tuple[int, int, int, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        overlong_penalty(*args)
