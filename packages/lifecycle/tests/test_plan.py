from __future__ import annotations

import itertools
import subprocess
import sys
import warnings

import pytest

from ppo_lifecycle.plan import PHASES, OffloadPlan, ResidentSharedCriticWarning, Transition

A, C, R = "actor", "critic", "rollout"
ALL_PHASES = ("generate", "critic_train", "actor_train", "weight_update", "save")

# (colocate, critic, offload) -> resident roles per phase, in ALL_PHASES order
TABLE = {
    (False, "none", False): [{A, R}] * 5,
    (False, "none", True): [{R}, {R}, {A, R}, {A, R}, {R}],
    (True, "none", False): [{A, R}] * 5,
    (True, "none", True): [{R}, set(), {A}, {A, R}, set()],
    (False, "dedicated", False): [{A, C, R}] * 5,
    (False, "dedicated", True): [{R}, {C, R}, {A, R}, {A, R}, {R}],
    (True, "dedicated", False): [{A, C, R}] * 5,
    (True, "dedicated", True): [{R}, {C}, {A}, {A, R}, set()],
    (False, "shared", True): [{R}, {C, R}, {A, R}, {A, R}, {R}],
    (True, "shared", True): [{R}, {C}, {A}, {A, R}, set()],
}


def test_phases_constant() -> None:
    assert PHASES == ALL_PHASES


@pytest.mark.parametrize(("mode", "expected"), list(TABLE.items()), ids=[str(k) for k in TABLE])
def test_resident_table(mode: tuple[bool, str, bool], expected: list[set[str]]) -> None:
    colocate, critic, offload = mode
    plan = OffloadPlan.build(colocate=colocate, critic=critic, offload=offload)  # type: ignore[arg-type]
    assert [set(plan.resident(p)) for p in ALL_PHASES] == expected


@pytest.mark.parametrize("colocate", [False, True])
def test_shared_critic_without_offload_is_rejected_unless_debugging(colocate: bool) -> None:
    with pytest.raises(ValueError, match="offload must be on"):
        OffloadPlan.build(colocate=colocate, critic="shared", offload=False)
    with pytest.warns(ResidentSharedCriticWarning, match="allow_resident_shared_critic"):
        plan = OffloadPlan.build(
            colocate=colocate, critic="shared", offload=False, allow_resident_shared_critic=True
        )
    assert all(plan.resident(p) == {A, C, R} for p in ALL_PHASES)


def test_debug_flag_is_silent_when_not_needed() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OffloadPlan.build(colocate=True, critic="shared", offload=True, allow_resident_shared_critic=True)


def test_transitions_of_a_colocated_shared_critic_step() -> None:
    plan = OffloadPlan.build(colocate=True, critic="shared", offload=True)
    assert plan.transitions("generate", "critic_train") == [Transition(R, "sleep"), Transition(C, "wake")]
    assert plan.transitions("critic_train", "actor_train") == [Transition(C, "sleep"), Transition(A, "wake")]
    assert plan.transitions("actor_train", "weight_update") == [Transition(R, "wake")]
    assert plan.transitions("weight_update", "generate") == [Transition(A, "sleep")]
    assert plan.transitions("generate", "generate") == []
    assert plan.transitions_from({A, C, R}, "generate") == [Transition(A, "sleep"), Transition(C, "sleep")]


@pytest.mark.parametrize("mode", list(TABLE), ids=[str(k) for k in TABLE])
def test_transitions_lead_from_any_phase_to_any_phase(mode: tuple[bool, str, bool]) -> None:
    colocate, critic, offload = mode
    plan = OffloadPlan.build(colocate=colocate, critic=critic, offload=offload)  # type: ignore[arg-type]
    for before, after in itertools.product(ALL_PHASES, repeat=2):
        moves = plan.transitions(before, after)  # type: ignore[arg-type]
        actions = [m.action for m in moves]
        assert actions == sorted(actions, key=lambda a: a == "wake")  # sleeps before wakes
        resident = set(plan.resident(before))  # type: ignore[arg-type]
        for m in moves:
            assert (m.role in resident) == (m.action == "sleep")
            (resident.discard if m.action == "sleep" else resident.add)(m.role)
        assert resident == plan.resident(after)  # type: ignore[arg-type]
        if not offload:
            assert moves == []


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="critic must be one of"):
        OffloadPlan.build(colocate=False, critic="both", offload=True)  # type: ignore[arg-type]
    plan = OffloadPlan.build(colocate=False, critic="none", offload=True)
    with pytest.raises(ValueError, match="unknown phase 'rollout'"):
        plan.resident("rollout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown roles"):
        plan.transitions_from({C}, "generate")
    assert plan.roles == (A, R)


def test_the_plan_imports_without_torch() -> None:
    # The driver's config builds the plan while validating a config (``ppo-driver validate``).
    modules = "ppo_lifecycle.plan, ppo_lifecycle.stats, ppo_lifecycle.startup"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "False", done.stdout
