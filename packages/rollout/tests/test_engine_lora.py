"""Adapter-only weight updates to the built-in engine (``lora``): each adapter update sets the weight to
``merge_lora(base, A, B, alpha / rank)`` from the base the engine keeps, never onto its previous merge;
the base copies survive a release and resume of the weights; a whole weight replaces its base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_rollout.config import AdapterUpdates
from ppo_rollout.engine.builtin import BuiltinEngine
from ppo_weight_sync.lora import merge_lora

LAYER = "model.layers.0.self_attn.q_proj"


def _adapters(weight: torch.Tensor, rank: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rank, weight.shape[1], generator=g)
    b = torch.randn(weight.shape[0], rank, generator=g)
    return [(f"{LAYER}.lora_A.weight", a), (f"{LAYER}.lora_B.weight", b)]


def _held(engine: BuiltinEngine, name: str) -> torch.Tensor:
    return dict(engine.named_tensors())[name]


@pytest.mark.timeout(120)
def test_adapter_updates_merge_from_the_base_across_release_and_resume(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model, lora=AdapterUpdates(rank=2, alpha=4.0), torch_threads=1)
    base = _held(engine, f"{LAYER}.weight")
    expected = engine._expected()
    assert expected[f"{LAYER}.lora_A.weight"] == (torch.float32, (2, base.shape[1]))
    assert expected[f"{LAYER}.lora_B.weight"] == (torch.float32, (base.shape[0], 2))
    for seed in (1, 2):  # the second merge starts from the base again, not from the first merge
        adapters = _adapters(base, 2, seed)
        engine._load_weights(adapters)
        merged = merge_lora(base, adapters[0][1], adapters[1][1], 2.0)
        assert torch.equal(_held(engine, f"{LAYER}.weight"), merged)
    before = engine.weights_checksum()
    assert engine.release_memory_occupation(tags=["weights"]).success
    assert engine.resume_memory_occupation(tags=["weights"]).success
    assert engine.weights_checksum() == before
    adapters = _adapters(base, 2, 3)
    engine._load_weights(adapters)
    assert torch.equal(
        _held(engine, f"{LAYER}.weight"), merge_lora(base, adapters[0][1], adapters[1][1], 2.0)
    )
    # a whole weight is the base the next merge starts from
    new_base = torch.full_like(base, 0.5)
    engine._load_weights([(f"{LAYER}.weight", new_base)])
    assert torch.equal(_held(engine, f"{LAYER}.weight"), new_base)
    engine._load_weights(adapters)
    assert torch.equal(
        _held(engine, f"{LAYER}.weight"), merge_lora(new_base, adapters[0][1], adapters[1][1], 2.0)
    )
    with pytest.raises(ValueError, match=r"lora_A and lora_B come together.*q_proj"):
        engine._load_weights(adapters[:1])


def test_an_engine_without_lora_takes_no_adapter_tensor(tiny_model: Path) -> None:
    engine = BuiltinEngine(tiny_model, torch_threads=1)
    assert not [n for n in engine._expected() if "lora_" in n]
