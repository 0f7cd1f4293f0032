"""The built-in engine: weight updates through the protocol (a real sender, gloo), pause, memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from transformers import AutoModelForCausalLM

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.handles import BuiltinEngineHandle
from ppo_rollout.manager import RolloutManager
from ppo_rollout.tasks import make_tiny_model
from ppo_weight_sync import RayEngineEndpoint, UpdateRequest, WeightSender, checksum

PROMPTS = [[1, 5, 6, 14], [1, 7, 8, 9, 14]]
SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=8, n_samples_per_prompt=2, seed=4)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("copy", tmp_path_factory.mktemp("other") / "model", seed=1)


@pytest.fixture(scope="module")
def engine_actor(manager: RolloutManager) -> Iterator[object]:
    """A BuiltinEngineActor: the first engine of the session's manager (one Ray start for the suite)."""
    handle = manager.engines[0]
    assert isinstance(handle, BuiltinEngineHandle)
    original = handle.actor.named_tensors.remote()
    yield handle.actor
    # Put the original weights back for the tests that run after this module.
    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60.0)
    sender.connect([RayEngineEndpoint(handle.actor, num_gpus=1, name=handle.name)])
    try:
        sender.update(ray.get(original, timeout=60), version="restored")
    finally:
        sender.disconnect()


@pytest.mark.timeout(300)
def test_weights_sent_through_the_protocol_change_generations(
    engine_actor: object, tiny_model: Path, other_model: Path
) -> None:
    before = ray.get(engine_actor.generate.remote(PROMPTS, SAMPLING), timeout=60)  # type: ignore[attr-defined]
    assert before == ray.get(engine_actor.generate.remote(PROMPTS, SAMPLING), timeout=60)  # type: ignore[attr-defined]
    new = AutoModelForCausalLM.from_pretrained(other_model).state_dict()
    named = [(n, t.clone()) for n, t in new.items()]

    sender = WeightSender(backend="gloo", master_address="127.0.0.1", timeout_s=60.0, bucket_bytes=64 << 10)
    sender.connect([RayEngineEndpoint(engine_actor, num_gpus=1, name="rollout-0")])
    try:
        sender.update(named, version="v1")
    finally:
        sender.disconnect()

    assert ray.get(engine_actor.get_weight_version.remote(), timeout=30) == "v1"  # type: ignore[attr-defined]
    assert ray.get(engine_actor.weights_checksum.remote(), timeout=30) == checksum(named)  # type: ignore[attr-defined]
    after = ray.get(engine_actor.generate.remote(PROMPTS, SAMPLING), timeout=60)  # type: ignore[attr-defined]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    # ... and they are what the new model generates on its own
    assert after == GenerationCore(other_model).generate(PROMPTS, SAMPLING)


def test_pause_holds_generation_between_steps_and_an_update_lands_while_paused(
    tiny_model: Path, other_model: Path
) -> None:
    engine = BuiltinEngine(tiny_model, timeout_s=30.0)
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=20)
    result: list[object] = []
    assert engine.pause_generation().success
    worker = threading.Thread(target=lambda: result.append(engine.generate(PROMPTS, sampling)))
    worker.start()
    time.sleep(1.0)
    assert worker.is_alive()
    assert not result
    assert engine.is_paused()
    # A load while paused (what update_weights_from_distributed does between pause and continue).
    new = AutoModelForCausalLM.from_pretrained(other_model).state_dict()
    engine._load_weights(new.items())
    assert engine.continue_generation().success
    worker.join(30)
    assert not worker.is_alive()
    # Generated entirely with the new weights: the pause came before the first step.
    assert result[0] == GenerationCore(other_model).generate(PROMPTS, sampling)


def test_pause_times_out_with_a_clear_message(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model, timeout_s=0.5)
    engine.pause_generation()
    with pytest.raises(TimeoutError, match=r"stayed paused .* waiting for continue_generation"):
        engine.generate(PROMPTS, SAMPLING)
    engine.continue_generation()
    assert len(engine.generate(PROMPTS, SAMPLING)) == 4


def test_release_and_resume_memory_keep_weights_bit_identical(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model)
    before_sum = engine.weights_checksum()
    before = engine.generate(PROMPTS, SAMPLING)
    reply = engine.release_memory_occupation(tags=["weights", "kv_cache"])
    assert reply.success, reply
    assert engine.released_tags() == ["kv_cache", "weights"]
    assert engine.release_memory_occupation(tags=None).success  # idempotent
    with pytest.raises(RuntimeError, match="weights are released; call resume_memory_occupation"):
        engine.generate(PROMPTS, SAMPLING)
    assert engine.resume_memory_occupation(tags=None).success
    assert engine.resume_memory_occupation(tags=None).success  # idempotent
    assert engine.weights_checksum() == before_sum
    assert engine.generate(PROMPTS, SAMPLING) == before
    bad = engine.release_memory_occupation(tags=["bogus"])
    assert not bad.success
    assert "unknown memory tags ['bogus']" in bad.message


def test_flush_and_version_before_any_update(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model)
    assert engine.flush_cache().success
    assert engine.get_weight_version() is None
    reply = engine.update_weights_from_distributed(
        UpdateRequest(
            names=["x"],
            dtypes=["float32"],
            shapes=[[1]],
            group_name="nope",
            weight_version=None,
            flush_cache=True,
            load_format=None,
        )
    )
    assert not reply.success
    assert "not joined" in reply.message


def test_the_manager_reports_its_engines_start_up(manager: RolloutManager) -> None:
    # Each engine timed its own start-up (ppo_lifecycle.startup): the driver's start-up table shows it.
    startup = manager.startup
    assert {"imports", "model", "cuda graphs"} <= set(startup)
    assert startup["model"] > 0
    assert startup["cuda graphs"] == 0.0  # on CPU the static decoder runs eagerly: no graphs
    assert all(seconds >= 0 for seconds in startup.values())
