"""How a run's stop reaches the user: a failure as ``RunFailed`` naming the step, the phase and where
a re-run resumes; a second SIGINT/SIGTERM ending every process at once; a disk too small for the
next checkpoint found before anything starts."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import ray.exceptions

from ppo_driver import checkpoint, reaper
from ppo_driver.config import ConfigError, RunConfig
from ppo_driver.faults import Interrupted, NonFiniteError, RunFailed, StopSignals, resume_hint
from ppo_driver.phases import TransitionFailed
from ppo_driver.step_record import Where
from ppo_trainer.errors import NonFiniteWeightsError


def where_to_resume(ckpt_root: Path) -> str:
    return resume_hint(checkpoint.latest_complete(ckpt_root))


@contextmanager
def report_failures(at: Where, ckpt_root: Path, run_dir: Path) -> Iterator[None]:
    """Turn an error of the run into ``RunFailed``: the step, the phase, and where a re-run resumes."""
    try:
        yield
    except (Interrupted, RunFailed, ConfigError):  # a bad input found late (the dataset's check): exit 2
        raise
    except Exception as exc:
        error = _non_finite_weights(exc, at.step) or _disk_full(exc, run_dir) or exc
        # A background sleep or wake is reported in the phase (and step) that started it.
        step, phase = (exc.step, exc.phase) if isinstance(exc, TransitionFailed) else (at.step, at.phase)
        raise RunFailed(step, phase, error, where_to_resume(ckpt_root)) from error


def stop_if_asked(signals: StopSignals, step: int, ckpt_root: Path) -> None:
    if signals.requested is not None:
        raise Interrupted(signals.requested, step, where_to_resume(ckpt_root))


def check_space(config: RunConfig, ckpt_root: Path) -> None:
    """Stop with one line, before anything starts, when the checkpoint folder's disk cannot hold the
    next checkpoint: as large as the latest one, or (a first run from a local model folder) about
    its weights' size times the copies a checkpoint holds. Nothing to compare for the tiny model, or
    for a run that saves nothing."""
    if config.checkpoint.interval <= 0 and not config.checkpoint.save_final:
        return
    needed = checkpoint.checkpoint_bytes(ckpt_root) or _checkpoint_estimate(config)
    try:
        checkpoint.check_space(ckpt_root, needed)
    except checkpoint.DiskFullError as exc:
        raise RunFailed(0, "setup", exc, where_to_resume(ckpt_root)) from exc


# Copies of the weights' bytes one checkpoint holds: the actor's model, its two Adam moments and its
# Hugging Face export; the critic's model and moments.
_COPIES_WITH_CRITIC = 7
_COPIES_WITHOUT = 4


def _checkpoint_estimate(config: RunConfig) -> int | None:
    if config.model.path is None or not Path(config.model.path).expanduser().is_dir():
        return None
    folder = Path(config.model.path).expanduser()
    weights = sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    return weights * (_COPIES_WITH_CRITIC if config.use_critic else _COPIES_WITHOUT) or None


def _disk_full(exc: BaseException, folder: Path) -> checkpoint.DiskFullError | None:
    """A full disk met outside a checkpoint's save (the run folder's files, the tiny model), named as
    one; a save's own is already a ``DiskFullError``."""
    if isinstance(exc, checkpoint.DiskFullError) or not checkpoint.is_disk_full(exc):
        return None
    error = checkpoint.disk_full(folder, None, "while writing the run's files")
    error.__cause__ = exc
    return error


def _non_finite_weights(exc: BaseException, step: int) -> NonFiniteError | None:
    """A worker's refusal to save or send non-finite weights (through Ray), as the run's report."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayTaskError):
            seen = seen.cause  # the worker's own exception, with its fields
        if isinstance(seen, NonFiniteWeightsError):
            error = NonFiniteError(seen.role, step, {}, weights=(seen.rank, seen.names))
            error.__cause__ = exc
            return error
        seen = seen.__cause__ if seen is not None else None
    return None


def stop_at_once(signum: int, at: Where, ckpt_root: Path, spared: set[int]) -> NoReturn:
    """A second SIGINT/SIGTERM: no safe point is awaited. Every process the run started (the local Ray
    instance and its workers) is killed, which leaves a checkpoint being written as a ``.tmp-`` folder
    that resume discards: its COMPLETE marker is written last, after every file. One line says where
    a re-run resumes; the exit code is 128 + the signal's number."""
    for _ in range(3):  # a process started while the first ones were killed is found the next time
        if not reaper.kill_all({p: t for p, t in reaper.descendants(os.getpid()).items() if p not in spared}):
            break
    sys.stderr.write(
        f"stopped at once by a second {signal.Signals(signum).name} in step {at.step}, phase {at.phase}; "
        f"every process the run started was ended; {where_to_resume(ckpt_root)}\n"
    )
    sys.stderr.flush()
    os._exit(128 + signum)  # nothing else to wait for: the lock goes with the process
