"""GPU tests (skipped without CUDA): generation, memory release and an NCCL weight update on H200s."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_rollout.engine.core import GenerationCore, GenerationOutput
from ppo_rollout.tasks import make_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]

PROMPTS = [[1, 5, 6, 14], [1, 7, 8, 9, 10, 14], [1, 4]]
_T0 = time.monotonic()


def _stage(message: str) -> None:
    """Progress on stdout (run with -s): a hang shows which stage it stopped in."""
    print(f"[{time.monotonic() - _T0:6.1f} s] {message}", flush=True)


def _same_outputs(a: list[GenerationOutput], b: list[GenerationOutput]) -> None:
    """Identical tokens and finish reasons; log-probs equal up to kernel choice on another device."""
    assert [(o.prompt_position, o.token_ids, o.finish_reason) for o in a] == [
        (o.prompt_position, o.token_ids, o.finish_reason) for o in b
    ]
    for x, y in zip(a, b, strict=True):
        assert x.log_probs == pytest.approx(y.log_probs, abs=1e-5)


@pytest.fixture(scope="module")
def medium_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 42M parameters (162 MiB in float32, 57 tensors): enough to see memory come and go."""
    _stage("building the medium model on the CPU")
    path = make_tiny_model(
        "copy",
        tmp_path_factory.mktemp("medium") / "model",
        seed=0,
        hidden_size=768,
        num_layers=6,
        num_heads=12,
        intermediate_size=2048,
        max_positions=256,
    )
    _stage("medium model written")
    return path


def test_cuda_generation_is_seeded_and_log_probs_match_a_forward(tiny_model: Path) -> None:
    _stage("generation test: loading the tiny model")
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
    _stage("generation test: done")


def test_release_frees_gpu_memory_and_resume_restores_it(medium_model: Path) -> None:
    _stage("release test: loading the engine")
    engine = BuiltinEngine(medium_model, device="cuda")
    s = SamplingConfig(temperature=0.0, max_new_tokens=8)
    _stage("release test: generating")
    before = engine.generate(PROMPTS, s)
    # Host copies to compare with after the round trip (they take no device memory). The sha256
    # weights_checksum is exercised on the tiny model below; over 160 MiB it is a CPU benchmark.
    _stage("release test: copying the weights to the host")
    weights = engine.named_tensors()
    model_bytes = sum(t.numel() * t.element_size() for _, t in weights)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    _stage("release test: releasing")
    reply = engine.release_memory_occupation(tags=None)
    assert reply.success, reply
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free1 = torch.cuda.mem_get_info()[0]
    print(
        f"released {(free1 - free0) / 2**20:.0f} MiB of {model_bytes / 2**20:.0f} MiB of weights "
        f"({reply.message})",
        flush=True,
    )
    assert free1 - free0 >= 0.8 * model_bytes
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(PROMPTS, s)
    _stage("release test: resuming")
    reply = engine.resume_memory_occupation(tags=None)
    assert reply.success, reply
    print(f"resumed ({reply.message})", flush=True)
    _stage("release test: comparing weights and generations")
    after = engine.named_tensors()
    assert [n for n, _ in after] == [n for n, _ in weights]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(after, weights, strict=True))
    assert engine.generate(PROMPTS, s) == before
    _stage("release test: done")


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

    from ppo_rollout.engine.builtin import BuiltinEngineActor
    from ppo_weight_sync import RayEngineEndpoint, WeightSender, checksum

    _stage("nccl test: starting the engine actor")
    actor = BuiltinEngineActor.options(max_concurrency=4, num_gpus=1).remote(
        str(tiny_model), "cuda", name="gpu-engine"
    )
    try:
        info = ray.get(actor.info.remote(), timeout=120)
        _stage(f"nccl test: engine actor up on {info['device']}, visible GPUs {info['visible_devices']}")
        engine_gpu = int(str(info["visible_devices"]).split(",")[0])
        trainer_gpu = 1 - engine_gpu  # the trainer side on the other GPU
        torch.cuda.set_device(trainer_gpu)
        other = make_tiny_model("copy", tmp_path / "other", seed=3)
        named = [
            (n, t.to(f"cuda:{trainer_gpu}"))
            for n, t in AutoModelForCausalLM.from_pretrained(other).state_dict().items()
        ]
        s = SamplingConfig(temperature=0.0, max_new_tokens=8)
        before = ray.get(actor.generate.remote(PROMPTS, s), timeout=60)
        _stage("nccl test: connecting the sender")
        sender = WeightSender(backend="nccl", master_address="127.0.0.1", timeout_s=60.0)
        sender.connect([RayEngineEndpoint(actor, num_gpus=1, name="gpu-engine")])
        try:
            _stage("nccl test: sending the weights")
            sender.update(named, version="gpu-1")
        finally:
            _stage("nccl test: disconnecting")
            sender.disconnect()
        assert ray.get(actor.get_weight_version.remote(), timeout=30) == "gpu-1"
        _stage("nccl test: checksums")
        assert ray.get(actor.weights_checksum.remote(), timeout=60) == checksum(named)
        after = ray.get(actor.generate.remote(PROMPTS, s), timeout=60)
        assert after != before
        _same_outputs(after, GenerationCore(other, device=f"cuda:{trainer_gpu}").generate(PROMPTS, s))
        _stage("nccl test: done")
    finally:
        ray.kill(actor)


def test_cuda_graph_decode_greedy_equals_transformers_generate(medium_model: Path) -> None:
    """float32, ragged prompts in a padded batch bucket: greedy tokens equal generate's token for token
    (eos on: a sample ends with it, generate pads after it); sampled tokens equal the decode loop's for
    the same seed; a second call replays the kept graphs; releasing the KV cache drops them."""
    _stage("graph decode test: loading")
    core = GenerationCore(medium_model, device="cuda")
    loop = GenerationCore(medium_model, device="cuda", decode="loop")
    prompts = [[1, *range(4, 4 + k)] for k in (3, 9, 1, 14, 6)]
    n, new = 3, 40  # 15 rows: a 16-row bucket with one padding row
    outs = core.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=new, n_samples_per_prompt=n))
    assert core.last_decode_path == "cuda-graphs", core.graph_failure
    rows = [p for p in prompts for _ in range(n)]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    with torch.no_grad():
        ref = core.model.generate(
            input_ids=ids.cuda(),
            attention_mask=mask.cuda(),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=core.pad_token_id,
            eos_token_id=list(core.eos_token_ids),
        )[:, width:].tolist()
    for out, r in zip(outs, ref, strict=True):
        assert list(out.token_ids) == r[: len(out.token_ids)]
        if out.finish_reason == "length":
            assert len(out.token_ids) == new
        else:
            assert out.token_ids[-1] in core.eos_token_ids
    _stage("graph decode test: sampling against the decode loop")
    captured = core._graphs.captures if core._graphs is not None else 0
    for s in (
        SamplingConfig(temperature=1.0, max_new_tokens=new, n_samples_per_prompt=n, seed=11),
        SamplingConfig(
            temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=new, n_samples_per_prompt=n, seed=12
        ),
    ):
        _same_outputs(core.generate(prompts, s), loop.generate(prompts, s))
    again = core.generate(
        prompts, SamplingConfig(temperature=1.0, max_new_tokens=new, n_samples_per_prompt=n, seed=11)
    )
    assert core._graphs is not None
    assert core._graphs.captures == captured + 2  # the second sampling mode only; the repeat replays
    assert again == core.generate(
        prompts, SamplingConfig(temperature=1.0, max_new_tokens=new, n_samples_per_prompt=n, seed=11)
    )
    _stage("graph decode test: done")


def test_engine_release_drops_the_kept_kv_cache(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model, device="cuda")
    s = SamplingConfig(temperature=0.0, max_new_tokens=8)
    before = engine.generate(PROMPTS, s)
    graphs = engine._core._graphs
    assert graphs is not None
    assert graphs.buffers is not None
    assert engine.release_memory_occupation(tags=["kv_cache"]).success
    assert graphs.buffers is None
    assert engine.resume_memory_occupation(tags=["kv_cache"]).success
    assert engine.generate(PROMPTS, s) == before
