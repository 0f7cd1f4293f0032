"""The driver applies ``OffloadPlan`` transitions between phases to the right role, in order.

The roles here only record the calls they receive; the real groups are exercised in tests-e2e."""

from __future__ import annotations

from typing import Any, cast

import pytest

from ppo_driver import build
from ppo_driver.config import load_config
from ppo_driver.phases import PhaseTracker
from ppo_driver.roles import Roles


class Recorder:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def sleep(self) -> None:
        self.log.append(f"{self.name}:sleep")

    def wake_up(self) -> None:
        self.log.append(f"{self.name}:wake")

    def offload(self) -> None:
        self.log.append(f"{self.name}:sleep")

    def onload(self) -> None:
        self.log.append(f"{self.name}:wake")


def _tracker(overrides: list[str]) -> tuple[PhaseTracker, list[str]]:
    config = load_config(None, overrides)
    log: list[str] = []
    critic: Any = Recorder("critic", log) if config.use_critic else None
    roles = Roles(
        rollout=cast(Any, Recorder("rollout", log)), actor=cast(Any, Recorder("actor", log)), critic=critic
    )
    return PhaseTracker(build.offload_plan(config), roles), log


def test_colocated_shared_critic_step() -> None:
    phases, log = _tracker([])
    phases.enter("weight_update")  # right after creation: everything resident
    assert log == ["critic:sleep"]
    phases.enter("generate")
    phases.start_step()
    for phase in ("generate", "critic_train", "actor_train", "weight_update", "generate"):
        phases.enter(phase)
    assert phases.done == [
        "rollout:sleep", "critic:wake",  # engines out, critic in
        "critic:sleep", "actor:wake",  # the handoff: critic out, actor in
        "rollout:wake",  # engines back to receive the weights
        "actor:sleep",  # actor out before generating
    ]  # fmt: skip
    metrics = phases.step_metrics()
    assert metrics["offload/actor_sleeps"] == metrics["offload/actor_wakes"] == 1
    assert metrics["offload/rollout_sleeps"] == 1


def test_save_never_has_both_trainers_resident() -> None:
    phases, _ = _tracker([])
    phases.enter("actor_train")
    phases.start_step()
    phases.enter("save")  # checkpoints come from the host copies of the sleeps
    phases.enter("weight_update")
    assert phases.done == ["actor:sleep", "actor:wake", "rollout:wake"]
    phases.start_step()
    with phases.alone("critic"):  # a role that must be resident to save: the other sleeps first
        assert phases.done == ["actor:sleep", "critic:wake"]
    assert phases.done == ["actor:sleep", "critic:wake", "critic:sleep", "actor:wake"]


def test_same_phase_twice_does_nothing() -> None:
    phases, log = _tracker([])
    phases.enter("generate")
    before = list(log)
    phases.enter("generate")
    assert log == before


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["offload.enabled=false", "offload.allow_resident_shared_critic=true"], []),
        (
            ["placement.mode=disaggregate", "placement.critic=none", "algorithm.estimator=grpo"],
            ["actor:wake", "actor:sleep"],
        ),
    ],
)
@pytest.mark.filterwarnings("ignore:offload.allow_resident_shared_critic")
def test_other_plans(overrides: list[str], expected: list[str]) -> None:
    phases, _ = _tracker(overrides)
    phases.enter("generate")
    phases.start_step()
    for phase in ("generate", "critic_train", "actor_train", "weight_update", "generate"):
        if phase == "critic_train" and not phases.present.issuperset({"critic"}):
            continue
        phases.enter(phase)
    assert phases.done == expected


def test_transitions_are_timed_on_the_step_clock_under_budget_names() -> None:
    from ppo_driver.budget import StepClock

    phases, _ = _tracker([])
    phases.enter("generate")
    clock = StepClock()
    phases.start_step(clock)
    with clock.span("critic_train"):
        phases.enter("critic_train")
    phases.enter("actor_train")
    # The plan's "rollout" is the budget's "engines"; each transition is its own part of the step.
    assert set(clock.seconds()) == {
        "critic_train",
        "engines/sleep",
        "critic/wake",
        "critic/sleep",
        "actor/wake",
    }
    assert clock.totals()["critic_train"] >= clock.seconds()["engines/sleep"] + clock.seconds()["critic/wake"]
