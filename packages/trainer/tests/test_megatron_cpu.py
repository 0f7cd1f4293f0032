"""megatron-core's own GPTModel on CPU (float32, one gloo rank): the converted weights compute what
the transformers model computes, and megatron's groups survive a destroy and rebuild.

Skipped where megatron-core does not import (CI: Python 3.11 without the ``megatron`` extra). The
groups are the lifecycle's (``ReloadableProcessGroups``), created in this process and destroyed at
the end of the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (the ppo-trainer[megatron] extra)"
)

import torch.distributed as dist

from ppo_lifecycle.process_groups import ReloadableProcessGroups
from ppo_trainer import megatron_convert as mc
from ppo_trainer.megatron_backend import build_gpt, load_hf_into
from ppo_trainer.megatron_groups import MegatronGroups
from ppo_weight_sync import free_port


@pytest.fixture(autouse=True)
def _cpu_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's RoPE moves its frequencies to ``torch.cuda.current_device()`` on the first forward;
    these models live on the CPU, so point that at the CPU (the only CUDA call on this path)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture(scope="module")
def megatron_groups() -> Iterator[tuple[ReloadableProcessGroups, MegatronGroups]]:
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    groups = ReloadableProcessGroups()
    groups.init_default("gloo", f"tcp://127.0.0.1:{free_port()}", 1, 0, timedelta(seconds=60))
    recorded = MegatronGroups(groups)
    with recorded.recording():
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    # No dropout here: the tracker whose fork() is a no-op (the training one saves CUDA RNG states).
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    try:
        yield groups, recorded
    finally:
        initialize_rng_tracker(force_reset=True)
        mpu.destroy_model_parallel()
        groups.destroy()


def _causal(length: int) -> torch.Tensor:
    """The mask megatron builds itself when given None (True: masked), but on the CPU: its default
    is made on CUDA. The backend passes None on GPUs."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)[None, None]


def _hf(arch: str, tied: bool) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs: dict[str, Any] = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 40,
        "max_position_embeddings": 64,
        "tie_word_embeddings": tied,
    }
    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(LlamaConfig(**kwargs))
        if arch == "llama"
        else Qwen2ForCausalLM(Qwen2Config(**kwargs))
    )
    with torch.no_grad():  # norms and biases away from their ones and zeros
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_megatron_logits_match_transformers(megatron_groups: Any, arch: str, tied: bool) -> None:
    hf = _hf(arch, tied)
    shape = mc.ModelShape.from_hf_config(hf.config)
    gpt = build_gpt(hf.config, shape, tp=1, critic=False, dtype=torch.float32, device=torch.device("cpu"))
    load_hf_into(gpt, hf.state_dict(), shape, tp=1, tp_rank=0, critic=False)
    gpt.eval()
    tokens = torch.randint(0, 40, (2, 11), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(11).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        ours = gpt(tokens, positions, _causal(11))
        theirs = hf(input_ids=tokens).logits
    assert ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"


def test_critic_value_head_matches_torch_critic(megatron_groups: Any) -> None:
    from ppo_trainer.models import CriticModel

    hf = _hf("llama", False)
    critic = CriticModel(hf.model, seed=5).eval()
    shape = mc.ModelShape.from_hf_config(hf.config)
    gpt = build_gpt(hf.config, shape, tp=1, critic=True, dtype=torch.float32, device=torch.device("cpu"))
    load_hf_into(gpt, critic.state_dict(), shape, tp=1, tp_rank=0, critic=True)
    gpt.eval()
    tokens = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = gpt(tokens, torch.arange(7).unsqueeze(0).expand(3, -1), _causal(7)).squeeze(-1)
        theirs = critic(tokens)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_groups_rebuilt_and_rebound(megatron_groups: Any) -> None:
    from megatron.core import parallel_state as mpu

    groups, recorded = megatron_groups
    hf = _hf("llama", False)
    shape = mc.ModelShape.from_hf_config(hf.config)
    gpt = build_gpt(hf.config, shape, tp=1, critic=False, dtype=torch.float32, device=torch.device("cpu"))
    before = mpu.get_tensor_model_parallel_group()
    assert recorded.handles, "megatron made no groups through the lifecycle"
    # One rank: every group megatron asks for is [0] with the same timeout, so they are one group.
    asked, made = groups.subgroup_count
    assert (asked, made) == (len(recorded.handles), 1)
    assert asked > 10
    groups.destroy()
    groups.reload()
    swapped = recorded.rebind(gpt)
    after = mpu.get_tensor_model_parallel_group()
    assert after is not before
    assert after is recorded.handles[recorded._bound.index(after)].group
    assert swapped > len(recorded.handles) // 2  # parallel_state globals and the layers' tp_group
    assert len({id(h.group) for h in recorded.handles}) == 1
    held = {
        id(m.tp_group) for m in gpt.modules() if isinstance(getattr(m, "tp_group", None), dist.ProcessGroup)
    }
    assert held == {id(after)}
    # And the live group works.
    t = torch.ones(2)
    dist.all_reduce(t, group=mpu.get_data_parallel_group())
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("critic", [False, True])
def test_build_gpt_puts_every_tensor_on_the_target_device(
    megatron_groups: Any, monkeypatch: pytest.MonkeyPatch, critic: bool
) -> None:
    """The KL-loss crash on the GPU, on the CPU: megatron makes its linear layers and RoPE on
    ``torch.cuda.current_device()`` but the local spec's RMSNorm on the default device. With the
    current device pointed at ``meta`` (a device that is not the CPU, as CUDA is), a model that is not
    wrapped in megatron's DDP (the reference) kept CPU norms; build_gpt must leave none behind."""
    from ppo_trainer.megatron_backend import held_tensors, misplaced_tensors

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    hf = _hf("llama", True)
    shape = mc.ModelShape.from_hf_config(hf.config)
    meta = torch.device("meta")
    gpt = build_gpt(hf.config, shape, tp=1, critic=critic, dtype=torch.bfloat16, device=meta)
    assert misplaced_tensors({"reference": gpt}, meta) == []
    tensors = held_tensors(gpt)
    assert {t.device for t in tensors} == {meta}
    # What the memory backend tracks includes RoPE's frequencies (a plain attribute, not a buffer):
    # torch_memory_saver would discard them at a sleep otherwise.
    rope = gpt.rotary_pos_emb.inv_freq
    assert any(t is rope for t in tensors)
    norms = [n for n, _ in gpt.named_parameters() if "layernorm" in n]
    assert len(norms) == 2 * 2 + 1  # input and pre-MLP per layer, and the final norm


def test_megatron_norms_are_made_on_the_cpu_without_build_gpt(
    megatron_groups: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why build_gpt moves the model: megatron-core alone leaves the norms on the default device
    (the check fails loudly should a megatron-core version place them itself; then the move is moot)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from ppo_trainer.megatron_backend import _transformer_config, misplaced_tensors

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "meta")
    hf = _hf("llama", True)
    shape = mc.ModelShape.from_hf_config(hf.config)
    gpt = GPTModel(
        config=_transformer_config(hf.config, shape, 1, torch.bfloat16, on_cpu=False),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab_size,
        max_sequence_length=64,
        share_embeddings_and_output_weights=True,
        position_embedding_type="rope",
    )
    stray = misplaced_tensors({"gpt": gpt}, torch.device("meta"))
    assert stray
    assert all("layernorm" in s and "(cpu)" in s for s in stray), stray


def _smollm2_shaped(layers: int = 2, vocab: int = 499) -> Any:
    """A Llama with SmolLM2-135M's head layout (9 query heads over 3 KV heads of 64, hidden 576,
    MLP 1536, tied embeddings, RoPE base 100000), fewer layers and a small vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        num_hidden_layers=layers,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from ones: a norm loaded into the wrong slot shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def test_smollm2_layout_through_megatron_gptmodel_is_bit_exact(megatron_groups: Any) -> None:
    """The bf16 checkpoint into megatron's own GPTModel (bf16 parameters, as on the GPU) and back out
    of its parameters in Hugging Face names: every bit, lm_head the embeddings."""
    from megatron.core.transformer.module import Float16Module

    from ppo_trainer.megatron_backend import _unwrap_name

    hf = _smollm2_shaped()
    state = {k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}
    shape = mc.ModelShape.from_hf_config(hf.config)
    cpu = torch.device("cpu")
    gpt = build_gpt(hf.config, shape, tp=1, critic=False, dtype=torch.bfloat16, device=cpu)
    # As the backend wraps it: Float16Module casts what megatron made in float32 (the torch norms).
    module = Float16Module(gpt.config, gpt)
    load_hf_into(module, state, shape, tp=1, tp_rank=0, critic=False)
    mega = {_unwrap_name(n): p.detach() for n, p in module.named_parameters()}
    assert {t.dtype for t in mega.values()} == {torch.bfloat16}
    assert "output_layer.weight" not in mega  # tied: megatron's output layer is the embedding
    back = mc.megatron_to_hf(mega, shape)
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == torch.bfloat16
        assert torch.equal(back[name].view(torch.int16), tensor.view(torch.int16)), name


def test_smollm2_layout_logits_match_transformers(megatron_groups: Any) -> None:
    """Grouped-query attention 9/3 and tied embeddings compute what transformers computes (float32)."""
    hf = _smollm2_shaped()
    shape = mc.ModelShape.from_hf_config(hf.config)
    cpu = torch.device("cpu")
    gpt = build_gpt(hf.config, shape, tp=1, critic=False, dtype=torch.float32, device=cpu)
    load_hf_into(gpt, hf.state_dict(), shape, tp=1, tp_rank=0, critic=False)
    gpt.eval()
    tokens = torch.randint(0, 499, (2, 13), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = gpt(tokens, torch.arange(13).unsqueeze(0).expand(2, -1), _causal(13))
        theirs = hf(input_ids=tokens).logits
    diff = (ours - theirs).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference {diff}"


def _packed_params(lengths: list[int]) -> Any:
    """What the backend hands GPTModel for samples of these lengths (``megatron_packing.thd_params``)."""
    from ppo_trainer.megatron_packing import thd_params

    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return thd_params(offsets, offsets, max(lengths))


@pytest.mark.parametrize("per_token_rotary", [True, False])
@pytest.mark.parametrize("critic", [False, True])
def test_packed_samples_compute_what_each_sample_computes_alone(
    megatron_groups: Any, critic: bool, per_token_rotary: bool
) -> None:
    """train.pack_sequences with the megatron backend: samples back to back in one thd row (positions
    restarting, attention within each sample, 9/3 grouped-query heads) give each sample's own logits
    or values, and the same gradients, as the samples run one by one (float32). Both RoPE paths:
    the per-token table the backend serves (``packed_positions``), and megatron's per-sample loop."""
    from ppo_trainer.megatron_packing import PackedRotaryEmbedding, packed_positions

    hf = _smollm2_shaped()
    shape = mc.ModelShape.from_hf_config(hf.config)
    cpu = torch.device("cpu")
    gpt = build_gpt(hf.config, shape, tp=1, critic=critic, dtype=torch.float32, device=cpu, packed=True)
    assert isinstance(gpt.rotary_pos_emb, PackedRotaryEmbedding)
    # the critic: the policy's trunk and a value head of its own (strict_value_head=False keeps it)
    load_hf_into(gpt, hf.state_dict(), shape, tp=1, tp_rank=0, critic=critic, strict_value_head=False)
    if critic:
        with torch.no_grad():
            gpt.output_layer.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(7))
    gpt.eval()
    lengths = [5, 13, 1, 8]
    tokens = torch.randint(0, 499, (sum(lengths),), generator=torch.Generator().manual_seed(6))
    samples = tokens.split(lengths)
    weights = torch.randn(sum(lengths), gpt.output_layer.weight.shape[0] if critic else 499)

    def grads() -> dict[str, torch.Tensor]:
        out = {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None}
        gpt.zero_grad(set_to_none=True)
        return out

    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    rotary = packed_positions(gpt, positions[0]) if per_token_rotary else contextlib.nullcontext()
    with rotary:
        packed = gpt(tokens.unsqueeze(0), positions, None, packed_seq_params=_packed_params(lengths))[0]
    assert gpt.rotary_pos_emb.positions is None  # served only within the block
    (packed * weights).sum().backward()
    packed_grads = grads()
    alone = []
    for sample, w in zip(samples, weights.split(lengths), strict=True):
        n = sample.numel()
        out = gpt(sample.unsqueeze(0), torch.arange(n).unsqueeze(0), _causal(n))[0]
        (out * w).sum().backward()
        alone.append(out.detach())
    alone_grads = grads()
    assert packed.shape == torch.cat(alone).shape
    diff = (packed.detach() - torch.cat(alone)).abs().max().item()
    assert diff < 1e-4, f"max abs output difference {diff}"
    assert packed_grads
    assert packed_grads.keys() == alone_grads.keys()
    for name, grad in packed_grads.items():
        scale = alone_grads[name].abs().max().item()
        assert (grad - alone_grads[name]).abs().max().item() <= 1e-4 * max(1.0, scale), name


def test_per_token_rotary_table_takes_megatrons_whole_row_path(
    megatron_groups: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the per-token table megatron rotates the packed row in one call, not once per sample."""
    from megatron.core.models.common.embeddings import rope_utils

    from ppo_trainer.megatron_packing import packed_positions

    calls: list[int] = []
    original = rope_utils._apply_rotary_pos_emb_bshd

    def counted(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(t.shape[0])
        return original(t, *args, **kwargs)

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_bshd", counted)
    hf = _smollm2_shaped(layers=1)
    shape = mc.ModelShape.from_hf_config(hf.config)
    gpt = build_gpt(
        hf.config, shape, tp=1, critic=False, dtype=torch.float32, device=torch.device("cpu"), packed=True
    )
    load_hf_into(gpt, hf.state_dict(), shape, tp=1, tp_rank=0, critic=False)
    lengths = [5, 13, 1, 8]
    positions = torch.cat([torch.arange(n) for n in lengths])
    tokens = torch.randint(0, 499, (1, sum(lengths)))
    with torch.no_grad():
        with packed_positions(gpt, positions):
            gpt(tokens, positions.unsqueeze(0), None, packed_seq_params=_packed_params(lengths))
        assert calls == [27, 27]  # queries and keys, the whole row each
        calls.clear()
        gpt(tokens, positions.unsqueeze(0), None, packed_seq_params=_packed_params(lengths))
        assert calls == lengths * 2  # megatron's loop: each sample, queries then keys


def test_packed_attention_refuses_dropout_and_other_formats(megatron_groups: Any) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    hf = _smollm2_shaped()
    shape = mc.ModelShape.from_hf_config(hf.config)
    cpu = torch.device("cpu")
    gpt = build_gpt(hf.config, shape, tp=1, critic=False, dtype=torch.float32, device=cpu, packed=True)
    attention = gpt.decoder.layers[0].self_attention.core_attention
    q = torch.zeros(4, 9, 64)
    kv = torch.zeros(4, 3, 64)
    with pytest.raises(ValueError, match="thd format, got 'sbhd'"):
        attention(q, kv, kv, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    attention.attention_dropout.p = 0.1
    attention.train()
    with pytest.raises(ValueError, match="train with attention_dropout=0"):
        attention(q, kv, kv, None, packed_seq_params=_packed_params([4]))
