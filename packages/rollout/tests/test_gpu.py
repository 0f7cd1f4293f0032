"""GPU tests (skipped without CUDA): generation, memory release and an NCCL weight update on H200s."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ppo_rollout import BuiltinEngine, GenerationCore, SamplingConfig, make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

PROMPTS = [[1, 5, 6, 14], [1, 7, 8, 9, 10, 14], [1, 4]]


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 115M parameters (460 MB in float32): big enough to see memory come and go."""
    return make_tiny_model(
        "copy",
        tmp_path_factory.mktemp("medium") / "model",
        seed=0,
        hidden_size=1024,
        num_layers=8,
        num_heads=16,
        intermediate_size=2816,
        max_positions=256,
    )


def test_cuda_generation_is_seeded_and_log_probs_match_a_forward(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, device="cuda")
    s = SamplingConfig(temperature=0.9, max_new_tokens=12, n_samples_per_prompt=2, seed=5)
    a = core.generate(PROMPTS, s)
    assert a == core.generate(PROMPTS, s)
    for k, out in enumerate(a):
        prompt = PROMPTS[k // 2]
        full = torch.tensor([prompt + list(out.token_ids)], device="cuda")
        with torch.no_grad():
            logp = torch.log_softmax(core.model(full).logits[0].float() / 0.9, -1)
        ref = [logp[len(prompt) - 1 + j, t].item() for j, t in enumerate(out.token_ids)]
        assert out.log_probs == pytest.approx(ref, abs=1e-4)


def test_release_frees_gpu_memory_and_resume_restores_it(medium_model: Path) -> None:
    engine = BuiltinEngine(medium_model, device="cuda")
    s = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, s)
    digest = engine.weights_checksum()
    model_bytes = sum(t.numel() * t.element_size() for _, t in engine._core.named_tensors())
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    assert engine.release_memory_occupation()["success"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free1 = torch.cuda.mem_get_info()[0]
    print(f"\nreleased {(free1 - free0) / 2**20:.0f} MiB of {model_bytes / 2**20:.0f} MiB of weights")
    assert free1 - free0 >= 0.8 * model_bytes
    assert engine.resume_memory_occupation()["success"]
    assert engine.weights_checksum() == digest
    assert engine.generate(PROMPTS, s) == before


@pytest.fixture(scope="module")
def ray_gpus() -> Iterator[None]:
    import ray

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ray.init(num_cpus=4, num_gpus=2, object_store_memory=256 * 1024**2, include_dashboard=False)
    yield
    ray.shutdown()


def test_nccl_weight_update_into_an_engine_actor(ray_gpus: None, tiny_model: Path, tmp_path: Path) -> None:
    import ray
    from transformers import AutoModelForCausalLM

    from ppo_rollout import BuiltinEngineActor
    from ppo_weight_sync import RayEngineEndpoint, WeightSender, checksum

    actor = BuiltinEngineActor.options(max_concurrency=4, num_gpus=1).remote(
        str(tiny_model), "cuda", name="gpu-engine"
    )
    info = ray.get(actor.info.remote(), timeout=120)
    engine_gpu = int(str(info["visible_devices"]).split(",")[0])
    torch.cuda.set_device(1 - engine_gpu)  # the trainer side on the other GPU
    other = make_tiny_model("copy", tmp_path / "other", seed=3)
    named = [(n, t.cuda()) for n, t in AutoModelForCausalLM.from_pretrained(other).state_dict().items()]
    s = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = ray.get(actor.generate.remote(PROMPTS, s), timeout=60)
    sender = WeightSender(backend="nccl", master_address="127.0.0.1", timeout_s=60.0)
    sender.connect([RayEngineEndpoint(actor, num_gpus=1, name="gpu-engine")])
    try:
        sender.update(named, version="gpu-1")
    finally:
        sender.disconnect()
    assert ray.get(actor.get_weight_version.remote(), timeout=30) == "gpu-1"
    assert ray.get(actor.weights_checksum.remote(), timeout=30) == checksum(named)
    after = ray.get(actor.generate.remote(PROMPTS, s), timeout=60)
    assert after != before
    assert after == GenerationCore(other, device="cuda").generate(PROMPTS, s)
    ray.kill(actor)
