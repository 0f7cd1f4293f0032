"""Environment errors under ``on_env_error: zero``: written down, counted per step, and bounded.

A trajectory ended by its environment (status ``env_error``) trains with reward 0, so an environment
that always fails would let a run "succeed" on nothing. Each such error is appended to the run's
``env_errors.log`` (the environment, the row, the step, the turn and the exception, one line each);
every step that had any prints how many; a step where more than
``rollout.multi_turn.max_env_error_share`` of the trajectories failed stops the run.

The driver names the log file once per process (:func:`set_log_path`, the run folder's
``env_errors.log``); without one the errors are only counted.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from .trajectory import Trajectory

__all__ = ["LOG_NAME", "EnvErrorShare", "check_share", "log_path", "record", "set_log_path"]

LOG_NAME = "env_errors.log"
_lock = threading.Lock()
_path: Path | None = None


class EnvErrorShare(RuntimeError):
    """Too many of a step's trajectories ended by an environment error."""


def set_log_path(path: Path | None) -> None:
    """Where :func:`record` appends (None: nowhere)."""
    global _path
    _path = path


def log_path() -> Path | None:
    return _path


def record(message: str) -> None:
    """Appends one line: when, then the error's message (it names the environment, the row, the
    step, the sample and the turn)."""
    path = _path
    if path is None:
        return
    line = f"{datetime.now().isoformat(timespec='seconds')} {message}".replace("\n", " ")
    with _lock:
        try:
            with path.open("a", encoding="utf-8", errors="backslashreplace") as f:
                f.write(line + "\n")
        except OSError as exc:  # the run goes on; the count below still shows
            warnings.warn(f"cannot write {path}: {exc}", stacklevel=2)


def check_share(trajectories: Sequence[Trajectory], step: int, environment: str, bound: float) -> None:
    """Warns with the step's count of environment errors; ``EnvErrorShare`` past ``bound``."""
    failed = sum(1 for t in trajectories if t.status == "env_error")
    if not failed or not trajectories:
        return
    share = failed / len(trajectories)
    where = f" (each in {_path})" if _path is not None else ""
    summary = (
        f"step {step}: {failed} of {len(trajectories)} trajectories ended by an error of environment "
        f"{environment} and got reward 0 (rollout.multi_turn.on_env_error: zero){where}"
    )
    if share > bound:
        raise EnvErrorShare(
            f"{summary}; that is {share:.0%}, over rollout.multi_turn.max_env_error_share = {bound:g}: "
            "fix the environment or raise the bound"
        )
    warnings.warn(summary, stacklevel=2)
