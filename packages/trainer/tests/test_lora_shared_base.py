"""``train.lora.share_base`` through real Ray workers on CPU: the critic maps the actor's frozen base
(one shared-memory file, the same pages in both processes), training and sleep/wake leave it
bit-identical and give the unshared setup's results, a checkpoint resumes bit for bit, and the
settings that cannot share are refused with the field and the fix."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load_benchmark, lora_config, make_fields, same_split

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.config import AlgorithmConfig, LoraSettings, Role
from ppo_trainer.group import LocalSlots, TrainGroup
from ppo_trainer.shared_base import SharedBase
from ppo_value_transport import pack_fields, unpack_fields

# kl_coef > 0: the critic holds the reference, which maps the shared base too
ALGORITHM = AlgorithmConfig(lam=1.0, gamma=1.0, entropy_coef=0.0, num_mini_batches=1, kl_coef=0.05)


def _group(role: Role, model: Path, **share: Any) -> TrainGroup:
    config = lora_config(model, role, algorithm=ALGORITHM, micro_batch_size=4)
    return TrainGroup(role, LocalSlots(1), config, timeout_s=240, **share)


def _pair(model: Path, shared: bool) -> tuple[TrainGroup, TrainGroup]:
    if not shared:
        return _group("actor", model), _group("critic", model)
    actor = _group("actor", model, publish_base=True)
    critic = _group("critic", model, base=actor.shared_base_handles())
    return actor, critic


def _step(actor: TrainGroup, critic: TrainGroup, step: int) -> tuple[dict[str, float], dict[str, float], Any]:
    """One PPO step with the roles taking turns: each sleeps while the other trains."""
    box = pack_fields(make_fields(8, seed=40 + step))
    actor.sleep()
    critic.wake_up()
    result = critic.train(step, [box])
    critic.sleep()
    actor.wake_up()
    assert result.values is not None
    actor_metrics = actor.train(step, [box], same_split(result.values, [8])).metrics
    return result.metrics, actor_metrics, unpack_fields(result.values[0])


def _compare(a: dict[str, float], b: dict[str, float]) -> None:
    for key in ("loss", "grad_norm", "values_mean", "reward_kl", "policy_loss", "approx_kl"):
        if key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


@pytest.fixture(scope="module")
def shared_pair(tiny_model: Path, ray_session: None) -> Iterator[tuple[TrainGroup, TrainGroup]]:
    """One sharing actor and critic (their start-up is most of a test's time): the page checks look
    at them first, untrained, then the training test trains them."""
    actor, critic = _pair(tiny_model, shared=True)
    yield actor, critic
    critic.shutdown()
    actor.shutdown()


@pytest.mark.timeout(300)
def test_the_critic_maps_the_actors_pages(shared_pair: tuple[TrainGroup, TrainGroup]) -> None:
    actor, critic = shared_pair
    (handle,) = actor.shared_base_handles()
    assert handle.path is not None
    assert os.path.exists(handle.path)
    (a,), (c,) = actor.shared_base_state(), critic.shared_base_state()
    # one file, one inode, the same bytes
    assert a["inode"] == c["inode"] == os.stat(handle.path).st_ino
    assert a["digest"] == c["digest"]
    # both read every page now (the digests): proportional set size splits them between the two
    (a,), (c,) = actor.shared_base_state(), critic.shared_base_state()
    assert a["base_rss"] == c["base_rss"] >= handle.nbytes
    assert a["base_pss"] == c["base_pss"] == pytest.approx(a["base_rss"] / 2, rel=0.05)
    # a byte written through a third mapping (this process) is read by both workers
    mine = SharedBase.attach(handle)
    original = int(mine.buffer[0])
    mine.buffer[0] = (original + 1) % 256
    changed = mine.digest()
    assert [s["digest"] for s in (*actor.shared_base_state(), *critic.shared_base_state())] == [changed] * 2
    mine.buffer[0] = original
    del mine
    # the critic tracks no base bytes: a sleep moves its adapters (17,408 bytes: 4,352 float32),
    # value head (33 float32) and rotary frequencies (32 float32) only
    (state,) = critic.memory_state()
    assert state["weights_bytes"] == 17_408 + 4 * 33 + 4 * 32
    actor.base_mapped()
    assert not os.path.exists(handle.path)  # the file goes, the mappings stay
    (c2,) = critic.shared_base_state()
    assert c2["inode"] == c["inode"]
    assert c2["digest"] == a["digest"]


@pytest.mark.timeout(600)
def test_shared_training_equals_unshared_and_leaves_the_base_alone(
    tiny_model: Path, shared_pair: tuple[TrainGroup, TrainGroup], tmp_path: Path
) -> None:
    results: dict[bool, list[Any]] = {}
    for shared in (False, True):
        actor, critic = shared_pair if shared else _pair(tiny_model, shared)
        try:
            if shared:
                actor.base_mapped()
                before = critic.shared_base_state()[0]["digest"]
            results[shared] = [_step(actor, critic, 1), _step(actor, critic, 2)]
            if shared:
                # after training and four sleep/wake cycles of each role: still mapped, bit-identical
                assert actor.shared_base_state()[0]["digest"] == before
                assert critic.shared_base_state()[0]["digest"] == before
                actor.sleep()
                critic.sleep()
                assert critic.shared_base_state()[0]["digest"] == before  # asleep: still resident
                critic.save_async(tmp_path / "critic")
                critic.save_wait()
                critic.wake_up()
                actor.wake_up()
                actor.save(tmp_path / "actor")
                results[shared].append(_step(actor, critic, 3))
                results[shared].append(actor.weights_checksum())
        finally:
            if not shared:  # the shared pair is the module's
                critic.shutdown()
                actor.shutdown()
    for (c0, a0, v0), (c1, a1, v1) in zip(results[False][:2], results[True][:2], strict=True):
        _compare(c0, c1)
        _compare(a0, a1)
        for x, y in zip(v0["values"], v1["values"], strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)

    # resume: fresh shared workers load the checkpoints and take step 3 bit for bit
    actor, critic = _pair(tiny_model, shared=True)
    try:
        actor.base_mapped()
        actor.load(tmp_path / "actor")
        critic.load(tmp_path / "critic")
        critic_metrics, actor_metrics, values = _step(actor, critic, 3)
        expected_critic, expected_actor, expected_values = results[True][2]
        assert _exact(critic_metrics) == _exact(expected_critic)
        assert _exact(actor_metrics) == _exact(expected_actor)
        for x, y in zip(values["values"], expected_values["values"], strict=True):
            assert torch.equal(x, y)
        assert actor.weights_checksum() == results[True][3]
    finally:
        critic.shutdown()
        actor.shutdown()


def _exact(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics computed from the weights (wall-clock figures differ from run to run)."""
    return {k: v for k, v in metrics.items() if not k.endswith(("_s", "seconds", "tflops", "peak_memory_gb"))}


# ---------------------------------------------------------------------- refusals (no Ray)
def test_share_base_true_needs_both_roles_in_lora() -> None:
    with pytest.raises(ValueError, match=r"train.lora.share_base=true .* lacks \['critic'\]"):
        LoraSettings(share_base=True, roles=("actor",))


def test_only_a_lora_actor_publishes_and_only_a_lora_critic_maps(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"the actor publishes the base .* this is the critic"):
        TorchTrainer(lora_config(tiny_model, "critic"), publish_base=True)
    owner = TorchTrainer(lora_config(tiny_model, "actor"), publish_base=True)
    try:
        actor_only = lora_config(tiny_model, "critic")
        actor_only = dataclasses.replace(
            actor_only, lora=dataclasses.replace(actor_only.lora, roles=("actor",))
        )
        with pytest.raises(
            ValueError, match=r"the critic maps the base .*roles=\('actor',\); set share_base"
        ):
            TorchTrainer(actor_only, base=owner.shared_base.handle if owner.shared_base else None)
    finally:
        if owner.shared_base is not None:
            owner.shared_base.unlink()


def test_the_memory_benchmark_agrees_on_a_tiny_model(tiny_model: Path) -> None:
    """``benchmarks/shared_base_memory.py`` on CPU (the GPU test runs it on CUDA): both modes score
    alike, the base stays bit-identical, and sharing saves about one base of proportional memory."""
    bench = load_benchmark("shared_base_memory")
    options = {
        "model": str(tiny_model),
        "device": "cpu",
        "dtype": "auto",
        "rank": 4,
        "kl_coef": 0.05,
        "tokens": 8,
        "threads": 1,
    }
    figures = {mode: bench.run_mode(mode == "shared", options, 200.0) for mode in bench.MODES}
    assert bench.check(figures) == []
    shared, unshared = figures["shared"], figures["unshared"]
    assert shared["critic"]["sleep_moves"] < unshared["critic"]["sleep_moves"]
    assert shared["actor"]["stays_resident"] == 86_656  # the tiny model's float32 base, 64-byte aligned


def test_a_sharing_critic_loads_beside_the_base_and_refuses_another_base(
    tiny_model: Path, tmp_path: Path
) -> None:
    """In one process (the same code as the workers'): a critic that maps the actor's base loads a
    policy checkpoint and a critic checkpoint without writing the base, and refuses a critic checkpoint
    of another base, naming the tensor and the fix."""
    from safetensors.torch import load_file, save_file

    from ppo_trainer.checkpoint import torch_io

    actor = TorchTrainer(lora_config(tiny_model, "actor"), publish_base=True)
    assert actor.shared_base is not None
    try:
        critic = TorchTrainer(lora_config(tiny_model, "critic"), base=actor.shared_base.handle)
        digest = actor.shared_base.digest()
        torch_io.save_shard(actor, tmp_path / "actor", step=1)
        torch_io.save_shard(critic, tmp_path / "critic", step=1)
        head = critic.model.value_head.weight.detach().clone()
        assert torch_io.load_shard(critic, tmp_path / "actor") is None  # a policy: the backbone only
        assert torch_io.load_shard(critic, tmp_path / "critic") == 1
        assert actor.shared_base.digest() == digest
        assert torch.equal(critic.model.value_head.weight, head)

        state = load_file(str(tmp_path / "critic" / "model.safetensors"))
        name = "backbone.layers.0.mlp.up_proj.weight"
        state[name] = state[name] + 1.0
        save_file(state, str(tmp_path / "critic" / "model.safetensors"))
        with pytest.raises(
            ValueError, match=rf"{name} differs from the actor's shared base.*share_base=false"
        ):
            torch_io.load_shard(critic, tmp_path / "critic")
        assert actor.shared_base.digest() == digest
    finally:
        actor.shared_base.unlink()
