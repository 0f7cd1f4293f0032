"""Where a run starts: a finished run's folder left alone, an older run moved aside
(``checkpoint.resume=false``), or the latest complete checkpoint that loads (model, optimizer, critic,
step, RNG and data position), with a warning when the config changed in a field that matters."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ray.exceptions
from rich.console import Console

from ppo_driver import checkpoint
from ppo_driver.config import RunConfig, dump_config
from ppo_driver.metrics import METRICS_FILE
from ppo_driver.roles import Roles
from ppo_lifecycle.plan import Phase


def already_done(
    ckpt_root: Path, verified: checkpoint.BackgroundVerify | None, steps: int
) -> tuple[int, Path] | None:
    """The latest complete checkpoint, when it is whole and at or past ``steps``: nothing to train."""
    found = checkpoint.latest_complete(ckpt_root)
    if verified is None or found is None or found[0] < steps:
        return None
    try:
        verified.check(found[1])
    except (checkpoint.CheckpointError, OSError):
        return None  # the resume reports it and falls back to an earlier checkpoint
    return found


def resume(
    ckpt_root: Path,
    verified: checkpoint.BackgroundVerify,
    roles: Roles,
    enter: Callable[[Phase], None],
    config: RunConfig,
    console: Console,
) -> int:
    """Load the latest complete checkpoint that loads; return its step (0 when there is none)."""
    for _, folder in checkpoint.unmarked_checkpoints(ckpt_root):
        console.print(
            f"[yellow]warning:[/] checkpoint {folder} is skipped: it has no {checkpoint.MARKER} marker "
            "(copied in part, or the marker was removed), so nothing says its files are whole",
            highlight=False,
        )
    found = checkpoint.complete_checkpoints(ckpt_root)
    for step, folder in reversed(found):
        try:
            state = _load(folder, verified, roles, enter, config)
        except Exception as exc:
            if is_process_death(exc):
                raise  # not the checkpoint's fault
            console.print(
                f"[yellow]warning:[/] checkpoint {folder} does not load ({first_line(exc)}); "
                "trying the previous complete one",
                highlight=False,
            )
            continue
        console.print(f"resumed from {folder} (step {step})", highlight=False)
        _warn_if_changed(state, config, console)
        return step
    if found:
        # Some roles may hold part of a checkpoint now: starting from step 0 would not be a fresh run.
        changed = changed_fields(_saved_config(found[-1][1]), config)
        hint = f" (the config differs from theirs in {', '.join(changed[:4])})" if changed else ""
        raise checkpoint.CheckpointError(
            f"none of the {len(found)} complete checkpoints under {ckpt_root} loads{hint}; see the "
            "warnings above: set those fields back, or move that folder aside (or set "
            "checkpoint.resume=false) to start over"
        )
    return 0


def _load(
    folder: Path,
    verified: checkpoint.BackgroundVerify,
    roles: Roles,
    enter: Callable[[Phase], None],
    config: RunConfig,
) -> checkpoint.DriverState:
    verified.check(folder)
    state = checkpoint.load_driver_state(folder)  # also restores the driver's RNG
    # One role resident at a time: the phases that train each have it so.
    enter("actor_train")
    roles.actor.load(folder / "actor")
    if roles.critic is not None:
        enter("critic_train")
        roles.critic.load(folder / "critic")
    roles.rollout.load_state_dict(_data_position(state.rollout, config))
    return state


def _data_position(rollout: Mapping[str, Any], config: RunConfig) -> dict[str, Any]:
    """The saved rollout state; with ``checkpoint.accept_changes=[dataset]`` marked so that a changed
    training file starts a new epoch (``ppo_rollout.data.JsonlPrompts.load_state_dict``)."""
    state = dict(rollout)
    data = state.get("data")
    if "dataset" in config.checkpoint.accept_changes and isinstance(data, Mapping):
        from ppo_rollout.data import NEXT_EPOCH

        state["data"] = {**data, "on_change": NEXT_EPOCH}
    return state


def _warn_if_changed(state: checkpoint.DriverState, config: RunConfig, console: Console) -> None:
    changed = changed_fields(state.extra.get("config", {}), config)
    if changed:
        console.print(
            f"[yellow]warning:[/] resuming with a config that differs from the checkpoint's in "
            f"{', '.join(changed)}; the run will not match an uninterrupted one",
            highlight=False,
        )


def _saved_config(folder: Path) -> dict[str, Any]:
    """The config a checkpoint was written with (read from driver.json alone); {} when unreadable."""
    try:
        doc = json.loads((folder / "driver.json").read_text())
        saved = doc["extra"]["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return saved if isinstance(saved, dict) else {}


def start_over(run_dir: Path, ckpt_root: Path, console: Console) -> None:
    """``checkpoint.resume=false``: keep an older run's checkpoints and metrics, out of the new run's way."""
    aside = checkpoint.move_aside(ckpt_root)
    if aside is not None:
        console.print(
            f"checkpoint.resume=false: moved the earlier run's checkpoints from {ckpt_root} to {aside}",
            highlight=False,
        )
    metrics = run_dir / METRICS_FILE
    if metrics.exists():
        old = metrics.with_name(f"metrics.before-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        metrics.rename(old)
        console.print(f"checkpoint.resume=false: moved the earlier run's metrics to {old}", highlight=False)


def is_process_death(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayActorError):
            return True
        seen = seen.__cause__
    return False


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    # Ray's task errors start with a header line; the worker's own message is the last line.
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


def driver_state(
    step: int, roles: Roles, config: RunConfig, run_dir: Path | None = None
) -> checkpoint.DriverState:
    """What the driver saves with a checkpoint: the step, the data position, the config, and the run
    folder that wrote it (a resume from another run's checkpoint folder is refused, resume_checks.py)."""
    return checkpoint.DriverState(
        step=step,
        rollout=roles.rollout.state_dict(),
        extra={
            "config": config.model_dump(mode="json"),
            "config_sha256": config_digest(config),
            "time": time.time(),
            **({"run_dir": str(run_dir.resolve())} if run_dir is not None else {}),
        },
    )


# Fields a resumed run may change without changing what it computes.
RESUME_FREE = (
    "train.steps",
    "train.check_weights",
    "checkpoint.",
    "logging.",
    "ray.",
    "rollout.eval_interval",
    "rollout.eval_dataset",
    "rollout.reward_timeout_s",
)


def changed_fields(saved: Mapping[str, Any], config: RunConfig) -> list[str]:
    """Dotted names whose value differs between a checkpoint's saved config and ``config``."""
    if not saved:  # a checkpoint that recorded no config: nothing to compare
        return []
    now = _flatten(config.model_dump(mode="json"))
    before = _flatten(saved)
    # A setting newer than the checkpoint (its section's name absent there) had no value to change.
    known = {_setting(n) for n in before}
    names = sorted(set(before) | {n for n in now if _setting(n) in known})
    return [
        n
        for n in names
        if now.get(n) != before.get(n) and not any(n == f or n.startswith(f) for f in RESUME_FREE)
    ]


def _setting(name: str) -> str:
    """``rollout.sglang.host`` -> ``rollout.sglang``: a section's field, the unit settings come in."""
    return ".".join(name.split(".")[:2])


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def config_digest(config: RunConfig) -> str:
    return hashlib.sha256(dump_config(config).encode()).hexdigest()
