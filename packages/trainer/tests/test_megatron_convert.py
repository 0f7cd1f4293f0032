"""Hugging Face <-> megatron GPTModel conversion on plain tensors (CPU; megatron is never imported).

Round trips are checked bit for bit on real transformers state dicts (Llama and Qwen2, GQA and MHA,
tied and untied embeddings, TP 1/2/4); the layouts are checked by what megatron computes with them:
the grouped QKV split of its attention, the gated unit of its MLP on each TP rank, the partial sums
of its row-parallel layers.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer.megatron_convert import (
    ModelShape,
    fuse_qkv,
    gather_from_tp,
    hf_names,
    hf_to_megatron,
    megatron_names,
    megatron_to_hf,
    parallel_kind,
    split_for_tp,
    split_qkv,
)


def _hf_model(
    arch: str, heads: int, kv_heads: int, tied: bool, vocab: int = 30, layers: int = 2
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs: dict[str, Any] = {
        "hidden_size": 8 * heads,
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 32,
        "tie_word_embeddings": tied,
    }
    torch.manual_seed(0)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kwargs))
    return Qwen2ForCausalLM(Qwen2Config(**kwargs))


CASES = [
    # arch, heads, kv heads, tied
    ("llama", 4, 4, False),  # MHA
    ("llama", 4, 2, True),  # GQA, tied
    ("qwen2", 8, 2, False),  # GQA with QKV biases
    ("qwen2", 4, 4, True),
]


def _randomize(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor filled with distinct values (norms are ones otherwise)."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("arch", "heads", "kv_heads", "tied"), CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_round_trip_is_bit_exact(arch: str, heads: int, kv_heads: int, tied: bool, tp: int) -> None:
    model = _hf_model(arch, heads, kv_heads, tied)
    state = _randomize(model)
    shape = ModelShape.from_hf_config(model.config)
    assert shape.qkv_bias == (arch == "qwen2")
    if kv_heads % tp:
        with pytest.raises(ValueError, match="tensor_parallel=4 must divide the model's num_key_value_heads"):
            shape.check_tensor_parallel(tp)
        return
    shape.check_tensor_parallel(tp)
    mega = hf_to_megatron(state, shape)
    assert list(mega) == megatron_names(shape)
    assert ("output_layer.weight" in mega) == (not tied)
    shards = {name: split_for_tp(name, t, tp, shape) for name, t in mega.items()}
    # Every rank's shard of the vocabulary-parallel tensors has the padded vocabulary's rows.
    rows = shards["embedding.word_embeddings.weight"][0].shape[0]
    assert rows * tp == shape.padded_vocab(tp) >= shape.vocab_size
    gathered = {name: gather_from_tp(name, parts, shape) for name, parts in shards.items()}
    back = megatron_to_hf(gathered, shape)
    assert list(back) == list(state), "names and state_dict order of the Hugging Face model"
    assert list(back) == hf_names(shape)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype
        assert torch.equal(back[name], tensor), name


def test_round_trip_keeps_bfloat16_bits() -> None:
    model = _hf_model("qwen2", 8, 2, False)
    state = {k: v.to(torch.bfloat16) for k, v in _randomize(model).items()}
    shape = ModelShape.from_hf_config(model.config)
    mega = hf_to_megatron(state, shape)
    shards = {n: split_for_tp(n, t, 2, shape) for n, t in mega.items()}
    back = megatron_to_hf({n: gather_from_tp(n, s, shape) for n, s in shards.items()}, shape)
    for name, tensor in state.items():
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name].view(torch.int16), tensor.view(torch.int16)), name


def test_fused_qkv_is_what_megatron_attention_splits() -> None:
    """megatron's SelfAttention views linear_qkv's output as [.., groups, (h/g + 2) * d] and splits it
    into the group's queries, its key and its value: that must give HF's q/k/v projections."""
    shape = ModelShape(
        num_layers=1, hidden_size=12, num_heads=6, num_kv_heads=2, head_dim=4,
        intermediate_size=8, vocab_size=5, tied_embeddings=False, qkv_bias=True,
    )  # fmt: skip
    g, per, d = 2, 3, 4
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(12, n * d) for n in (g * per, g, g))
    x = torch.randn(5, 12)
    weight = fuse_qkv(q.weight, k.weight, v.weight, shape)
    bias = fuse_qkv(q.bias, k.bias, v.bias, shape)
    mixed = (x @ weight.T + bias).view(5, g, (per + 2) * d)
    mq, mk, mv = torch.split(mixed, [per * d, d, d], dim=2)
    with torch.no_grad():
        torch.testing.assert_close(mq.reshape(5, -1), q(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mk.reshape(5, -1), k(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mv.reshape(5, -1), v(x), rtol=1e-5, atol=1e-6)


def test_tensor_parallel_shards_compute_the_whole_layer() -> None:
    """Per rank: the fc1 shard's halves are that rank's gate and up slices (megatron's gated unit
    chunks the local output in two); row-parallel partial products sum to the whole product; the
    column-parallel QKV shard holds whole query groups."""
    shape = ModelShape(
        num_layers=1, hidden_size=16, num_heads=8, num_kv_heads=4, head_dim=2,
        intermediate_size=12, vocab_size=7, tied_embeddings=False, qkv_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    x = torch.randn(3, 16)
    gate, up, down = torch.randn(12, 16), torch.randn(12, 16), torch.randn(16, 12)
    fc1 = torch.cat([gate, up])
    whole = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    tp = 2
    fc1_shards = split_for_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, tp, shape)
    fc2_shards = split_for_tp("decoder.layers.0.mlp.linear_fc2.weight", down, tp, shape)
    partial = []
    for w1, w2 in zip(fc1_shards, fc2_shards, strict=True):
        g_r, u_r = torch.chunk(x @ w1.T, 2, dim=-1)
        partial.append((torch.nn.functional.silu(g_r) * u_r) @ w2.T)
    torch.testing.assert_close(sum(partial), whole, rtol=1e-5, atol=1e-5)

    q, k, v = torch.randn(16, 16), torch.randn(8, 16), torch.randn(8, 16)
    qkv_shards = split_for_tp(
        "decoder.layers.0.self_attention.linear_qkv.weight", fuse_qkv(q, k, v, shape), tp, shape
    )
    half = ModelShape(**{**shape.__dict__, "num_heads": 4, "num_kv_heads": 2})
    rq, rk, rv = split_qkv(qkv_shards[1], half)
    assert torch.equal(rq, q[8:])
    assert torch.equal(rk, k[4:])
    assert torch.equal(rv, v[4:])


def test_vocab_padding_rows_are_zero_and_dropped() -> None:
    shape = ModelShape(
        num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=2, head_dim=2,
        intermediate_size=4, vocab_size=7, tied_embeddings=True, qkv_bias=False,
    )  # fmt: skip
    embedding = torch.randn(7, 4)
    shards = split_for_tp("embedding.word_embeddings.weight", embedding, 4, shape)
    assert [s.shape[0] for s in shards] == [2, 2, 2, 2]
    assert torch.equal(shards[3][1], torch.zeros(4))
    assert torch.equal(gather_from_tp("embedding.word_embeddings.weight", shards, shape), embedding)


def test_critic_names_and_policy_checkpoint() -> None:
    model = _hf_model("llama", 4, 2, False)
    shape = ModelShape.from_hf_config(model.config)
    policy = _randomize(model)
    # A policy checkpoint loads into the critic's trunk; its LM head is ignored, the value head absent.
    mega = hf_to_megatron(policy, shape, critic=True)
    assert "output_layer.weight" not in mega
    assert torch.equal(mega["embedding.word_embeddings.weight"], policy["model.embed_tokens.weight"])
    mega["output_layer.weight"] = torch.randn(1, shape.hidden_size)
    mega["output_layer.bias"] = torch.randn(1)
    assert parallel_kind("output_layer.weight", critic=True) == "replicated"
    back = megatron_to_hf(mega, shape, critic=True)
    assert list(back) == hf_names(shape, critic=True)
    assert back["value_head.bias"] is mega["output_layer.bias"]
    assert torch.equal(
        back["backbone.layers.1.self_attn.k_proj.weight"], policy["model.layers.1.self_attn.k_proj.weight"]
    )
    # And the critic's own names round-trip too.
    again = hf_to_megatron(back, shape, critic=True)
    assert all(torch.equal(again[n], mega[n]) for n in mega)


def test_bad_input_names_the_problem() -> None:
    model = _hf_model("llama", 4, 2, False)
    shape = ModelShape.from_hf_config(model.config)
    state = _randomize(model)
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks 1 tensors .*model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(state, shape)
    state = _randomize(model)
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(32,\)"):
        hf_to_megatron(state, shape)
    with pytest.raises(
        ValueError, match="converts Llama and Qwen2 models; this config has model_type='gpt2'"
    ):
        ModelShape.from_hf_config({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="num_attention_heads=6 is not a multiple of num_key_value_heads=4"):
        ModelShape(
            num_layers=1, hidden_size=12, num_heads=6, num_kv_heads=4, head_dim=2,
            intermediate_size=4, vocab_size=7, tied_embeddings=False, qkv_bias=False,
        )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    kv_heads=st.sampled_from([1, 2, 4]),
    per_group=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    vocab=st.integers(1, 23),
    ffn=st.sampled_from([4, 8, 12]),
    tp=st.sampled_from([1, 2, 4]),
    bias=st.booleans(),
    tied=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip_property(
    kv_heads: int,
    per_group: int,
    head_dim: int,
    vocab: int,
    ffn: int,
    tp: int,
    bias: bool,
    tied: bool,
    seed: int,
) -> None:
    """Any shape that TP divides: HF -> megatron -> TP shards -> gathered -> HF is the identity."""
    if kv_heads % tp or ffn % tp:
        return
    heads = kv_heads * per_group
    hidden = heads * head_dim + 1  # hidden need not be heads * head_dim (explicit head_dim)
    shape = ModelShape(
        num_layers=1, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=ffn, vocab_size=vocab, tied_embeddings=tied, qkv_bias=bias,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    from ppo_trainer.megatron_convert import _entries, _hf_shapes

    for entry in _entries(shape, critic=False):
        for name, dims in zip(entry.hf, _hf_shapes(shape, entry), strict=True):
            state[name] = torch.randn(dims, generator=generator)
    mega = hf_to_megatron(state, shape)
    shards = {n: split_for_tp(n, t, tp, shape) for n, t in mega.items()}
    for n, parts in shards.items():
        assert len(parts) == tp
        if parallel_kind(n) != "replicated":
            assert sum(p.numel() for p in parts) >= mega[n].numel()
    back = megatron_to_hf({n: gather_from_tp(n, p, shape) for n, p in shards.items()}, shape)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name
    if tied:
        assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


def test_conversion_does_not_import_megatron() -> None:
    code = (
        "import sys, ppo_trainer.megatron_convert, ppo_trainer.backends, ppo_trainer.config; "
        "assert not [m for m in sys.modules if m.startswith('megatron')], 'megatron imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensor_parallel_ranks_pool_their_samples() -> None:
    """The ranks of a TP group train on the union of their shares (re-padded to the widest response)
    and each takes back its own rows (megatron_backend's pooling; no megatron needed)."""
    from ppo_trainer.batch import Samples
    from ppo_trainer.megatron_backend import concat_samples

    def share(lengths: list[int], offset: int) -> Samples:
        return Samples.from_fields(
            {
                "tokens": [torch.arange(3 + r) + offset for r in lengths],
                "response_length": [torch.tensor([r]) for r in lengths],
                "loss_mask": [torch.ones(r) for r in lengths],
                "reward": [torch.tensor([float(offset + i)]) for i in range(len(lengths))],
                "rollout_log_probs": [torch.full((r,), -float(offset + 1)) for r in lengths],
                "prompt_index": [torch.tensor([offset + i]) for i in range(len(lengths))],
            }
        )

    a, b = share([2, 3], 0), share([5], 10)
    pooled = concat_samples([a, b])
    assert len(pooled) == 3
    assert pooled.max_response == 5
    assert pooled.response_lengths.tolist() == [2, 3, 5]
    assert pooled.reward.tolist() == [0.0, 1.0, 10.0]
    assert pooled.response_mask.sum(1).tolist() == [2.0, 3.0, 5.0]
    assert torch.equal(pooled.tokens[2], b.tokens[0])
    # Rank 0 takes back rows 0..1 at its own width, rank 1 row 2.
    assert torch.equal(pooled.rollout_log_probs[0:2, : a.max_response], a.rollout_log_probs)
    assert torch.equal(pooled.rollout_log_probs[2:3, : b.max_response], b.rollout_log_probs)
    assert torch.equal(pooled.loss_mask[0:2, : a.max_response], a.loss_mask)


# SmolLM2-135M-Instruct's layout (config.json): hidden 576, 9 query heads over 3 KV heads of 64,
# MLP 1536, tied embeddings, RoPE base 100000; 2 layers and a small odd vocabulary here (TP 3 pads it).
SMOLLM2_LAYOUT: dict[str, Any] = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": 64,
}


def _smollm2_checkpoint(folder: Any, layers: int = 2, vocab: int = 499) -> dict[str, torch.Tensor]:
    """A SmolLM2-shaped Llama saved by transformers in bf16 (every tensor random, norms included);
    the file's tensors, as a real checkpoint holds them (no ``lm_head.weight``: it is tied)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, vocab_size=vocab, **SMOLLM2_LAYOUT)
    model = LlamaForCausalLM(config)
    _randomize(model)
    model.to(torch.bfloat16).save_pretrained(folder)
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("tp", [1, 3])
def test_smollm2_layout_round_trip_is_bit_exact(tmp_path: Any, tp: int) -> None:
    """A transformers bf16 checkpoint with SmolLM2's grouped-query attention and tied embeddings:
    file -> megatron (fused QKV, fused gate/up, TP shards) -> Hugging Face, every bit back."""
    from transformers import AutoConfig

    saved = _smollm2_checkpoint(tmp_path)
    assert "lm_head.weight" not in saved  # tied: transformers writes the embeddings once
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tmp_path))
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.heads_per_group) == (9, 3, 64, 3)
    assert shape.tied_embeddings
    shape.check_tensor_parallel(tp)
    mega = hf_to_megatron(saved, shape)
    assert "output_layer.weight" not in mega  # megatron reuses the embeddings
    qkv = mega["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert tuple(qkv.shape) == ((9 + 2 * 3) * 64, 576)
    shards = {name: split_for_tp(name, t, tp, shape) for name, t in mega.items()}
    assert shards["decoder.layers.1.self_attention.linear_qkv.weight"][0].shape[0] == qkv.shape[0] // tp
    back = megatron_to_hf({n: gather_from_tp(n, s, shape) for n, s in shards.items()}, shape)
    assert set(back) == set(saved) | {"lm_head.weight"}
    for name, tensor in saved.items():
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name].view(torch.int16), tensor.view(torch.int16)), name
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]


def test_smollm2_grouped_query_layout_is_what_megatron_attention_splits(tmp_path: Any) -> None:
    """Each of the 3 query groups of the fused QKV: its 3 query heads, then its key head, then its
    value head, as megatron's attention splits them; HF's 9 query heads read key head ``i // 3``."""
    from transformers import AutoConfig

    saved = _smollm2_checkpoint(tmp_path, layers=1)
    shape = ModelShape.from_hf_config(AutoConfig.from_pretrained(tmp_path))
    fused = hf_to_megatron(saved, shape)["decoder.layers.0.self_attention.linear_qkv.weight"].float()
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    mixed = (x @ fused.T).view(5, 3, (3 + 2) * 64)
    mq, mk, mv = torch.split(mixed, [3 * 64, 64, 64], dim=2)
    layer = "model.layers.0.self_attn."
    q = x @ saved[layer + "q_proj.weight"].float().T  # [5, 9 * 64]
    k = x @ saved[layer + "k_proj.weight"].float().T  # [5, 3 * 64]
    v = x @ saved[layer + "v_proj.weight"].float().T
    for head in range(9):
        group = head // 3  # transformers' repeat_kv: query head i attends with key/value head i // 3
        ours = mq[:, group, (head % 3) * 64 : (head % 3 + 1) * 64]
        # Same rows of the same weights; only the matmul's blocking may differ: float32 rounding.
        close = {"rtol": 1e-6, "atol": 1e-4}
        torch.testing.assert_close(ours, q[:, head * 64 : (head + 1) * 64], **close)
        torch.testing.assert_close(mk[:, group], k[:, group * 64 : (group + 1) * 64], **close)
        torch.testing.assert_close(mv[:, group], v[:, group * 64 : (group + 1) * 64], **close)
