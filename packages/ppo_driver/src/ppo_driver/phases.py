"""Phases of a step: the plan's sleeps and wakes, applied, timed and recorded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
            self._run(t.role, t.action)
        self.phase = phase

    @contextmanager
    def alone(self, role: str) -> Iterator[None]:
        """``role`` resident and the other trainer role asleep, inside the current phase (a save or a
        load outside the plan's phases); the phase's residency is back after. Without offload every
        role stays resident, as the plan says."""
        if not self.plan.offload:
            yield
            return
        resident = self.plan.resident(self.phase) if self.phase is not None else frozenset(self.present)
        others = [r for r in ("actor", "critic") if r != role and r in resident and r in self.present]
        for other in others:
            self._run(other, "sleep")
        woke = role not in resident
        if woke:
            self._run(role, "wake")
        try:
            yield
        finally:
            if woke:
                self._run(role, "sleep")
            for other in others:
                self._run(other, "wake")

    def _run(self, role: str, action: str) -> None:
        if self._clock is None:  # start-up and resume: not part of a step's budget
            self._do[(role, action)]()
        else:
            with self._clock.span(f"{budget_role(role)}/{action}"):
                self._do[(role, action)]()
        self.done.append(f"{role}:{action}")

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
