"""Checkpoints written while the loop goes on, from the host copies the roles' sleeps made.

At a save point (after the step's training) the saver writes the driver's state into a ``.tmp-``
folder and decides per trainer role:

* **background**: a role whose workers keep host copies (``saves_asleep``: replicated or FSDP2, torch
  backend) and which the plan puts to sleep for ``generate``: once the loop has entered that phase
  (the role asleep, its copies current), the role's workers write its folder from them in a thread
  (``TrainGroup.save_async``; FSDP2 ranks gather their shards to rank 0 over a group of their own).
  No wake.
* **foreground** (the megatron backend, memory backends without host copies, runs without offload):
  saved at once, one role resident at a time (``PhaseTracker.alone``).

The checkpoint is marked COMPLETE only when every role's writers have written and fsynced every
file (``poll`` at the end of each step, ``wait`` before the next save, at the end of the run and on
a stop). A run that fails leaves the ``.tmp-`` folder, which resume ignores and removes.

The saver keeps its own schedule: the loop calls :meth:`CheckpointSaver.maybe_save` at each save
point and the step's record (``step_record.py``) gives it its turns between phases
(:meth:`~CheckpointSaver.between_phases`, :meth:`~CheckpointSaver.phase_entered`,
:meth:`~CheckpointSaver.end_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ppo_driver import checkpoint
from ppo_driver.phases import PhaseTracker
from ppo_driver.roles import BackgroundSaving, Roles, TrainGroupLike
from ppo_driver.schedule import NEVER, Cadence

TRAINER_ROLES = ("actor", "critic")


class CheckpointSaver:
    """Starts, tracks and completes the loop's checkpoints; at most one is pending at a time."""

    def __init__(
        self,
        root: Path,
        roles: Roles,
        phases: PhaseTracker,
        driver_state: Callable[[int], checkpoint.DriverState],
        *,
        keep: int | None,
        cadence: Cadence = NEVER,
    ) -> None:
        self.root = root
        self.cadence = cadence  # the steps after which ``maybe_save`` saves
        self.phases = phases
        self._driver_state = driver_state
        self._keep = keep
        self._groups: dict[str, TrainGroupLike] = {"actor": roles.actor}
        if roles.critic is not None:
            self._groups["critic"] = roles.critic
        self._pending: checkpoint.PendingCheckpoint | None = None
        self._waiting: list[str] = []  # background roles whose save starts once they sleep
        self._writing: list[str] = []  # background roles whose workers are writing
        self._written: set[str] = set()  # of those, the roles whose writers are known to be done
        self._blocking = 0.0
        self._background = 0.0
        self._starts: dict[str, float] = {}  # per role: the save's start, and what it captured
        self.completed: list[Path] = []
        self._last_started = -1  # the step of the latest checkpoint started

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def maybe_save(self, step: int, *, last: bool = False) -> bool:
        """At the save point of ``step``: start its checkpoint when the cadence says so, or when the
        run stops after ``step`` before its last step (``last``; a re-run then loses nothing).
        Returns whether one started; a step is saved once."""
        stops_early = last and step < self.cadence.last_step
        if step == self._last_started or not (self.cadence.due(step) or stops_early):
            return False
        self.start(step)
        return True

    # -- the step's turns (step_record.py) ------------------------------------------------------
    def between_phases(self) -> None:
        """Complete the pending checkpoint if its writers are done; never waits. An overlapped run
        woke a role ahead at the end of the last step, which the poll there skipped (it asks no role
        that moves): after a phase, the roles it moved have usually settled."""
        if self._pending is not None:
            self.poll()

    def phase_entered(self) -> None:
        """The roles moved as the new phase needs: the ones asleep now start their writers."""
        self.launch_ready()

    def end_step(self, *, last: bool) -> None:
        """Complete the pending checkpoint if its writers are done; ``last`` (the run ends or stops
        after this step): wait for them, the run's last checkpoint must be complete."""
        if last:
            self.wait()
        else:
            self.poll()

    def start(self, step: int) -> None:
        """Save the state after ``step``'s training: the driver's and foreground roles' now, the
        background roles' once they sleep (``launch_ready``)."""
        t0 = time.perf_counter()
        self._last_started = step
        try:
            self._wait()  # the previous save first: one pending checkpoint at a time
            pending = checkpoint.PendingCheckpoint(self.root, step)
            with pending.writing():
                checkpoint.save_driver_state(pending.tmp, self._driver_state(step))
                resident_in_generate = self.phases.plan.resident("generate")
                for name, group in self._groups.items():
                    if (
                        isinstance(group, BackgroundSaving)
                        and group.saves_asleep
                        and name not in resident_in_generate
                    ):
                        self._waiting.append(name)
                    else:
                        with self.phases.alone(name):
                            group.save(pending.tmp / name)
            self._pending = pending
            self._launch_ready()
        finally:
            self._blocking += time.perf_counter() - t0

    def launch_ready(self) -> None:
        """Start the background saves of the roles the current phase has asleep."""
        if not self._waiting:
            return
        t0 = time.perf_counter()
        try:
            self._launch_ready()
        finally:
            self._blocking += time.perf_counter() - t0

    def poll(self) -> Path | None:
        """Mark the pending checkpoint complete if every writer is done (never waits for one).

        Asks only the roles with no transition running: a role still moving (overlapped) would answer
        after it. An overlapped loop wakes the next step's first role ahead at the end of a step, so
        the loop polls there and again after generating, when the wakes ahead have usually ended;
        each role's answer is kept until the checkpoint is complete."""
        if self._pending is None or self._waiting:
            return None
        t0 = time.perf_counter()
        try:
            # A writer's failure (a full disk) arrives here: reported as the save's, its folder removed.
            with self._pending.writing():
                for name in self._writing:
                    group = self._groups[name]
                    assert isinstance(group, BackgroundSaving)  # only such roles are in _writing
                    if name not in self._written and not self.phases.busy(name) and group.save_done():
                        self._written.add(name)
            if self._written != set(self._writing) or any(self.phases.busy(n) for n in self._writing):
                return None  # completing calls every writing role: only when none would make it wait
            return self._finish()
        finally:
            self._blocking += time.perf_counter() - t0

    def wait(self) -> Path | None:
        """Wait for the pending checkpoint's writers and mark it complete; None when none was pending."""
        if self._pending is None:
            return None
        t0 = time.perf_counter()
        try:
            return self._wait()
        finally:
            self._blocking += time.perf_counter() - t0

    def pop_metrics(self) -> dict[str, float]:
        """Seconds the loop spent on saving since the last call (``time/save_blocking``) and the
        writers' seconds of the checkpoints completed meanwhile (``time/save_background``)."""
        out: dict[str, float] = {}
        if self._blocking > 0:
            out["time/save_blocking"] = self._blocking
        if self._background > 0:
            out["time/save_background"] = self._background
        out.update(self._starts)
        self._blocking = self._background = 0.0
        self._starts = {}
        return out

    # -- internals ---------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        if self._pending is None or self.phases.phase is None:
            return
        resident = self.phases.plan.resident(self.phases.phase)
        for name in [n for n in self._waiting if n not in resident]:
            group = self._groups[name]
            assert isinstance(group, BackgroundSaving)  # only such roles are in _waiting
            self.phases.settle(name)  # an overlapped sleep: its host copies are current once it ends
            t0 = time.perf_counter()
            with self._pending.writing():
                started = group.save_async(self._pending.tmp / name)
            # What starting the writers cost the loop (the call, and the workers' capture of their host
            # copies within it) and how many bytes they write.
            self._starts[f"save/{name}/start_s"] = time.perf_counter() - t0
            for key, metric in (("capture_seconds", "capture_s"), ("bytes", "bytes")):
                if key in started:
                    self._starts[f"save/{name}/{metric}"] = float(started[key])
            self._waiting.remove(name)
            self._writing.append(name)

    def _wait(self) -> Path | None:
        if self._pending is None:
            return None
        self._launch_ready()
        if self._waiting:
            # The loop enters "generate" after every save point, and the roles waiting here sleep
            # there: a role still resident means its state may have changed since the save point.
            raise RuntimeError(
                f"step {self._pending.step} checkpoint: roles {self._waiting} never slept after the save "
                "point, so their background save never started"
            )
        return self._finish()

    def _finish(self) -> Path:
        pending, writing = self._pending, self._writing
        assert pending is not None
        self._pending, self._writing, self._written = None, [], set()
        with pending.writing():
            for name in writing:
                group = self._groups[name]
                assert isinstance(group, BackgroundSaving)  # only such roles are in _writing
                self.phases.settle(name)
                self._background = max(self._background, group.save_wait())
        final = pending.finish(keep=self._keep)
        self.completed.append(final)
        return final
