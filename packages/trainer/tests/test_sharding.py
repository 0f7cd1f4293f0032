"""FSDP2 across a sleep and a wake: two processes over gloo (and NCCL on a 2-GPU machine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ppo_testsupport import run_ranks

WORKER = Path(__file__).with_name("_fsdp_worker.py")


def fsdp_ranks(tmp_path: Path, backend: str, world: int = 2) -> list[dict]:
    run_ranks(WORKER, world, lambda r: [tmp_path / f"{r}.json", backend], timeout_s=240)
    return [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]


def check_records(records: list[dict]) -> None:
    for rec in records:
        # FSDP still holds the destroyed group until told; after the rebind it runs on the new one.
        assert rec["stale_before_rebind"] is True
        assert rec["rebound"] >= 3  # two decoder layers and the root
        assert rec["live_after_rebind"] is True
        assert "not the one the model was sharded over" in rec["wrong_group_error"]
        # The shards the memory backend moves are views of the parameters' storage, half of them each.
        assert rec["local_share_storage"] is True
        assert rec["local_numel"] * 2 >= rec["full_numel"] > rec["local_numel"]
        assert all(n > 0 for n in rec["norms"])
    # Both ranks took the same steps and gathered the same weights.
    assert records[0]["norms"] == pytest.approx(records[1]["norms"])
    assert records[0]["weights_sum"] == records[1]["weights_sum"]


@pytest.mark.timeout(300)
def test_fsdp_runs_on_the_rebuilt_group_after_sleep_and_wake(tmp_path: Path) -> None:
    check_records(fsdp_ranks(tmp_path, "gloo"))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_fsdp_on_nccl_survives_sleep_and_wake(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_records(fsdp_ranks(tmp_path, "nccl"))


def test_decoder_blocks_are_the_decoder_layers_of_policy_and_critic() -> None:
    """What FSDP2 shards one by one (and the throughput benchmark compiles): each decoder layer, in the
    causal LM and in the critic that wraps its backbone; never the model itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ppo_trainer.models import CriticModel
    from ppo_trainer.sharding import decoder_blocks

    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=50
    )
    policy = LlamaForCausalLM(config)
    assert decoder_blocks(policy) == list(policy.model.layers)
    critic = CriticModel(policy.model, seed=1)
    assert decoder_blocks(critic) == list(policy.model.layers)
    assert decoder_blocks(torch.nn.Linear(2, 2)) == []
