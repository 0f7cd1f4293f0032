"""``train.critic_init_from``: the critic starts from a value model saved in a folder (a Hugging Face
value model with a ``score``, ``v_head.summary`` or ``value_head`` head, or a run's critic checkpoint),
and gives that model's values on the same input; a mismatch is one line naming the setting, the tensor
and both shapes; a resume loads its checkpoint over the source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, save_tiny_llama
from safetensors.torch import save_file
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from ppo_trainer import critic_init
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.checkpoint import torch_io
from ppo_trainer.config import AlgorithmConfig, TrainerConfig

TOKENS = torch.tensor([[1, 5, 3, 9, 2, 7], [4, 4, 11, 0, 6, 8]])


def _config(**changes: object) -> LlamaConfig:
    """conftest's tiny Llama (``save_tiny_llama``), with ``changes``."""
    settings: dict[str, object] = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return LlamaConfig(**(settings | changes))


def _critic(model: Path, init_from: Path | None) -> TorchTrainer:
    config = TrainerConfig(
        role="critic",
        model_path=str(model),
        algorithm=AlgorithmConfig(num_mini_batches=1),
        micro_batch_size=4,
        critic_init_from=None if init_from is None else str(init_from),
    )
    return TorchTrainer(config)


@torch.no_grad()
def _values(trainer: TorchTrainer) -> torch.Tensor:
    trainer.model.eval()
    return trainer.model(TOKENS)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return save_tiny_llama(tmp_path / "policy", seed=0)


def test_a_token_classification_value_model(tmp_path: Path, model: Path) -> None:
    torch.manual_seed(5)
    source = LlamaForTokenClassification(_config(num_labels=1)).eval()
    source.save_pretrained(tmp_path / "value")
    critic = _critic(model, tmp_path / "value")
    with torch.no_grad():
        expected = source(TOKENS).logits.squeeze(-1)
    torch.testing.assert_close(_values(critic), expected, rtol=0, atol=1e-6)
    # A different value model than the critic model.path alone gives.
    assert not torch.allclose(_values(_critic(model, None)), expected)


def test_a_sequence_classification_reward_model(tmp_path: Path, model: Path) -> None:
    # LlamaForSequenceClassification's score has no bias: the critic's stays zero.
    torch.manual_seed(6)
    source = LlamaForSequenceClassification(_config(num_labels=1, pad_token_id=0)).eval()
    source.save_pretrained(tmp_path / "reward")
    critic = _critic(model, tmp_path / "reward")
    values = _values(critic)
    rows = TOKENS[:1]  # no padding token: the pooled logit is the last position's
    with torch.no_grad():
        pooled = source(rows).logits.squeeze(-1)
        hidden = source.model(TOKENS).last_hidden_state
    torch.testing.assert_close(values[:1, -1], pooled, rtol=0, atol=1e-6)
    torch.testing.assert_close(values, source.score(hidden).squeeze(-1), rtol=0, atol=1e-6)
    assert torch.count_nonzero(critic.model.value_head.bias) == 0


def test_a_trl_value_head_saved_over_a_causal_lm(tmp_path: Path, model: Path) -> None:
    """TRL's ``AutoModelForCausalLMWithValueHead.state_dict()``: the causal LM's tensors (its LM head
    too) and ``v_head.summary.{weight,bias}``, in the Hugging Face folder of the causal LM."""
    torch.manual_seed(7)
    lm = LlamaForCausalLM(_config()).eval()
    head = torch.nn.Linear(32, 1)
    lm.save_pretrained(tmp_path / "trl")
    state = {k: v.contiguous() for k, v in lm.state_dict().items()}
    state |= {"v_head.summary.weight": head.weight.detach(), "v_head.summary.bias": head.bias.detach()}
    save_file(state, str(tmp_path / "trl" / "model.safetensors"))
    critic = _critic(model, tmp_path / "trl")
    with torch.no_grad():
        expected = head(lm.model(TOKENS).last_hidden_state).squeeze(-1)
    torch.testing.assert_close(_values(critic), expected, rtol=0, atol=1e-6)


def test_a_runs_critic_checkpoint_and_resume_over_it(tmp_path: Path, model: Path) -> None:
    """A critic checkpoint (the checkpoint folder or its critic/) initialises a critic of another run;
    a resumed critic then loads its own checkpoint, which wins over the source."""
    trained = _critic(model, None)
    with torch.no_grad():
        for p in trained.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    torch_io.save_shard(trained, tmp_path / "step_000003" / "critic", step=3)
    for given in (tmp_path / "step_000003", tmp_path / "step_000003" / "critic"):
        torch.testing.assert_close(_values(_critic(model, given)), _values(trained), rtol=0, atol=0)

    torch.manual_seed(8)
    LlamaForTokenClassification(_config(num_labels=1)).save_pretrained(tmp_path / "value")
    resumed = _critic(model, tmp_path / "value")
    assert not torch.allclose(_values(resumed), _values(trained))
    assert torch_io.load_shard(resumed, tmp_path / "step_000003" / "critic") == 3
    torch.testing.assert_close(_values(resumed), _values(trained), rtol=0, atol=0)


def test_mismatches_are_one_line_naming_the_setting_the_tensor_and_both_shapes(
    tmp_path: Path, model: Path
) -> None:
    LlamaForTokenClassification(_config(num_labels=2)).save_pretrained(tmp_path / "two")
    expected = (
        "train.critic_init_from='{}': tensor 'score.weight' has shape (2, 32) but the critic's "
        "'value_head.weight' has (1, 32); give a value model of model.path's architecture with one output"
    ).format(tmp_path / "two")
    assert critic_init.problem(tmp_path / "two", _config()) == expected
    with pytest.raises(ValueError) as raised:
        _critic(model, tmp_path / "two")
    assert str(raised.value) == expected

    LlamaForTokenClassification(_config(num_labels=1, intermediate_size=48)).save_pretrained(tmp_path / "w")
    found = critic_init.problem(tmp_path / "w", _config())
    assert found is not None
    assert "tensor 'model.layers.0.mlp.gate_proj.weight' has shape (48, 32) but the critic's " in found
    assert "'backbone.layers.0.mlp.gate_proj.weight' has (64, 32)" in found


def test_sources_that_are_not_value_models(tmp_path: Path, model: Path) -> None:
    def problem(folder: Path) -> str:
        found = critic_init.problem(folder, _config())
        assert found is not None
        assert "\n" not in found
        assert found.startswith(f"train.critic_init_from='{folder}': ")
        return found

    assert "has no value head (score.*, v_head.summary.*, value_head.*)" in problem(model)
    assert "is not a folder" in problem(tmp_path / "nowhere")
    (tmp_path / "ckpts" / "step_000002").mkdir(parents=True)
    assert "is a checkpoints folder; give one of its checkpoints" in problem(tmp_path / "ckpts")
    actor = TorchTrainer(TrainerConfig(role="actor", model_path=str(model)))
    torch_io.save_shard(actor, tmp_path / "actor", step=1)
    assert "holds the actor's checkpoint; give the critic's" in problem(tmp_path / "actor")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    (bin_only / "config.json").write_text(json.dumps(_config().to_dict()))
    assert "has no model.safetensors" in problem(bin_only)
    (bin_only / "model.safetensors").write_bytes(b"\x05")
    assert "model.safetensors has no readable safetensors header" in problem(bin_only)


def test_settings_the_source_cannot_go_with() -> None:
    from pydantic import ValidationError

    from ppo_trainer.config import LoraSettings, TrainSettings

    with pytest.raises(ValidationError, match=r"train.critic_init_from is a torch-backend option"):
        TrainSettings(backend="megatron", critic_init_from="/x")
    with pytest.raises(ValidationError, match=r"train.lora.share_base=true gives the critic the actor's"):
        TrainSettings(lora=LoraSettings(share_base=True), critic_init_from="/x")
