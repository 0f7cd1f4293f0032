"""A step's bookkeeping outside the loop: the order of its phases (the roles an overlapped run wakes
ahead, ``step_record.StepPlan``) and the batch schedule's staleness check and prefetch."""

from __future__ import annotations

import threading

import pytest

from ppo_driver.schedule import BatchSchedule, check_staleness
from ppo_driver.step_record import StepPlan
from ppo_rollout.manager import RolloutBatch


@pytest.mark.parametrize(
    ("critic", "actor", "expected"),
    [
        # PPO: the critic hands its values to the actor, whose weights then go to the engines.
        (
            True,
            True,
            {"generate": "critic_train", "critic_train": "actor_train", "actor_train": "weight_update"},
        ),
        # GRPO: no critic.
        (False, True, {"generate": "actor_train", "actor_train": "weight_update"}),
        # A critic-only warm-up step: the engines come back right after the critic.
        (True, False, {"generate": "critic_train", "critic_train": "generate"}),
    ],
)
def test_each_phase_wakes_the_next_phase_of_its_step(
    critic: bool, actor: bool, expected: dict[str, str]
) -> None:
    plan = StepPlan(critic=critic, actor=actor)
    for phase in ("generate", "critic_train", "actor_train", "weight_update"):
        assert plan.after(phase) == expected.get(phase), phase
    # The next step starts with the critic when there is one (warm-up steps train it too).
    assert plan.next_step_first == ("critic_train" if critic else "actor_train")


class Rollout:
    """Batches whose oldest sample has the weight version the test sets, recorded per step."""

    def __init__(self) -> None:
        self.version = 0.0
        self.steps: list[int] = []
        self.lock = threading.Lock()

    def generate(self, step: int) -> RolloutBatch:
        with self.lock:
            self.steps.append(step)
        return RolloutBatch(boxes=[], metrics={"rollout/weight_version_min": self.version, "step": step})


def test_one_step_off_checks_staleness_and_prefetches() -> None:
    rollout = Rollout()
    schedule = BatchSchedule(rollout, "one_step_off", last_step=3, saves_at=lambda s: s == 2, timeout_s=30)
    try:
        batch = schedule.batch(1)
        # Generated with version 0, the weights published are 0: fresh; the next batch starts now.
        assert schedule.after_batch(1, batch, published=0) == {
            "rollout/staleness": 0,
            "rollout/prefetched_next": 1,
        }
        schedule.drain()
        ahead = schedule.batch(2)
        assert ahead.metrics["step"] == 2
        assert rollout.steps == [1, 2]  # the prefetched one: not generated again
        # One version behind is what one step off means; a save at step 2 stops the prefetch.
        assert schedule.after_batch(2, ahead, published=1) == {
            "rollout/staleness": 1,
            "rollout/prefetched_next": 0,
        }
        with pytest.raises(RuntimeError, match=r"step 3: .* weight version 0, 2 versions behind"):
            schedule.after_batch(3, schedule.batch(3), published=2)
    finally:
        schedule.close()


def test_the_synchronous_schedule_never_prefetches() -> None:
    rollout = Rollout()
    schedule = BatchSchedule(rollout, "off", last_step=5, saves_at=lambda s: False, timeout_s=30)
    batch = schedule.batch(1)
    assert schedule.after_batch(1, batch, published=0) == {
        "rollout/staleness": 0,
        "rollout/prefetched_next": 0,
    }
    assert rollout.steps == [1]


def test_engines_without_numeric_versions_are_not_checked() -> None:
    assert check_staleness(4, {}, published=3) == 0
    assert check_staleness(4, {"rollout/weight_version_min": -1.0}, published=3) == 0


def test_partial_rollouts_allow_max_staleness_versions_and_no_more() -> None:
    batch = {"rollout/weight_version_min": 1.0}
    assert check_staleness(5, batch, published=3, allowed=2) == 2
    with pytest.raises(RuntimeError, match="3 versions behind the published 4; at most 2 allowed"):
        check_staleness(5, batch, published=4, allowed=2)
