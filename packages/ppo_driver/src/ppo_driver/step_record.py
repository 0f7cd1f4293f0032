"""One step's record: each phase entered, timed and followed by the checkpoint's turn; its metrics.

The loop says what a step does (``loop.step``); this module keeps its books, so that the loop does
not: the step's phases in order (:class:`StepPlan`), so each one's roles are woken ahead of it in
an overlapped run; every phase is timed on one :class:`~ppo_driver.budget.StepClock` with the sleeps
and wakes the phase tracker ran inside it carved out (``budget.py``); between phases and at the end
of the step the background checkpoint gets its turn (``saving.py``: its writers start once their
roles sleep, it completes once they are done), booked as the step's ``save`` part; at the end the
roles' metrics, the transitions and the budget are gathered into the one dict ``metrics.jsonl`` gets.

:class:`Where` is where the loop is (step and phase), for a failure's report.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ppo_driver import budget
from ppo_driver.faults import check_finite
from ppo_driver.phases import PhaseTracker
from ppo_lifecycle.plan import Phase


@dataclass
class Where:
    """Where the loop is, for the report of a failure."""

    step: int = 0
    phase: str = "setup"

    def entering(self, phase: str) -> None:
        self.phase = phase

    @contextmanager
    def within(self, phase: str) -> Iterator[None]:
        """Work of ``phase`` done inside another (a save's writers start when the roles sleep)."""
        outer, self.phase = self.phase, phase
        yield
        self.phase = outer  # not restored on an error: the report names the inner phase


@dataclass(frozen=True)
class StepPlan:
    """The phases one step enters, in order, and so the phase after each: the ``then`` whose roles an
    overlapped run wakes ahead (``phases.py``). ``critic``: a critic trains (GRPO has none);
    ``actor``: the actor trains and the engines get its weights (not in a critic-only warm-up step)."""

    critic: bool
    actor: bool

    @property
    def order(self) -> tuple[Phase, ...]:
        if self.actor:
            critic: tuple[Phase, ...] = ("critic_train",) if self.critic else ()
            return ("generate", *critic, "actor_train", "weight_update")
        # A warm-up step: right after the critic, the engines come back for the next generate.
        return ("generate", "critic_train", "generate") if self.critic else ("generate",)

    def after(self, phase: Phase) -> Phase | None:
        """The phase entered after ``phase`` in this step (None: the last, or one the step skips)."""
        order = self.order
        if phase not in order:
            return None
        i = order.index(phase)
        return order[i + 1] if i + 1 < len(order) else None

    @property
    def next_step_first(self) -> Phase:
        """The phase after ``generate`` in a step that follows (warm-up steps train the critic too)."""
        return "critic_train" if self.critic else "actor_train"


class BesidePhases(Protocol):
    """Work that goes on beside the phases, in turns between them (``saving.CheckpointSaver``)."""

    def between_phases(self) -> None: ...
    def phase_entered(self) -> None: ...
    def end_step(self, *, last: bool) -> None: ...
    def pop_metrics(self) -> dict[str, float]: ...


class StepRecord:
    """Times one step's phases and parts and gathers its metrics; :meth:`finish` returns them."""

    def __init__(
        self,
        step: int,
        phases: PhaseTracker,
        beside: BesidePhases,
        where: Where,
        budget_roles: Sequence[str],
        plan: StepPlan,
    ) -> None:
        self.step = step
        self.plan = plan
        self.metrics: dict[str, Any] = {}
        self._clock = budget.StepClock()  # every second of the step, in disjoint parts (budget.py)
        self._phases = phases
        self._beside = beside
        self._where = where
        self._budget_roles = tuple(budget_roles)
        self._handoff_bytes = 0.0
        where.step = step
        phases.start_step(self._clock, step)

    # -- timing -------------------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: Phase) -> Iterator[None]:
        """``name``'s roles resident as the offload plan says (and the next phase's, in the step's
        plan, woken ahead in an overlapped run), its work timed as ``name``. After it the checkpoint
        gets its turn: a role moved by the phase has usually settled by then, so a checkpoint whose
        writers are done completes within a step."""
        with self._clock.span(name):
            self._phases.enter(name, then=self.plan.after(name))
            yield
        with self.saving():
            self._beside.between_phases()

    def next_step(self, *, wake_ahead: bool) -> None:
        """The end of a step: the engines back for the next generate, and with ``wake_ahead`` the next
        step's first role woken ahead (not while a checkpoint waits for this step's sleeps, nor when
        no step follows); the roles asleep now start their checkpoint's writers."""
        self._phases.enter("generate", then=self.plan.next_step_first if wake_ahead else None)
        with self.saving():
            self._beside.phase_entered()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Work timed as the budget's part ``name`` (``generate_wait``, ``eval``, ``handoff``, ...)."""
        with self._clock.span(name):
            yield

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Checkpoint work: the ``save`` part, and a failure in it is reported in phase ``save``."""
        with self._clock.span("save"), self._where.within("save"):
            yield

    def carve(self, part: str, seconds: float) -> None:
        """Seconds a worker measured inside the open span, booked as ``part`` instead."""
        self._clock.carve(part, seconds)

    # -- metrics ------------------------------------------------------------------------------------
    def add(self, role: str, metrics: Mapping[str, Any]) -> None:
        """``metrics`` under ``role/`` (a key that has the prefix already keeps it)."""
        self.metrics.update(prefixed(role, metrics))

    def trained(self, role: str, metrics: Mapping[str, Any]) -> None:
        """A role's training metrics; a non-finite loss or gradient norm stops the step here, before
        the step's weights are saved or sent."""
        check_finite(role, self.step, metrics)
        self.add(role, metrics)

    def handed_over(self, nbytes: float) -> None:
        """Bytes of the critic's values handed to the actor (the budget's ``bytes/handoff``)."""
        self._handoff_bytes += nbytes

    def finish(self, *, last: bool) -> dict[str, Any]:
        """The step's metrics. ``last``: the run ends or stops after this step, so everything still
        moving is waited for (no later phase hides it) and the pending checkpoint completes."""
        self.metrics["actor_trained"] = int(self.plan.actor)
        if last:
            self._phases.settle()
        popped = self._phases.pop_role_metrics()
        for role, role_metrics in popped.items():
            self.add(role, role_metrics)
        self.metrics.update(self._phases.step_metrics())
        with self.saving():
            self._beside.end_step(last=last)
        m = self.metrics
        # The older inclusive keys: each phase's wall time with the transitions it triggered.
        m.update({f"time/{k}": v for k, v in self._clock.totals().items() if k in budget.PHASES})
        moved = budget.StepBytes(
            transitions=transition_bytes(popped),
            handoff=self._handoff_bytes,
            weight_update=float(m.get("weight_sync/bytes", 0.0)),
        )
        hidden = self._phases.hidden_seconds()
        m.update(budget.step_metrics(self._clock, self._budget_roles, moved, hidden=hidden))
        m["time/step"] = m["time/step_s"]
        m.update(self._beside.pop_metrics())
        return m


def prefixed(role: str, metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k if k.startswith(f"{role}/") else f"{role}/{k}": v for k, v in metrics.items()}


def transition_bytes(popped: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Bytes per budget transition (``"actor/sleep"``) from the roles' popped metrics. Trainers
    report rank 0's bytes (one GPU's share); the engines' are summed over the engines."""
    out: dict[str, float] = {}
    for role in ("actor", "critic"):
        if role in popped:
            out[f"{role}/sleep"] = float(popped[role].get("sleep/bytes", 0.0))
            out[f"{role}/wake"] = float(popped[role].get("wake/bytes", 0.0))
    engines = popped.get("rollout", {})
    out["engines/sleep"] = float(engines.get("offload/bytes", 0.0))
    out["engines/wake"] = float(engines.get("onload/bytes", 0.0))
    return out
