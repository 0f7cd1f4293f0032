"""The loop's other shapes, in one local Ray instance: GRPO without a critic (disaggregated, two
engines, evaluation every step) with DAPO's dynamic sampling and overlong shaping (it trains only on
groups whose scores vary, and logs the rollout/dynamic metrics), critic-only warm-up steps, and LoRA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from rich.console import Console

from ppo_driver.config import RunConfig, load_config
from ppo_driver.loop import train
from ppo_driver.ray_start import start_local_ray
from ppo_driver.roles import Roles, create_roles
from ppo_trainer.group import TrainGroup

QUIET = ["logging.progress=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    # The driver's own start-up: long timeouts and one retry, for a loaded CI machine.
    start_local_ray(load_config(None, QUIET), Console(stderr=True))
    yield
    ray.shutdown()


PROMPTS = 8
MAX_ROUNDS = 10  # the random tiny model scores many groups all wrong: room to refill them


@pytest.mark.timeout(300)
def test_grpo_without_critic_disaggregated_trains_only_on_groups_whose_scores_vary(
    local_ray: None, tmp_path: Path
) -> None:
    config = load_config(
        None,
        [
            *QUIET,
            "algorithm.estimator=grpo",
            "algorithm.normalize_advantages=null",
            "placement.critic=none",
            "placement.mode=disaggregate",
            "placement.rollout_gpus=2",
            "train.steps=3",
            f"rollout.prompts_per_step={PROMPTS}",
            "rollout.eval_interval=1",
            "rollout.eval_prompts=4",
            "rollout.dynamic_sampling.enabled=true",
            f"rollout.dynamic_sampling.max_rounds={MAX_ROUNDS}",
            "rollout.dynamic_sampling.over_sample=1.0",
            "rollout.dynamic_sampling.on_exhausted=stop",
            "rollout.overlong.buffer_len=2",
            "rollout.overlong.penalty_factor=0.5",
            "checkpoint.interval=0",
        ],
    )
    result = train(config, tmp_path / "run", console=Console(quiet=True))
    assert [r["step"] for r in result.history] == [1, 2, 3]
    for record in result.history:
        assert not any(key.startswith(("critic/", "handoff/")) for key in record)
        assert "actor/loss" in record
        assert "eval/reward_mean" in record
        # Engines on their own bundles stay resident; the actor sleeps between its phases.
        assert record["offload/transitions"] == ["actor:wake", "actor:sleep"]
        assert record["offload/rollout_sleeps"] == 0
        # Every trained group has varying scores: none padded in.
        assert record["rollout/dynamic/kept_groups"] == PROMPTS
        assert record["rollout/dynamic/padded_groups"] == 0
        assert 1 <= record["rollout/dynamic/rounds"] <= MAX_ROUNDS
        # A second round refills what the first dropped.
        refilled = record["rollout/dynamic/samples_generated_per_trained"] > 1
        assert (record["rollout/dynamic/rounds"] > 1) == refilled
        constant = record["rollout/dynamic/all_correct_groups"] + record["rollout/dynamic/all_wrong_groups"]
        assert 0.0 <= constant < 1.0
    # The random tiny model leaves some groups all wrong: refilling is exercised.
    assert max(r["rollout/dynamic/rounds"] for r in result.history) >= 2
    assert max(r["rollout/dynamic/all_wrong_groups"] for r in result.history) > 0
    assert len(result.engine_checksums) == 2
    assert result.weights_match


@pytest.mark.timeout(300)
def test_critic_only_warmup_steps(local_ray: None, tmp_path: Path) -> None:
    config = load_config(None, [*QUIET, "train.steps=3", "train.num_critic_only_steps=2"])
    result = train(config, tmp_path / "run", console=Console(quiet=True))
    assert [r["actor_trained"] for r in result.history] == [0, 0, 1]
    for record in result.history[:2]:
        assert "critic/loss" in record
        assert "actor/loss" not in record
        assert "weight_sync/updates" not in record
        # The actor never wakes in a warm-up step: engines out, critic in and out, engines back.
        assert record["offload/transitions"] == [
            "rollout:sleep",
            "critic:wake",
            "critic:sleep",
            "rollout:wake",
        ]
    last = result.history[2]
    assert "actor/loss" in last
    assert last["handoff/values_used"] == 1
    assert last["weight_sync/updates"] >= 1
    assert result.weights_match


@pytest.mark.timeout(300)
def test_lora_actor_sends_the_engine_its_adapters_alone(local_ray: None, tmp_path: Path) -> None:
    """`train.lora` on both roles with the built-in engine: each weight update carries the actor's
    adapters only, and the engine, merging them onto the base it keeps, ends with the actor's weights.
    The critic, sharing the actor's devices, maps the actor's frozen base (``train.lora.share_base``
    auto): one shared-memory file, removed once mapped."""
    config = load_config(None, [*QUIET, "train.steps=3", "train.lora.rank=4"])
    assert config.train.lora is not None
    states: dict[str, Any] = {}

    def roles_factory(config: RunConfig, model_path: Path, timeout_s: float) -> Roles:
        roles = create_roles(config, model_path, timeout_s)
        for role in ("actor", "critic"):
            group = getattr(roles, role)
            assert isinstance(group, TrainGroup)
            states[role] = group.shared_base_state()[0]
        return roles

    result = train(config, tmp_path / "run", console=Console(quiet=True), roles_factory=roles_factory)
    assert states["actor"]["inode"] == states["critic"]["inode"]
    assert states["actor"]["digest"] == states["critic"]["digest"]
    assert not list(Path("/dev/shm").glob("ppo-lora-base-*"))
    # float32 x rank 4 x (in + out) of the seven projections of the built-in tiny model's decoder
    # layers: the adapters alone, against 339,200 bytes for the whole model.
    sent = {record["weight_sync/bytes"] for record in result.history}
    assert sent == {34_816.0}
    assert result.weights_match
