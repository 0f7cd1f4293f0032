"""The learning-rate schedule: warm-up, constant and cosine rates per training step, set by both roles."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppo_trainer.config import TrainerConfig
from ppo_trainer.lr_schedule import lr_factor, scheduled_factor


def test_cosine_runs_from_the_rate_to_its_floor() -> None:
    kw = {"schedule": "cosine", "total_steps": 11, "min_lr_ratio": 0.1}
    assert lr_factor(1, **kw) == 1.0
    assert lr_factor(6, **kw) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_factor(11, **kw) == pytest.approx(0.1)
    assert lr_factor(50, **kw) == pytest.approx(0.1)  # past the run's end (a longer resumed run)


def test_warmup_rises_linearly_then_the_schedule_starts() -> None:
    kw = {"schedule": "cosine", "warmup_steps": 4, "total_steps": 14, "min_lr_ratio": 0.0}
    assert [lr_factor(s, **kw) for s in range(1, 6)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(14, **kw) == pytest.approx(0.0)
    assert lr_factor(3, schedule="constant", warmup_steps=4) == 0.75
    assert lr_factor(9, schedule="constant", warmup_steps=4, total_steps=10) == 1.0


def test_without_the_runs_length_cosine_holds_the_rate() -> None:
    assert lr_factor(1000, schedule="cosine", total_steps=None, min_lr_ratio=0.1) == 1.0


@given(
    total=st.integers(min_value=1, max_value=500),
    warmup=st.integers(min_value=0, max_value=50),
    floor=st.floats(min_value=0.0, max_value=1.0),
)
def test_cosine_never_rises_after_warmup_and_stays_in_bounds(total: int, warmup: int, floor: float) -> None:
    rates = [
        lr_factor(s, schedule="cosine", warmup_steps=warmup, total_steps=total, min_lr_ratio=floor)
        for s in range(1, max(total, warmup) + 3)
    ]
    assert all(0.0 < r <= 1.0 for r in rates[: max(warmup, 1)])
    after = rates[warmup:]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(after))
    assert all(floor - 1e-12 <= r <= 1.0 for r in after)
    assert math.isclose(after[0], 1.0)


@pytest.mark.parametrize(("step", "ratio"), [(0, 0.1), (-3, 0.1), (1, 1.5), (1, -0.1)])
def test_bad_arguments_name_the_argument(step: int, ratio: float) -> None:
    with pytest.raises(ValueError, match=r"step|min_lr_ratio"):
        lr_factor(step, schedule="cosine", total_steps=10, min_lr_ratio=ratio)


def test_a_roles_settings_give_its_rate() -> None:
    config = TrainerConfig(role="actor", model_path="m", total_steps=5, min_lr_ratio=0.2, lr_warmup_steps=1)
    assert [scheduled_factor(config, s) for s in (1, 2, 5)] == [1.0, 1.0, pytest.approx(0.2)]
    flat = TrainerConfig(role="critic", model_path="m", total_steps=5, lr_schedule="constant")
    assert scheduled_factor(flat, 5) == 1.0
    with pytest.raises(ValueError, match="min_lr_ratio"):
        TrainerConfig(role="actor", model_path="m", min_lr_ratio=2.0)
