"""Shared fixtures: a tiny Hugging Face Llama saved to disk, training batches in the interface format,
and one local Ray instance for the worker tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ppo_testsupport import skip_gpu_tests_without_cuda

torch.set_num_threads(1)
# Under `uv run`, Ray would package the working tree and start every worker through uv (minutes here);
# the workers use this interpreter's environment instead.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

VOCAB = 16

Fields = dict[str, list[torch.Tensor]]


pytest_collection_modifyitems = skip_gpu_tests_without_cuda(
    "needs CUDA (run benchmarks/gpu.sh on a GPU machine)"
)


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` loaded as the module ``name`` (the benchmarks folder on ``sys.path``,
    where processes it spawns find it too)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class body runs.
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def gpu_workers_script() -> ModuleType:
    """``benchmarks/gpu_workers.py`` loaded as a module (the GPU test and its CPU twin drive it)."""
    return load_benchmark("gpu_workers")


def save_tiny_llama(
    folder: Path, seed: int = 0, tie_word_embeddings: bool = False, vocab_size: int = VOCAB
) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def make_fields(
    n: int,
    seed: int,
    samples_per_prompt: int = 2,
    *,
    vocab: int = VOCAB,
    prompt_tokens: tuple[int, int] = (3, 5),
    response_tokens: tuple[int, int] = (1, 6),
) -> Fields:
    """``n`` samples with prompts of 3-5 tokens and responses of 1-6 (or the ranges given, inclusive);
    reward 1 when the first response token is even, so that the reward depends on what the policy
    generated (0 without one)."""
    g = torch.Generator().manual_seed(seed)
    fields: Fields = {
        k: []
        for k in ("tokens", "response_length", "loss_mask", "reward", "rollout_log_probs", "prompt_index")
    }
    for i in range(n):
        prompt = int(torch.randint(prompt_tokens[0], prompt_tokens[1] + 1, (1,), generator=g))
        response = int(torch.randint(response_tokens[0], response_tokens[1] + 1, (1,), generator=g))
        tokens = torch.randint(0, vocab, (prompt + response,), generator=g)
        mask = torch.ones(response)
        if response > 3:
            mask[1] = 0.0  # a masked-out token in the middle (e.g. a tool output)
        fields["tokens"].append(tokens)
        fields["response_length"].append(torch.tensor([response]))
        fields["loss_mask"].append(mask)
        first = int(tokens[prompt]) if response else 1
        fields["reward"].append(torch.tensor([float(first % 2 == 0)]))
        fields["rollout_log_probs"].append(-torch.rand(response, generator=g) - 2.0)
        fields["prompt_index"].append(torch.tensor([i // samples_per_prompt]))
    return fields


@pytest.fixture
def fields_factory() -> Callable[..., Fields]:
    return make_fields


@pytest.fixture
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    """A 1-rank gloo default group in this process (FSDP2 needs one even without peers)."""
    from ppo_weight_sync.group import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    ray.init(
        num_cpus=4,
        num_gpus=torch.cuda.device_count(),
        object_store_memory=256 * 1024**2,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


def critic_pieces(fields_per_rank: list[Fields], values_per_rank: list[list[torch.Tensor]]) -> list[Any]:
    """What the critic hands each actor rank, made by hand: its values and the outcome rewards as
    token rewards (no KL), one payload per rank holding that rank's samples in order."""
    from ppo_trainer import ppo_math as pm
    from ppo_trainer.batch import Samples
    from ppo_value_transport import pack_fields, pair_values

    boxes, ids, start = [], [], 0
    for fields, values in zip(fields_per_rank, values_per_rank, strict=True):
        samples = Samples.from_fields(fields)
        rewards = samples.unpad(pm.token_rewards(samples.reward, samples.loss_mask))
        boxes.append(pack_fields({"values": list(values), "token_rewards": rewards}))
        ids.append(list(range(start, start + len(values))))
        start += len(values)
    return pair_values(boxes, ids, ids)


def same_split(boxes: list[Any], counts: list[int]) -> list[Any]:
    """The critic's per-rank payloads to an actor that holds the same samples on the same ranks."""
    from ppo_value_transport import pair_values

    ids, start = [], 0
    for n in counts:
        ids.append(list(range(start, start + n)))
        start += n
    return pair_values(boxes, ids, ids)


def lora_config(model: Path, role: str = "actor", **overrides: Any) -> Any:
    """A ``TrainerConfig`` with ``train.lora`` (rank 4, alpha 8) at a learning rate of 1e-2 for both roles;
    ``overrides``: any other setting (``lora``, ``algorithm``, ``micro_batch_size``, ...)."""
    from ppo_trainer.config import AlgorithmConfig, LoraSettings, TrainerConfig

    settings: dict[str, Any] = {
        "algorithm": AlgorithmConfig(lam=1.0, num_mini_batches=1),
        "actor_lr": 1e-2,
        "critic_lr": 1e-2,
        "lora": LoraSettings(rank=4, alpha=8.0),
    }
    return TrainerConfig(role=role, model_path=str(model), **{**settings, **overrides})  # type: ignore[arg-type]
