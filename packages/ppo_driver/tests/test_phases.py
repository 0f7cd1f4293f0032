"""The driver applies ``OffloadPlan`` transitions between phases to the right role, in order.

The roles here only record the calls they receive; the real groups are exercised in tests-e2e."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ppo_driver import build
from ppo_driver.budget import StepClock
from ppo_driver.config import load_config
from ppo_driver.phases import PhaseTracker, TransitionFailed
from ppo_driver.roles import Roles


class Recorder:
    """A role that records its calls (and, for the overlap tests, when each transition ran)."""

    def __init__(self, name: str, log: list[str], seconds: float = 0.0, fail: str = "") -> None:
        self.name, self.log, self.seconds, self.fail = name, log, seconds, fail
        self.spans: dict[str, tuple[float, float]] = {}
        self.busy = threading.Lock()  # a Ray worker takes one call at a time: two at once is a bug
        self.moved = 0.0

    def _move(self, action: str) -> None:
        if not self.busy.acquire(blocking=False):
            raise RuntimeError(f"{self.name}: {action} called while another call runs")
        try:
            t0 = time.perf_counter()
            time.sleep(self.seconds)
            if self.fail == action:
                raise RuntimeError(f"{self.name} {action}: out of host memory")
            self.log.append(f"{self.name}:{action}")
            self.spans[action] = (t0, time.perf_counter())
            self.moved += 1.0
        finally:
            self.busy.release()

    def sleep(self) -> None:
        self._move("sleep")

    def wake_up(self) -> None:
        self._move("wake")

    def offload(self) -> None:
        self._move("sleep")

    def onload(self) -> None:
        self._move("wake")

    def disconnect_engines(self) -> None:
        self.log.append(f"{self.name}:disconnect")

    def pop_metrics(self) -> dict[str, float]:
        if not self.busy.acquire(blocking=False):
            raise RuntimeError(f"{self.name}: pop_metrics called while a transition runs")
        try:
            out, self.moved = {"sleep/bytes": self.moved}, 0.0
            return out
        finally:
            self.busy.release()


def _tracker(
    overrides: list[str], *, overlap: bool = False, seconds: float = 0.0, fail: tuple[str, str] = ("", "")
) -> tuple[PhaseTracker, list[str]]:
    config = load_config(None, overrides)
    log: list[str] = []

    def role(name: str) -> Any:
        return Recorder(name, log, seconds, fail[1] if fail[0] == name else "")

    roles = Roles(
        rollout=role("rollout"), actor=role("actor"), critic=role("critic") if config.use_critic else None
    )
    return PhaseTracker(build.offload_plan(config), roles, overlap=overlap, timeout_s=30), log


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


STEP: list[tuple[Any, Any]] = [
    ("generate", "critic_train"),
    ("critic_train", "actor_train"),
    ("actor_train", "weight_update"),
    ("weight_update", None),
    ("generate", "critic_train"),
]


def _roles_of(phases: PhaseTracker) -> dict[str, Recorder]:
    roles = phases._roles  # the recorders the test made
    return {"rollout": roles.rollout, "actor": roles.actor, "critic": roles.critic}  # type: ignore[dict-item]


def test_overlapped_step_makes_the_same_transitions_and_runs_a_swap_both_ways_at_once() -> None:
    phases, log = _tracker([], overlap=True, seconds=0.1)
    phases.enter("weight_update")
    phases.enter("generate")
    phases.settle()
    log.clear()
    phases.start_step(StepClock(), step=1)
    for phase, then in STEP:
        phases.enter(phase, then=then)
    # The sequential order's transitions, each started one phase earlier where it is a wake.
    assert phases.done == [
        "critic:wake",  # generate: the critic comes ahead of critic_train
        "rollout:sleep", "actor:wake",  # critic_train (the actor comes ahead of actor_train)
        "critic:sleep", "rollout:wake",  # actor_train (the actor was woken during critic_train)
        "actor:sleep", "critic:wake",  # generate: the actor leaves, the next critic comes ahead
    ]  # fmt: skip
    # The critic woken ahead at the end of the step stays through the next step's generate.
    phases.start_step(StepClock(), step=2)
    phases.enter("generate", then="critic_train")
    assert phases.done == []
    # The actor left the engines in the foreground; its sleep still runs in the background.
    assert log[-1] == "actor:disconnect" or "actor:sleep" not in log
    phases.settle()
    assert log.index("actor:disconnect") < log.index("actor:sleep")
    roles = _roles_of(phases)
    # The swap: the critic's sleep (started on entering actor_train) and the actor's wake (started
    # ahead, on entering critic_train; the phases here do no work) moved at the same time.
    c0, c1 = roles["critic"].spans["sleep"]
    a0, a1 = roles["actor"].spans["wake"]
    assert c0 < a1, "the critic's sleep began before the actor's wake ended"
    assert a0 < c1, "the actor's wake began before the critic's sleep ended"


def test_overlapped_waits_are_short_and_the_rest_is_hidden() -> None:
    phases, _ = _tracker([], overlap=True, seconds=0.2)
    phases.enter("weight_update")
    phases.enter("generate")
    phases.settle()
    phases.pop_role_metrics()  # start-up's
    clock = StepClock()
    phases.start_step(clock, step=1)
    with clock.span("generate"):
        phases.enter("generate", then="critic_train")
        time.sleep(0.3)  # the engines generate: the critic wakes meanwhile
    with clock.span("critic_train"):
        phases.enter("critic_train", then="actor_train")
    own = clock.seconds()
    assert own["critic/wake"] < 0.05  # woken ahead: hardly waited for
    assert own.get("engines/sleep", 0.0) == 0.0  # offloaded in the background, not waited for yet
    hidden = phases.hidden_seconds()
    assert hidden["critic/wake"] == pytest.approx(0.2, abs=0.05)
    phases.settle()
    # Waited for at once (no phase ran meanwhile): its seconds are the wait, none hidden.
    waited, hidden_s = clock.seconds()["actor/wake"], phases.hidden_seconds().get("actor/wake", 0.0)
    assert waited + hidden_s == pytest.approx(0.2, abs=0.05)
    assert waited > 0.15
    # Metrics: popped by each background transition in its own thread, collected here.
    popped = phases.pop_role_metrics()
    assert popped["critic"]["sleep/bytes"] == 1.0  # the critic's one wake of this step
    assert popped["rollout"]["sleep/bytes"] == 1.0


def test_a_role_still_moving_is_not_called_for_its_metrics() -> None:
    phases, _ = _tracker([], overlap=True, seconds=0.3)
    phases.enter("weight_update")
    phases.enter("generate")  # the actor's sleep runs in the background
    assert phases.busy("actor")
    popped = phases.pop_role_metrics()  # would raise in the recorder if it called the actor now
    assert "actor" in popped
    phases.settle()
    assert not phases.busy("actor")
    assert phases.pop_role_metrics()["actor"]["sleep/bytes"] == 1.0


def test_a_failing_background_sleep_is_reported_in_the_phase_that_started_it() -> None:
    phases, _ = _tracker([], overlap=True, fail=("actor", "sleep"))
    phases.enter("weight_update")
    phases.start_step(StepClock(), step=4)
    phases.enter("generate", then="critic_train")  # launched here; the loop goes on
    with pytest.raises(
        TransitionFailed, match=r"actor's sleep.*generate \(step 4\).*out of host memory"
    ) as err:
        phases.settle("actor")  # the loop goes on in critic_train meanwhile; the wait reports it
    assert (err.value.phase, err.value.step, err.value.role) == ("generate", 4, "actor")


def test_overlapped_alone_settles_first() -> None:
    phases, log = _tracker([], overlap=True, seconds=0.05)
    phases.enter("actor_train")
    phases.enter("generate")  # actor sleeps in the background
    with phases.alone("critic"):
        assert not phases.busy("actor")
        assert log[-1] == "critic:wake"
    assert log[-1] == "critic:sleep"


def test_metrics_of_two_pops_add_up_and_rates_are_recomputed() -> None:
    from ppo_driver.phases import merge_metrics

    first = {"sleep/bytes": 10e9, "sleep/memory_seconds": 0.2, "sleep/gb_per_s": 50.0, "sleep/count": 1.0}
    second = {"sleep/bytes": 10e9, "sleep/memory_seconds": 0.3, "sleep/gb_per_s": 33.3, "sleep/count": 1.0}
    merged = merge_metrics(first, second)
    assert merged["sleep/bytes"] == 20e9
    assert merged["sleep/count"] == 2.0
    assert merged["sleep/gb_per_s"] == pytest.approx(40.0)  # 20 GB over 0.5 s, not 50 + 33.3
    assert merge_metrics({}, {"offload/bytes": 3.0}) == {"offload/bytes": 3.0}
