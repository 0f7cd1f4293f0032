"""The start order on GPUs, run on CPU: the trainers' processes start before the engines (their
imports overlap the engines' start) and are set up after the engines exist (the engines size their
GPU memory before a trainer makes a CUDA context); the run then trains and its engines hold the
actor's weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from rich.console import Console

from ppo_driver.config import RunConfig, load_config
from ppo_driver.loop import train
from ppo_driver.roles import Roles, create_roles

QUIET = ["logging.progress=false", "logging.tensorboard=false", "rollout.eval_prompts=4"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=4, num_gpus=0, object_store_memory=256 * 1024**2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.timeout(600)
def test_trainers_spawn_before_the_engines_and_set_up_after_them(
    local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppo_rollout import manager
    from ppo_trainer import group

    events: list[str] = []
    spawn, make_rollout, make_group = (
        group.spawn_workers,
        manager.RolloutManager.__init__,
        group.TrainGroup.__init__,
    )

    def spawn_logged(role: Any, *args: Any, **kwargs: Any) -> Any:
        events.append(f"spawn {role}")
        return spawn(role, *args, **kwargs)

    def rollout_logged(self: Any, *args: Any, **kwargs: Any) -> None:
        make_rollout(self, *args, **kwargs)
        events.append("engines made")

    def group_logged(self: Any, role: Any, *args: Any, **kwargs: Any) -> None:
        events.append(f"set up {role} ({'adopted' if kwargs.get('spawned') else 'spawned there'})")
        make_group(self, role, *args, **kwargs)

    monkeypatch.setattr(group, "spawn_workers", spawn_logged)
    monkeypatch.setattr(manager.RolloutManager, "__init__", rollout_logged)
    monkeypatch.setattr(group.TrainGroup, "__init__", group_logged)

    def in_gpu_order(config: RunConfig, model_path: Path, timeout_s: float) -> Roles:
        return create_roles(config, model_path, timeout_s, together=False)

    config = load_config(None, [*QUIET, "train.steps=2", "checkpoint.interval=0"])
    result = train(config, tmp_path / "run", console=Console(quiet=True), roles_factory=in_gpu_order)
    assert events == [
        "spawn actor",
        "spawn critic",
        "engines made",
        "set up actor (adopted)",
        "set up critic (adopted)",
    ]
    assert result.last_step == 2
    assert result.weights_match, (result.actor_checksum, result.engine_checksums)
    assert result.startup is not None
