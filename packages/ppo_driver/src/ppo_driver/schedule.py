"""Where each step's batch comes from: generated at the step's start, or one step ahead.

``train.async: off``: step t's batch is generated at the start of step t, with the weights of step
t - 1 (the synchronous loop). ``one_step_off``: while step t trains, a background thread generates
step t + 1's batch with the weights the engines hold then (step t - 1's), so the batch is one weight
version old when it trains; the trainer corrects for it with truncated importance sampling on the
rollout's log-probs. The engines must be idle before their weights change, so the loop calls
:meth:`BatchSchedule.drain` before every weight update.

Resume stays exact because no generation is in flight across a checkpoint: after a step that saves
(and after the last step) nothing is prefetched, so the next step generates on its own from the
checkpointed weights and data position, in an uninterrupted run and in a resumed one alike.

Each batch handed out is checked: at most one weight version behind the published weights, or
``rollout.partial.max_staleness`` with partial rollouts (:func:`check_staleness`).

:class:`Cadence`: the steps a periodic job (a checkpoint, an evaluation) runs after.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from ppo_rollout.manager import RolloutBatch


@dataclass(frozen=True)
class Cadence:
    """Every ``interval`` steps (0: never), and after ``last_step`` when ``final``."""

    interval: int
    last_step: int
    final: bool

    def due(self, step: int) -> bool:
        return (self.interval > 0 and step % self.interval == 0) or (self.final and step == self.last_step)


NEVER = Cadence(0, 0, final=False)


class Generates(Protocol):
    def generate(self, step: int) -> RolloutBatch: ...


class BatchSchedule:
    """Hands out each step's batch; with ``one_step_off``, generates the next one in the background."""

    def __init__(
        self,
        rollout: Generates,
        mode: Literal["off", "one_step_off"],
        *,
        last_step: int,
        saves_at: Callable[[int], bool],
        timeout_s: float,
        max_staleness: int = 1,
    ) -> None:
        self.rollout = rollout
        self.max_staleness = max_staleness
        self.mode = mode
        self.last_step = last_step
        self.saves_at = saves_at
        self.timeout_s = timeout_s
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefetch")
            if mode == "one_step_off"
            else None
        )
        self._pending: tuple[int, concurrent.futures.Future[RolloutBatch]] | None = None

    def batch(self, step: int) -> RolloutBatch:
        """Step ``step``'s batch: the prefetched one if there is one, else generated now."""
        if self._pending is not None:
            ahead, future = self._pending
            if ahead != step:
                raise RuntimeError(f"step {step}: the prefetched batch is for step {ahead}")
            self._pending = None
            return self._result(step, future)
        return self.rollout.generate(step)

    def start_next(self, step: int) -> bool:
        """One-step-off: start generating step ``step + 1``'s batch now (while ``step`` trains).

        Nothing starts after the last step or after a step that saves a checkpoint (see the module
        docstring). Returns whether generation started.
        """
        if self._pool is None or step >= self.last_step or self.saves_at(step):
            return False
        if self._pending is not None:
            raise RuntimeError(f"step {step}: a batch is already being generated for step {self._pending[0]}")
        self._pending = (step + 1, self._pool.submit(self.rollout.generate, step + 1))
        return True

    def after_batch(self, step: int, batch: RolloutBatch, published: int) -> dict[str, int]:
        """Step ``step`` has its batch: its staleness checked against the latest ``published`` weight
        version (:func:`check_staleness`), then the next batch started when due (:meth:`start_next`);
        both as the step's metrics."""
        return {
            "rollout/staleness": check_staleness(step, batch.metrics, published, self.max_staleness),
            "rollout/prefetched_next": int(self.start_next(step)),
        }

    def drain(self) -> None:
        """Wait until no generation is in flight (before the engines' weights change)."""
        if self._pending is not None:
            step, future = self._pending
            concurrent.futures.wait([future], timeout=self.timeout_s)
            if not future.done():
                raise TimeoutError(
                    f"generating step {step}'s batch in the background took more than {self.timeout_s:g} s"
                )

    def _result(self, step: int, future: concurrent.futures.Future[RolloutBatch]) -> RolloutBatch:
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"generating step {step}'s batch in the background took more than {self.timeout_s:g} s"
            ) from None

    def close(self) -> None:
        """Wait for a generation in flight (its engines calls are bounded by the rollout's timeouts)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending = None


def check_staleness(step: int, batch_metrics: Mapping[str, Any], published: int, allowed: int = 1) -> int:
    """Weight versions between the batch's oldest sample and the latest published weights: 0 in the
    synchronous loop, at most 1 one step off, at most ``allowed`` (``rollout.partial.max_staleness``)
    with partial rollouts (anything more is a scheduling bug, stopped here)."""
    oldest = batch_metrics.get("rollout/weight_version_min", -1.0)
    if oldest < 0:  # the engines report no numeric version: nothing to check
        return 0
    behind = int(published - oldest)
    if behind > allowed:
        raise RuntimeError(
            f"step {step}: the batch was generated with weight version {int(oldest)}, {behind} versions "
            f"behind the published {published}; at most {allowed} allowed"
        )
    return behind
