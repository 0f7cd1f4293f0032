"""``train.lora`` through the Ray workers: a PPO step of a LoRA actor and critic with sleep and wake
around each phase, the weight update to an engine (merged weights, the checksums equal), and the
training state the workers report (AdamW state for the adapters and the value head only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import ray
from conftest import lora_config, make_fields, same_split
from transformers import AutoModelForCausalLM

from ppo_trainer.config import AlgorithmConfig, Role
from ppo_trainer.group import LocalSlots, TrainGroup
from ppo_value_transport import pack_fields
from ppo_weight_sync import RayEngineEndpoint
from ppo_weight_sync.testing.engine import TensorEngine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

ALGORITHM = AlgorithmConfig(lam=1.0, gamma=1.0, entropy_coef=0.0, num_mini_batches=1)


def _group(role: Role, model: Path) -> TrainGroup:
    config = lora_config(model, role, algorithm=ALGORITHM, micro_batch_size=4)
    return TrainGroup(role, LocalSlots(1), config, timeout_s=240)


def test_a_lora_step_with_offload_and_the_engines_checksum(tiny_model: Path) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor, critic = _group("actor", tiny_model), _group("critic", tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    spec = {name: ("float32", list(t.shape)) for name, t in model.state_dict().items()}
    handle = ray.remote(TensorEngine).options(max_concurrency=4, num_cpus=0).remote(spec, seed=5)
    try:
        # AdamW's state: two moments and a step of each adapter tensor (and of the value head)
        adapters = 2 * (4 * 4 * (32 + 32) + 3 * 4 * (32 + 64))  # two layers
        (actor_state,) = actor.memory_state()
        assert actor_state["optimizer_bytes"] == 2 * 4 * adapters + 4 * actor_state["optimizer_state_entries"]
        assert actor_state["optimizer_state_entries"] == 2 * 7 * 2
        box = pack_fields(make_fields(8, seed=41))
        before = actor.weights_checksum()
        critic.sleep()
        actor.sleep()
        critic.wake_up()
        values = critic.train(1, [box]).values
        critic.sleep()
        actor.wake_up()
        assert values is not None
        metrics = actor.train(1, [box], same_split(values, [8])).metrics
        assert metrics["optimizer_steps"] == 1.0
        actor.sleep()
        assert actor.weights_checksum() != before  # the adapters moved: the merged weights did too

        engine = RayEngineEndpoint(handle, num_gpus=1, name="engine-0")
        actor.wake_up()
        actor.connect_engines([engine])
        sent = actor.update_weights("1")
        whole = sum(t.numel() * 4 for t in model.state_dict().values())
        assert sent["weight_sync/bytes"] == whole  # merged: every tensor of the model, no adapter
        assert ray.get(handle.state.remote())["checksum"] == actor.weights_checksum()
    finally:
        ray.kill(handle)
        actor.shutdown()
        critic.shutdown()


def test_a_lora_critics_value_head_is_trained(tiny_model: Path) -> None:
    critic = _group("critic", tiny_model)
    try:
        (state,) = critic.memory_state()
        # the adapters' tensors and the value head's weight and bias
        assert state["optimizer_state_entries"] == 2 * 7 * 2 + 2
    finally:
        critic.shutdown()
