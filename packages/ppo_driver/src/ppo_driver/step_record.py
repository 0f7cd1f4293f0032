"""One step's record: each phase entered, timed and followed by the checkpoint's turn; its metrics.

The loop says what a step does (``loop.step``); this module keeps its books, so that the loop does
not: every phase is timed on one :class:`~ppo_driver.budget.StepClock` with the sleeps and wakes the
phase tracker ran inside it carved out (``budget.py``); between phases and at the end of the step
the background checkpoint gets its turn (``saving.py``: its writers start once their roles sleep, it
completes once they are done), booked as the step's ``save`` part; at the end the roles' metrics,
the transitions and the budget are gathered into the one dict ``metrics.jsonl`` gets.

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
    ) -> None:
        self.step = step
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
    def phase(self, name: Phase, then: Phase | None = None) -> Iterator[None]:
        """``name``'s roles resident as the plan says (``then``: the phase after it, whose roles an
        overlapped run wakes ahead), its work timed as ``name``. After it the checkpoint gets its turn:
        a role moved by the phase has usually settled by then, so a checkpoint whose writers are done
        completes within a step."""
        with self._clock.span(name):
            self._phases.enter(name, then=then)
            yield
        with self.saving():
            self._beside.between_phases()

    def enter(self, name: Phase, then: Phase | None = None) -> None:
        """Move the roles for ``name`` without work of it yet (the end of a step: the engines back for
        the next generate); the roles asleep now start their checkpoint's writers."""
        self._phases.enter(name, then=then)
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
