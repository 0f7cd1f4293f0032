"""``train.lora`` through the Ray workers: a PPO step of a LoRA actor and critic with sleep and wake
around each phase, the weight update to an engine (merged weights, the checksums equal), the
adapter-only update to the built-in engine (only adapter tensors sent; the engine merges them from
the base it keeps, with the trainer's checksum and the merged engine's weights and generations), and
the training state the workers report (AdamW state for the adapters and the value head only)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from conftest import lora_config, make_fields, same_split
from transformers import AutoModelForCausalLM

from ppo_trainer.config import AlgorithmConfig, Role
from ppo_trainer.group import LocalSlots, TrainGroup
from ppo_value_transport import pack_fields
from ppo_weight_sync import RayEngineEndpoint
from ppo_weight_sync.testing.engine import TensorEngine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

ALGORITHM = AlgorithmConfig(lam=1.0, gamma=1.0, entropy_coef=0.0, num_mini_batches=1)


def _group(role: Role, model: Path, update: str | None = None, sync_dtype: str = "float32") -> TrainGroup:
    config = lora_config(model, role, algorithm=ALGORITHM, micro_batch_size=4, weight_sync_dtype=sync_dtype)
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, update=update))
    return TrainGroup(role, LocalSlots(1), config, timeout_s=240)


def _train_step(actor: TrainGroup, critic: TrainGroup, seed: int) -> None:
    box = pack_fields(make_fields(8, seed=seed))
    values = critic.train(1, [box]).values
    assert values is not None
    assert actor.train(1, [box], same_split(values, [8])).metrics["optimizer_steps"] == 1.0


# float32 bytes x 2 layers x rank 4 x (in + out) of the seven projections (hidden 32, MLP 64)
ADAPTER_BYTES = 2 * 4 * 4 * (4 * (32 + 32) + 3 * (32 + 64))


def test_an_adapter_only_update_sends_the_adapters_alone(tiny_model: Path) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = _group("actor", tiny_model, update="adapters")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    # an engine that accepts the adapters' names and records what arrives
    spec: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        if name.endswith("_proj.weight"):
            path = name.removesuffix(".weight")
            spec[f"{path}.lora_A.weight"] = ("float32", [4, t.shape[1]])
            spec[f"{path}.lora_B.weight"] = ("float32", [t.shape[0], 4])
    handle = ray.remote(TensorEngine).options(max_concurrency=4, num_cpus=0).remote(spec, seed=5)
    try:
        actor.connect_engines([RayEngineEndpoint(handle, num_gpus=1, name="engine-0")])
        sent = actor.update_weights("1")
        print(f"adapter-only update of the tiny model: {sent['weight_sync/bytes']:.0f} bytes")
        assert ADAPTER_BYTES == 17_408  # 4,352 float32 parameters
        assert sent["weight_sync/bytes"] == ADAPTER_BYTES
        # The engine refuses a name outside its spec, so nothing but adapters was sent; every B arrived
        # (the trainer's B starts at zero, the engine's own tensors are random).
        held = ray.get(handle.named_tensors.remote())
        assert len(held) == 2 * 14
        assert all(not t.any() for n, t in held.items() if n.endswith("lora_B.weight"))
    finally:
        ray.kill(handle)
        actor.shutdown()


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


@pytest.fixture(scope="module")
def critic(tiny_model: Path, ray_session: None) -> Iterator[TrainGroup]:
    """The module's LoRA critic (a worker's start is most of a test's time): first looked at untrained,
    then it gives each engine test's two actors the values of that test's batches (which steps the
    critic took before does not matter: both actors get the same values)."""
    group = _group("critic", tiny_model)
    yield group
    group.shutdown()


def test_a_lora_critics_value_head_is_trained(critic: TrainGroup) -> None:
    (state,) = critic.memory_state()
    # the adapters' tensors and the value head's weight and bias
    assert state["optimizer_state_entries"] == 2 * 7 * 2 + 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_builtin_engine_merges_adapter_only_updates_from_its_base(
    tiny_model: Path, critic: TrainGroup, dtype: str
) -> None:
    """Two actors of one seed train on the same batches; after each step one sends its adapters alone to a
    built-in engine, the other merged weights to another. Both engines then hold the trainers' checksum
    (the adapters' engine merged from its base, not onto its previous merge) and generate the same; in
    bfloat16 (CUDA's sync dtype) the workers' checksum rounds the adapters before merging as the engine
    does."""
    from ppo_rollout.config import AdapterUpdates, SamplingConfig
    from ppo_rollout.engine import builtin  # a test-only sibling (noxfile's TEST_SIBLINGS)

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor = _group("actor", tiny_model, "adapters", dtype)
    merged_actor = _group("actor", tiny_model, "merged", dtype)
    options: dict[str, Any] = {"max_concurrency": 4, "num_cpus": 0}
    lora = AdapterUpdates(rank=4, alpha=8.0)
    engine = builtin.BuiltinEngineActor.options(**options).remote(
        str(tiny_model), name="adapters", dtype=dtype, torch_threads=1, lora=lora
    )
    merged = builtin.BuiltinEngineActor.options(**options).remote(
        str(tiny_model), name="merged", dtype=dtype, torch_threads=1
    )
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=12)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    try:
        actor.connect_engines([RayEngineEndpoint(engine, num_gpus=1, name="adapters")])
        merged_actor.connect_engines([RayEngineEndpoint(merged, num_gpus=1, name="merged")])
        seen = {ray.get(engine.weights_checksum.remote())}
        for step in (1, 2):
            box = pack_fields(make_fields(8, seed=40 + step))
            values = critic.train(1, [box]).values
            assert values is not None
            for group in (actor, merged_actor):
                group.train(1, [box], same_split(values, [8]))
            sent = actor.update_weights(str(step))["weight_sync/bytes"]
            assert sent == ADAPTER_BYTES // (1 if dtype == "float32" else 2)
            merged_actor.update_weights(str(step))
            expected = actor.weights_checksum()
            assert merged_actor.weights_checksum() == expected  # the same training, bit for bit
            assert ray.get(engine.weights_checksum.remote()) == expected
            assert ray.get(merged.weights_checksum.remote()) == expected
            seen.add(expected)
            ours, theirs = ray.get([e.generate.remote(prompts, sampling, 0) for e in (engine, merged)])
            assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
        assert len(seen) == 3  # each update changed the weights: step 2 merged from the base, not onto step 1
    finally:
        for handle in (engine, merged):
            ray.kill(handle)
        for group in (actor, merged_actor):
            group.shutdown()


def test_bfloat16_adapters_give_the_engine_the_trainers_bits(tiny_model: Path) -> None:
    """In bfloat16 (the CUDA sync dtype) too: the trainer's merged export rounds base and adapters to the
    sync dtype before the merge, as the engine receives them, so the checksums stay equal (one process,
    no Ray: the dtype path alone)."""
    from ppo_rollout.config import AdapterUpdates
    from ppo_rollout.engine import builtin
    from ppo_trainer.backend import TorchTrainer
    from ppo_weight_sync import checksum

    trainer = TorchTrainer(lora_config(tiny_model, weight_sync_dtype="bfloat16"))
    with torch.no_grad():  # adapters as training leaves them: B no longer zero
        g = torch.Generator().manual_seed(1)
        for p in trainer.params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    engine = builtin.BuiltinEngine(
        tiny_model, "cpu", "bfloat16", lora=AdapterUpdates(rank=4, alpha=8.0), torch_threads=1
    )
    sent = trainer.trainable_weights(torch.bfloat16)
    assert {t.dtype for _, t in sent} == {torch.bfloat16}
    assert sum(t.numel() * t.element_size() for _, t in sent) == ADAPTER_BYTES // 2
    engine._load_weights(sent)
    assert engine.weights_checksum() == checksum(list(trainer.named_weights(torch.bfloat16)))
