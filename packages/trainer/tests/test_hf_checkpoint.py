"""Checkpoints in Hugging Face names through the backend interface (``megatron_checkpoint``), against
the torch backend's own (``checkpoint``): either loads the other's files, so a run resumes on either
backend. Run here on the torch backend (CPU): the megatron backend writes the same files through the
same two methods (``hf_state_dict`` / ``load_hf_state_dict``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_fields, save_tiny_llama

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.checkpoint import megatron_io, torch_io
from ppo_trainer.config import AlgorithmConfig, TrainerConfig


def _trainer(model: Path, role: str = "actor") -> TorchTrainer:
    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        algorithm=AlgorithmConfig(num_mini_batches=1),
        micro_batch_size=4,
        actor_lr=1e-2,
    )
    return TorchTrainer(config)


def _trained(model: Path) -> TorchTrainer:
    trainer = _trainer(model)
    samples = Samples.from_fields(make_fields(8, seed=3))
    trainer.train_actor(samples, torch.zeros_like(samples.response_mask))
    return trainer


def _weights(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_named_checkpoint_loads_into_the_torch_backend_and_back(tmp_path: Path, tied: bool) -> None:
    model = save_tiny_llama(tmp_path / "model", tie_word_embeddings=tied)
    source = _trained(model)
    expected = _weights(source)
    assert not torch.equal(expected["model.norm.weight"], _weights(_trainer(model))["model.norm.weight"])

    # Written through the backend interface, read by the torch backend's checkpoint code.
    megatron_io.save_shard(source, tmp_path / "a" / "actor", step=7)
    resumed = _trainer(model)
    assert torch_io.load_shard(resumed, tmp_path / "a" / "actor") == 7
    for name, tensor in _weights(resumed).items():
        assert torch.equal(tensor, expected[name]), name
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "actor" / "hf")
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, expected[name]), name

    # Written by the torch backend's checkpoint code, read through the backend interface.
    torch_io.save_shard(source, tmp_path / "b" / "actor", step=9)
    again = _trainer(model)
    assert megatron_io.load_shard(again, tmp_path / "b" / "actor") == 9
    for name, tensor in _weights(again).items():
        assert torch.equal(tensor, expected[name]), name


def test_policy_checkpoint_into_a_critic(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    source = _trained(model)
    megatron_io.save_shard(source, tmp_path / "actor", step=4)
    critic = _trainer(model, "critic")
    head = critic.model.state_dict()["value_head.weight"].clone()
    assert megatron_io.load_shard(critic, tmp_path / "actor") is None  # a fresh start
    state = critic.model.state_dict()
    assert torch.equal(state["backbone.norm.weight"], source.model.state_dict()["model.norm.weight"])
    assert torch.equal(state["value_head.weight"], head)
    megatron_io.save_shard(critic, tmp_path / "critic", step=4)
    with pytest.raises(ValueError, match="holds a critic checkpoint; it cannot be loaded into the actor"):
        megatron_io.load_shard(_trainer(model), tmp_path / "critic")
