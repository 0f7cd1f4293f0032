"""What stops a run, and how the stop is reported: one message naming the step, the phase, what
failed and the checkpoint a re-run resumes from.

- ``RunFailed``: a step failed (a role's process died, a non-finite loss, a full disk, ...).
- ``NonFiniteError``: a role reported a non-finite loss or gradient norm, or its worker refused to
  save or send non-finite weights; raised before the step's weights are saved or sent to the engines.
- ``Interrupted``: SIGINT or SIGTERM arrived; the loop stopped after saving at the end of a step.
- ``StopSignals``: turns the first SIGINT/SIGTERM into a request the loop checks between steps (a
  second one interrupts at once, as Python's default does).
"""

from __future__ import annotations

import math
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any


class NonFiniteError(RuntimeError):
    """``names``: the non-finite metrics and their values; or ``weights``: the rank and tensor names a
    role's worker refused to save or send (``ppo_trainer.NonFiniteWeightsError``)."""

    def __init__(
        self,
        role: str,
        step: int,
        names: Mapping[str, Any],
        *,
        weights: tuple[int, Sequence[str]] | None = None,
    ) -> None:
        shown = ", ".join(f"{k}={v}" for k, v in names.items())
        if weights is not None:
            rank, tensors = weights
            listed = ", ".join(tensors[:5]) + (f" and {len(tensors) - 5} more" if len(tensors) > 5 else "")
            shown = f"weights of rank {rank}: {listed}"
        super().__init__(
            f"the {role} reported non-finite values at step {step} ({shown}); its weights of this step "
            "were neither saved nor sent to the engines. Look for rewards of huge magnitude, or lower "
            "train.actor_lr / train.critic_lr"
        )
        self.role = role
        self.step = step


# Metrics whose non-finite value means the role's weights are no longer usable.
_WATCHED = ("loss", "grad_norm")


def check_finite(role: str, step: int, metrics: Mapping[str, Any]) -> None:
    bad = {
        key: value
        for key, value in metrics.items()
        if any(w in key.rsplit("/", 1)[-1] for w in _WATCHED)
        and isinstance(value, int | float)
        and not math.isfinite(value)
    }
    if bad:
        raise NonFiniteError(role, step, bad)


def resume_hint(checkpoint: tuple[int, Path] | None) -> str:
    if checkpoint is None:
        return "no complete checkpoint exists yet: a re-run of the same command starts from step 0"
    step, folder = checkpoint
    return f"a re-run of the same command resumes from {folder} (step {step})"


class RunFailed(RuntimeError):
    """A step failed; ``str()`` is the whole report, ``__cause__`` the original error."""

    def __init__(self, step: int, phase: str, error: BaseException, resume: str) -> None:
        what = f"{type(error).__name__}: {error}" if not isinstance(error, NonFiniteError) else str(error)
        super().__init__(
            f"the run stopped at step {step}, phase {phase}: {what}\n"
            f"every process the run started was ended; {resume}"
        )
        self.step = step
        self.phase = phase


class Interrupted(Exception):
    """SIGINT/SIGTERM stopped the run at a safe point (after step ``step``, saved)."""

    def __init__(self, signum: int, step: int, resume: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}; {resume}")
        self.signum = signum
        self.step = step


class StopSignals:
    """Within the block, the first SIGINT/SIGTERM sets ``requested``; a second one acts as usual."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:  # asked twice: stop now
            self._restore()
            raise KeyboardInterrupt
        self.requested = signum

    def __enter__(self) -> StopSignals:
        try:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self._previous.clear()
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._restore()
