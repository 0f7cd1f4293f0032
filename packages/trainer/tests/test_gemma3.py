"""Gemma 3 (``gemma3_text``) on the torch backend: the critic's backbone and value head, LoRA on its
seven linear layers a decoder layer (not its q/k norms), the merged export under transformers' names,
and the megatron backend's one-line refusal."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, lora_config
from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.converters import lora
from ppo_trainer.megatron_convert import SUPPORTED_ARCHITECTURES, ModelShape
from ppo_trainer.models import load_critic

LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gemma3")
    Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


def test_the_critic_is_gemma3s_backbone_with_a_value_head(gemma3: Path) -> None:
    critic = load_critic(gemma3, seed=0)
    assert type(critic.backbone).__name__ == "Gemma3TextModel"
    tokens = torch.tensor([[2, 5, 6, 7, 8, 9, 10]])
    values = critic(tokens)
    assert values.shape == (1, 7)
    assert torch.isfinite(values).all()
    # The backbone's weights are the policy's (embedding, norms, layers).
    policy = AutoModelForCausalLM.from_pretrained(gemma3)
    assert torch.equal(critic.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)


def test_lora_adapts_gemma3s_linear_layers_and_exports_merged_weights(
    gemma3: Path, fields_factory: Callable
) -> None:
    t = TorchTrainer(lora_config(gemma3, micro_batch_size=4))
    adapted = sorted(p for p, _ in lora.lora_modules(t.model))
    assert adapted == sorted(
        f"model.layers.{i}.{'mlp' if n in ('down_proj', 'gate_proj', 'up_proj') else 'self_attn'}.{n}"
        for i in (0, 1)
        for n in LINEAR
    )
    samples = Samples.from_fields(fields_factory(8, seed=3))
    t.train_actor(samples, torch.zeros(len(samples), samples.max_response))
    assert any(m.lora_B.weight.abs().sum() > 0 for _, m in lora.lora_modules(t.model))
    merged = AutoModelForCausalLM.from_pretrained(gemma3).float().eval()
    exported = dict(t.named_weights())
    assert set(exported) <= set(merged.state_dict())  # transformers' names, no adapter tensor
    merged.load_state_dict(exported, strict=False)
    t.model.eval()
    with torch.no_grad():
        for tokens in samples.tokens[:2]:
            ours = t.model(input_ids=tokens[None]).logits
            theirs = merged(input_ids=tokens[None]).logits
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_critic_trains_on_gemma3(gemma3: Path, fields_factory: Callable) -> None:
    t = TorchTrainer(lora_config(gemma3, role="critic", micro_batch_size=4, lora=None))
    samples = Samples.from_fields(fields_factory(8, seed=4))
    before = t.model.value_head.weight.detach().clone()
    t.train_critic(samples)
    assert not torch.equal(t.model.value_head.weight, before)


def test_the_megatron_backend_refuses_gemma3_in_one_line(gemma3: Path) -> None:
    assert "Gemma3ForCausalLM" not in SUPPORTED_ARCHITECTURES
    config = AutoModelForCausalLM.from_pretrained(gemma3).config
    with pytest.raises(
        ValueError, match=r"^model_type 'gemma3_text' \(Gemma 3\) is not supported by the megatron"
    ):
        ModelShape.from_hf_config(config)
