"""Phases of a step: the plan's sleeps and wakes, applied, timed and recorded.

Sequential (``overlap=False``): each transition runs to its end when its phase is entered, sleeps
first, then wakes, as ``OffloadPlan.transitions`` lists them.

Overlapped (``overlap=True``, ``offload.overlap`` and ``overlap.py`` decide): every transition runs
in a thread of its own role (one thread per role, so a role's transitions run one at a time and in
order, as its Ray workers would take them anyway):

* a role the entered phase does not need sleeps in the background while the phase computes; the
  actor first disconnects from the engines in the foreground (the engines are about to generate,
  and nothing of the weight link may outlive the memory);
* the roles the entered phase needs are waited for (their wakes, started now or earlier), so a swap
  (critic out, actor in) moves both ways at once;
* the roles the next phase (``then``) needs are woken ahead of it (prefetch) and waited for only
  when that phase is entered.

Before any other call to a role (a save, a checksum, its metrics) the loop waits for that role's
transitions (:meth:`settle`): its workers take one call at a time. Every wait has a timeout and names
what it waited for. A background transition that fails raises :class:`TransitionFailed`, naming the
phase and step that started it, when it is waited for or collected.

The budget (``budget.py``): the seconds the loop waited for a transition (plus the actor's foreground
disconnect) are the transition's part of the step; its own seconds that ran hidden under other work
are recorded apart (:meth:`hidden_seconds`). A background transition's bytes and hidden seconds are
booked in the step that collects it (the actor's sleep started at the end of a step is usually
collected in the next one).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from ppo_driver.budget import StepClock, budget_role
from ppo_driver.roles import Roles
from ppo_lifecycle.plan import OffloadPlan, Phase

log = logging.getLogger(__name__)

ROLE_ORDER = ("rollout", "actor", "critic")

# (seconds the transition itself took, the role's metrics popped right after it)
_Outcome = tuple[float, dict[str, float]]


class TransitionFailed(RuntimeError):
    """A background sleep or wake failed; ``phase`` and ``step`` are where it was started."""

    def __init__(self, role: str, action: str, phase: str, step: int, cause: BaseException) -> None:
        super().__init__(
            f"the {role}'s {action}, started in the background on entering {phase} (step {step}), "
            f"failed: {type(cause).__name__}: {cause}"
        )
        self.role = role
        self.action = action
        self.phase = phase
        self.step = step


@dataclass
class _Job:
    role: str
    action: str
    phase: Phase
    step: int
    future: concurrent.futures.Future[_Outcome]
    waited: float = field(default=0.0)

    @property
    def part(self) -> str:
        return f"{budget_role(self.role)}/{self.action}"


class PhaseTracker:
    """Applies ``OffloadPlan.transitions`` between consecutive phases and records them per step."""

    def __init__(
        self,
        plan: OffloadPlan,
        roles: Roles,
        *,
        on_enter: Callable[[Phase], None] | None = None,
        overlap: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.plan = plan
        self.overlap = overlap
        self.timeout_s = timeout_s
        # Told the phase before its transitions run, so a failing sleep or wake is reported in it.
        self._on_enter = on_enter
        self.phase: Phase | None = None
        self._do: dict[tuple[str, str], Callable[[], None]] = {
            ("rollout", "sleep"): roles.rollout.offload,
            ("rollout", "wake"): roles.rollout.onload,
            ("actor", "sleep"): roles.actor.sleep,
            ("actor", "wake"): roles.actor.wake_up,
        }
        self._roles = roles  # their metrics and the actor's disconnect are looked up when used
        if roles.critic is not None:
            self._do[("critic", "sleep")] = roles.critic.sleep
            self._do[("critic", "wake")] = roles.critic.wake_up
        self.present = {role for role, _ in self._do}
        self.done: list[str] = []
        self._clock: StepClock | None = None
        self._step = 0
        self._resident: set[str] = set(self.present)  # right after creation every role is resident
        self._jobs: dict[str, deque[_Job]] = {role: deque() for role in self.present}
        self._pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._stash: dict[str, dict[str, float]] = {}  # metrics popped by background transitions
        self._hidden: dict[str, float] = {}

    # -- phases ---------------------------------------------------------------------------------
    def enter(self, phase: Phase, then: Phase | None = None) -> None:
        """Make ``phase``'s roles resident (and the others asleep). Overlapped, ``then`` (the phase
        the loop enters next, when it knows it) has its roles woken ahead in the background."""
        if self._on_enter is not None:
            self._on_enter(phase)
        todo = self.plan.transitions_from(self._resident, phase)
        if not self.overlap:
            for t in todo:
                self._run(t.role, t.action)
            self.phase = phase
            return
        # A role the next phase needs stays (woken ahead for this phase's successor, it would
        # otherwise sleep here and wake again at once).
        keep = self.plan.resident(then) if then is not None else frozenset()
        for t in todo:
            if not (t.action == "sleep" and t.role in keep):
                self._launch(t.role, t.action, phase)
        for role in sorted(self.plan.resident(phase)):
            self.settle(role)
        if then is not None:
            for t in self.plan.transitions_from(self._resident, then):
                if t.action == "wake":
                    self._launch(t.role, "wake", phase)
        self.phase = phase

    @contextmanager
    def alone(self, role: str) -> Iterator[None]:
        """``role`` resident and the other trainer role asleep, inside the current phase (a save or a
        load outside the plan's phases); the residency is back after. Without offload every role
        stays resident, as the plan says."""
        if not self.plan.offload:
            yield
            return
        self.settle()
        resident = set(self._resident)
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

    # -- waiting ----------------------------------------------------------------------------------
    def settle(self, role: str | None = None) -> None:
        """Wait for ``role``'s (every role's when None) background transitions, in the order they
        were started; each wait is that transition's part of the step."""
        for name in [role] if role is not None else sorted(self._jobs):
            jobs = self._jobs.get(name)
            while jobs:
                self._collect(jobs[0], block=True)

    def busy(self, role: str) -> bool:
        """Whether ``role`` has a transition still running (a call to it now would wait for it)."""
        return any(not job.future.done() for job in self._jobs.get(role, ()))

    def reap(self) -> None:
        """Collect the background transitions that have finished; never waits."""
        for jobs in self._jobs.values():
            while jobs and jobs[0].future.done():
                self._collect(jobs[0], block=False)

    def close(self) -> None:
        """End of the run (or its failure): wait for what is still running, at most ``timeout_s``
        each; errors here are logged (the run's own outcome is already decided)."""
        for role, jobs in self._jobs.items():
            for job in list(jobs):
                try:
                    job.future.result(timeout=self.timeout_s)
                except Exception as exc:  # already reported, or secondary to the run's failure
                    log.warning("%s %s in the background: %s", role, job.action, exc)
            jobs.clear()
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools = {}

    # -- per step ---------------------------------------------------------------------------------
    def start_step(self, clock: StepClock | None = None, step: int = 0) -> None:
        """A new step: forget the last one's transitions; time the next ones on ``clock``."""
        self.done = []
        self._clock = clock
        self._step = step
        self._hidden = {}

    def hidden_seconds(self) -> dict[str, float]:
        """Per budget transition (``"actor/sleep"``), its seconds collected this step that ran while
        the loop did other work (0 in the sequential order)."""
        return dict(self._hidden)

    def pop_role_metrics(self) -> dict[str, dict[str, float]]:
        """What each role measured since the last call (its sleeps' and wakes' bytes and seconds). A
        role with a transition still running is not called: its metrics come with a later call."""
        self.reap()
        out: dict[str, dict[str, float]] = {}
        for role in ROLE_ORDER:
            if role not in self.present:
                continue
            popped = self._stash.pop(role, {})
            if not self._jobs[role]:
                popped = merge_metrics(popped, self._pop_now(role))
            out[role] = popped
        return out

    def step_metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"offload/transitions": list(self.done), "offload/overlap": int(self.overlap)}
        for role in sorted(self.present):
            for action in ("sleep", "wake"):
                out[f"offload/{role}_{action}s"] = self.done.count(f"{role}:{action}")
        return out

    # -- internals --------------------------------------------------------------------------------
    def _timed(self, part: str) -> Any:
        return self._clock.span(part) if self._clock is not None else nullcontext()

    def _run(self, role: str, action: str) -> None:
        """A transition in the foreground (the sequential order, and ``alone``)."""
        with self._timed(f"{budget_role(role)}/{action}"):
            self._do[(role, action)]()
        self._mark(role, action)

    def _pop_now(self, role: str) -> dict[str, float]:
        roles = self._roles
        group = roles.rollout if role == "rollout" else roles.actor if role == "actor" else roles.critic
        assert group is not None  # only roles in self.present are asked
        return dict(group.pop_metrics())

    def _mark(self, role: str, action: str) -> None:
        if action == "sleep":
            self._resident.discard(role)
        else:
            self._resident.add(role)
        self.done.append(f"{role}:{action}")

    def _launch(self, role: str, action: str, phase: Phase) -> None:
        """Start a transition in ``role``'s thread (after the ones it already has)."""
        if role == "actor" and action == "sleep":
            # The engines generate next: the actor leaves them here, in the foreground, and only its
            # memory moves in the background (the sleep's own pre-sleep disconnect is then a no-op).
            self.settle(role)
            with self._timed("actor/sleep"):
                self._roles.actor.disconnect_engines()
        pool = self._pools.get(role)
        if pool is None:
            pool = self._pools[role] = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"{role}-transitions"
            )
        jobs = self._jobs[role]
        before = jobs[-1].future if jobs else None
        future = pool.submit(self._transition, role, action, before)
        jobs.append(_Job(role, action, phase, self._step, future))
        self._mark(role, action)

    def _transition(
        self, role: str, action: str, before: concurrent.futures.Future[_Outcome] | None
    ) -> _Outcome:
        """Runs in the role's thread, after ``before`` (the role's previous transition) ended."""
        if before is not None and before.exception() is not None:
            raise RuntimeError(f"not started: the {role}'s previous transition failed")
        t0 = time.perf_counter()
        self._do[(role, action)]()
        seconds = time.perf_counter() - t0
        # Popped here, in the role's own thread: the loop must not call a role while it moves.
        return seconds, self._pop_now(role)

    def _collect(self, job: _Job, *, block: bool) -> None:
        t0 = time.perf_counter()
        try:
            with self._timed(job.part) if block else nullcontext():
                seconds, metrics = job.future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"waited {self.timeout_s:.0f} s (ray.timeout_s) for the {job.role}'s {job.action}, "
                f"started in the background on entering {job.phase} (step {job.step})"
            ) from None
        except Exception as exc:
            self._jobs[job.role].popleft()
            raise TransitionFailed(job.role, job.action, job.phase, job.step, exc) from exc
        finally:
            job.waited += time.perf_counter() - t0 if block else 0.0
        self._jobs[job.role].popleft()
        self._hidden[job.part] = self._hidden.get(job.part, 0.0) + max(seconds - job.waited, 0.0)
        self._stash[job.role] = merge_metrics(self._stash.get(job.role, {}), metrics)


def merge_metrics(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two pops of one role's metrics as one: counts, bytes and seconds add up; rates are recomputed
    from the sums (a lifecycle's ``sleep/gb_per_s`` from ``sleep/bytes`` over ``sleep/memory_seconds``)."""
    out = dict(a)
    for key, value in b.items():
        out[key] = value if key.endswith("gb_per_s") else out.get(key, 0.0) + value
    for kind in ("sleep", "wake"):
        nbytes, seconds = out.get(f"{kind}/bytes", 0.0), out.get(f"{kind}/memory_seconds", 0.0)
        if f"{kind}/gb_per_s" in out and nbytes > 0 and seconds > 0:
            out[f"{kind}/gb_per_s"] = nbytes / seconds / 1e9
    return out
