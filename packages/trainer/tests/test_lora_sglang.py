"""A LoRA actor's adapter-only weight updates to an SGLang server (``train.lora.update: adapters``), end
to end: the actor's Ray worker trains a step and its weight publisher loads the adapters into the SGLang
stand-in over HTTP (SGLang 0.5.23's ``/load_lora_adapter_from_tensors``, ``ppo_weight_sync.sglang_lora``).
The update carries the adapters' bytes alone, and the server's weights (the base merged with the adapter
its requests name) have the trainer's checksum."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from conftest import lora_config, make_fields, same_split

from ppo_rollout.config import AdapterUpdates  # a test-only sibling (noxfile's TEST_SIBLINGS)
from ppo_rollout.engine.sglang import SGLangServer, SGLangServerSpec
from ppo_trainer.config import AlgorithmConfig
from ppo_trainer.group import LocalSlots, TrainGroup
from ppo_value_transport import pack_fields
from ppo_weight_sync import HttpEngineEndpoint, free_port

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]

STANDIN = (sys.executable, "-m", "ppo_rollout.testing.sglang_standin")
# float32 bytes x 2 layers x rank 4 x (in + out) of the seven projections (hidden 32, MLP 64)
ADAPTER_BYTES = 2 * 4 * 4 * (4 * (32 + 32) + 3 * (32 + 64))


@pytest.fixture
def standin(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[HttpEngineEndpoint, Path]]:
    record = tmp_path / "requests.jsonl"
    spec = SGLangServerSpec(
        model_path=str(tiny_model),
        port=free_port(),
        command=STANDIN,
        lora=AdapterUpdates(rank=4, alpha=8.0),  # train.lora's, as the driver's engine_lora gives them
        extra_args=("--standin-record", str(record)),
    )
    server = SGLangServer(spec, startup_timeout_s=240)
    server.start()
    endpoint = HttpEngineEndpoint.for_sglang(server.url, num_gpus=1, timeout_s=60, name="sglang-0")
    yield endpoint, record
    endpoint.close()
    server.stop()


def test_a_lora_actor_sends_sglang_its_adapters_alone(
    tiny_model: Path, standin: tuple[HttpEngineEndpoint, Path]
) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    endpoint, record = standin
    algorithm = AlgorithmConfig(lam=1.0, gamma=1.0, entropy_coef=0.0, num_mini_batches=1)
    config = lora_config(tiny_model, "actor", algorithm=algorithm, micro_batch_size=4)
    config = dataclasses.replace(config, lora=dataclasses.replace(config.lora, update="adapters"))
    actor = TrainGroup("actor", LocalSlots(1), config, timeout_s=240)
    critic = TrainGroup("critic", LocalSlots(1), lora_config(tiny_model, "critic"), timeout_s=240)
    try:
        actor.connect_engines([endpoint])
        for step in (1, 2):
            box = pack_fields(make_fields(8, seed=step))
            values = critic.train(step, [box]).values
            assert values is not None
            actor.train(step, [box], same_split(values, [8]))
            sent = actor.update_weights(str(step))
            assert sent["weight_sync/bytes"] == ADAPTER_BYTES == 17_408
            assert endpoint.get_weight_version().result(60) == str(step)
            (held,) = endpoint.request("GET", "/standin_tp_checksums")["checksums"]
            assert held == actor.weights_checksum()  # the trainer's merged weights, bit for bit
    finally:
        actor.shutdown()
        critic.shutdown()
    paths = [json.loads(line)["path"] for line in record.read_text().splitlines()]
    assert paths.count("/load_lora_adapter_from_tensors") == 2
    assert paths.count("/unload_lora_adapter") == 1  # the second update replaces the first adapter
    assert "/init_weights_update_group" not in paths  # no weight group: the adapters go over HTTP
