"""Phases of a step: the plan's sleeps and wakes, applied, timed and recorded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ppo_driver.budget import StepClock, budget_role
from ppo_driver.roles import Roles
from ppo_lifecycle import OffloadPlan, Phase


class PhaseTracker:
    """Applies ``OffloadPlan.transitions`` between consecutive phases and records them per step."""

    def __init__(
        self, plan: OffloadPlan, roles: Roles, *, on_enter: Callable[[Phase], None] | None = None
    ) -> None:
        self.plan = plan
        # Told the phase before its transitions run, so a failing sleep or wake is reported in it.
        self._on_enter = on_enter
        self.phase: Phase | None = None
        self._do: dict[tuple[str, str], Callable[[], None]] = {
            ("rollout", "sleep"): roles.rollout.offload,
            ("rollout", "wake"): roles.rollout.onload,
            ("actor", "sleep"): roles.actor.sleep,
            ("actor", "wake"): roles.actor.wake_up,
        }
        if roles.critic is not None:
            self._do[("critic", "sleep")] = roles.critic.sleep
            self._do[("critic", "wake")] = roles.critic.wake_up
        self.present = {role for role, _ in self._do}
        self.done: list[str] = []
        self._clock: StepClock | None = None

    def enter(self, phase: Phase) -> None:
        if self._on_enter is not None:
            self._on_enter(phase)
        if self.phase is None:  # right after creation every role is resident
            todo = self.plan.transitions_from(self.present, phase)
        else:
            todo = self.plan.transitions(self.phase, phase)
        for t in todo:
            if self._clock is None:  # start-up and resume: not part of a step's budget
                self._do[(t.role, t.action)]()
            else:
                with self._clock.span(f"{budget_role(t.role)}/{t.action}"):
                    self._do[(t.role, t.action)]()
            self.done.append(f"{t.role}:{t.action}")
        self.phase = phase

    def start_step(self, clock: StepClock | None = None) -> None:
        """A new step: forget the last one's transitions; time the next ones on ``clock``."""
        self.done = []
        self._clock = clock

    def step_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"offload/transitions": list(self.done)}
        for role in sorted(self.present):
            for action in ("sleep", "wake"):
                out[f"offload/{role}_{action}s"] = self.done.count(f"{role}:{action}")
        return out
