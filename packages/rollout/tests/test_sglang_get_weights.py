"""The stand-in's /get_weights_by_name against SGLang v0.5.17's llama.py rules: fused q/k/v and gate/up,
a tied lm_head, rows cut by truncate_size, float32 lists, 400 for a name that is not a parameter."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ppo_rollout.testing.sglang_get_weights import FAILED, get_weights_by_name, sglang_params
from ppo_weight_sync.requests import ValidationError


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: k and v are narrower than q in the fused qkv_proj
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16)


def test_every_hf_name_reads_its_own_rows_of_the_fused_parameters(model: LlamaForCausalLM) -> None:
    held = dict(model.state_dict())
    params = sglang_params(held, tied=True)
    assert "model.layers.0.self_attn.qkv_proj.weight" in params
    assert "model.layers.0.mlp.gate_up_proj.weight" in params
    assert "model.layers.0.self_attn.q_proj.weight" not in params
    for name, tensor in held.items():
        status, body = get_weights_by_name(held, model.config, {"name": name, "truncate_size": len(tensor)})
        assert status == 200, name
        assert torch.equal(torch.tensor(body, dtype=torch.float32).to(torch.bfloat16), tensor), name


def test_tied_head_truncation_and_failures(model: LlamaForCausalLM) -> None:
    held = dict(model.state_dict())
    embed = held["model.embed_tokens.weight"].to(torch.float32)
    status, body = get_weights_by_name(held, model.config, {"name": "lm_head.weight", "truncate_size": 3})
    assert (status, body) == (200, embed.numpy().tolist()[:3])
    assert all(isinstance(v, float) for v in body[0])
    status, body = get_weights_by_name(held, model.config, {"name": "model.norm.weight"})
    assert status == 200
    assert len(body) == 32  # 1-D: its values; the default truncate_size (100) is more than it has
    status, body = get_weights_by_name(held, model.config, {"name": "model.norm.weight", "truncate_size": 5})
    assert len(body) == 5
    assert get_weights_by_name(held, model.config, {"name": "model.nothing.weight"}) == (
        400,
        {"error": {"message": FAILED}},
    )
    with pytest.raises(ValidationError, match=r"body\.name"):
        get_weights_by_name(held, model.config, {"truncate_size": 3})
