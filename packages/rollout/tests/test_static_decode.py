"""The static-KV-cache decode path on CPU (eager; CUDA graphs are in test_gpu.py): the same tokens as the
decode loop, bucketing, stop checks, cache indexing, and what is kept between calls; the fused forward
(fused RMSNorm, rolled rotary, joint q/k) against the earlier one: the same logits, fewer operations."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.core import GenerationCore, make_sampler, pick_with_noise, sampling_distribution
from ppo_rollout.engine.decode_fusions import QKV, FusedLinear, RmsNorm, rotate_rolled, signed_sin
from ppo_rollout.engine.static_decode import (
    LlamaStaticDecoder,
    batch_bucket,
    kv_bucket,
    round_up,
    stop_check_due,
    unsupported_reason,
)

PROMPTS = [[1, 5, 6], [1, 7, 8, 9, 14], [1, 4]]


@pytest.fixture(scope="module")
def pair(tiny_model: Path) -> tuple[GenerationCore, GenerationCore]:
    return GenerationCore(tiny_model, decode="static"), GenerationCore(tiny_model, decode="loop")


def _same(a: list[Any], b: list[Any]) -> None:
    assert [(o.prompt_position, o.token_ids, o.finish_reason) for o in a] == [
        (o.prompt_position, o.token_ids, o.finish_reason) for o in b
    ]
    for x, y in zip(a, b, strict=True):
        assert x.log_probs == pytest.approx(y.log_probs, abs=1e-5)


def test_batch_bucket() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 250, 256, 257)] == [
        1, 2, 4, 8, 8, 16, 16, 32, 256, 256, 272,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one row"):
        batch_bucket(0)


def test_kv_bucket_and_round_up() -> None:
    assert [kv_bucket(c, 320) for c in (1, 64, 65, 128, 129, 300, 320)] == [64, 64, 128, 128, 192, 320, 320]
    assert kv_bucket(70, 100) == 100  # capped at the capacity
    assert kv_bucket(5, 64, block=4) == 8
    for bad in (0, 321):
        with pytest.raises(ValueError, match="columns must be in"):
            kv_bucket(bad, 320)
    assert [round_up(n, 64) for n in (0, 1, 64, 65)] == [0, 64, 64, 128]
    with pytest.raises(ValueError, match="multiple >= 1"):
        round_up(3, 0)


def test_stop_check_due() -> None:
    assert [s for s in range(64) if stop_check_due(s)] == [15, 31, 47, 63]
    assert [s for s in range(5) if stop_check_due(s, every=1)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="every >= 1"):
        stop_check_due(3, every=0)


def test_pick_with_noise_is_multinomial_for_the_same_generator() -> None:
    probs = torch.softmax(torch.randn(64, 30, generator=torch.Generator().manual_seed(0)), dim=-1)
    for seed in range(5):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        drawn = torch.multinomial(probs, 1, generator=g1)[:, 0]
        noise = torch.empty_like(probs).exponential_(1, generator=g2)
        assert torch.equal(pick_with_noise(probs, noise), drawn)
        assert torch.equal(g1.get_state(), g2.get_state())  # the streams stay in step too


def test_make_sampler_greedy_ignores_noise() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, -1.0, 0.5]])
    tokens, logp = make_sampler(SamplingConfig(temperature=0.0))(logits, torch.full((2, 3), 1e-9))
    assert tokens.tolist() == [1, 0]
    assert logp.tolist() == pytest.approx(
        torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0].tolist()
    )
    probs, _ = sampling_distribution(logits, SamplingConfig(temperature=1.0, top_k=1))
    assert probs is not None
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.0, max_new_tokens=40, n_samples_per_prompt=2),
        SamplingConfig(temperature=1.0, max_new_tokens=40, n_samples_per_prompt=3, seed=4),
        SamplingConfig(
            temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=20, n_samples_per_prompt=3, seed=7
        ),
        SamplingConfig(
            temperature=1.0, max_new_tokens=30, n_samples_per_prompt=2, seed=1, stop_token_ids=(5, 6)
        ),
        SamplingConfig(temperature=1.0, max_new_tokens=1, n_samples_per_prompt=2, seed=2),
    ],
    ids=["greedy", "sampled", "top-k-top-p", "stop-tokens", "one-token"],
)
def test_static_path_gives_the_loops_tokens(
    pair: tuple[GenerationCore, GenerationCore], sampling: Any
) -> None:
    static, loop = pair
    a = static.generate(PROMPTS, sampling)
    assert static.last_decode_path == "static-eager"
    assert loop.last_decode_path == "loop" or loop.last_decode_path is None
    b = loop.generate(PROMPTS, sampling)
    assert loop.last_decode_path == "loop"
    _same(a, b)


def test_stop_tokens_end_rows_early_in_the_static_path(pair: tuple[GenerationCore, GenerationCore]) -> None:
    static, _ = pair
    outs = static.generate(
        PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=30, seed=1, stop_token_ids=(5, 6))
    )
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped, "seed 1 stops at least one row (the draw is fixed by the seed)"
    stops = {5, 6, *static.eos_token_ids}
    for o in stopped:
        assert o.token_ids[-1] in stops
        assert not set(o.token_ids[:-1]) & stops
    for o in outs:
        if o.finish_reason == "length":
            assert len(o.token_ids) == 30
            assert not set(o.token_ids) & stops


def test_cache_columns_positions_and_mask_after_a_call(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static")
    new = 10
    core.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=new))
    b = core._graphs.buffers if core._graphs is not None else None
    assert b is not None
    width = max(len(p) for p in PROMPTS)
    assert b.batch == 4  # 3 rows, bucket 4
    assert b.capacity == round_up(width + new - 1, 64)
    assert int(b.col) == width + new - 1  # the column the next token would go to
    assert int(b.step) == new
    assert b.pos[:3].tolist() == [len(p) + new - 1 for p in PROMPTS]
    for i, p in enumerate(PROMPTS):
        row = b.valid[i].tolist()
        expect = [width - len(p) <= c < width + new - 1 for c in range(b.capacity)]
        assert row == expect, i
    assert b.valid[3].tolist() == [c == width - 1 or width <= c < width + new - 1 for c in range(b.capacity)]
    assert bool(b.finished[3])  # the bucket's padding row is finished from the start
    # Columns never written stay zero; written ones hold the prompt's keys as transformers computes them.
    assert torch.count_nonzero(b.keys[0][:3, :, width + new - 1 :]) == 0
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in PROMPTS])[:, None]).long()
    out = core.model(
        input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True
    )
    cache = out.past_key_values
    ref = cache.layers[1].keys if hasattr(cache, "layers") else cache.key_cache[1]
    for i, p in enumerate(PROMPTS):
        cols = slice(width - len(p), width)
        assert torch.allclose(b.keys[1][i, :, cols], ref[i, :, cols], atol=1e-5)


def test_buffers_are_kept_between_calls_and_dropped(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static")
    s = SamplingConfig(temperature=1.0, max_new_tokens=8, n_samples_per_prompt=2, seed=3)
    first = core.generate(PROMPTS, s)
    assert core._graphs is not None
    kept = core._graphs.buffers
    assert kept is not None
    assert core.generate(PROMPTS, s) == first
    assert core._graphs.buffers is kept  # same bucket and capacity: reused, not reallocated
    core.generate(PROMPTS, SamplingConfig(max_new_tokens=8, n_samples_per_prompt=4))  # 12 rows: bucket 16
    assert core._graphs.buffers is not kept
    core.drop_decode_state()
    assert core._graphs.buffers is None
    assert core.generate(PROMPTS, s) == first


def test_a_concurrent_call_uses_its_own_buffers(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static")
    s = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3)
    alone = core.generate(PROMPTS, s)
    kept = core._graphs.buffers if core._graphs is not None else None
    with core._graphs_lock:  # as if another generate call were running
        assert core.generate(PROMPTS, s) == alone
    assert core._graphs is not None
    assert core._graphs.buffers is kept


def _save(model: torch.nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder)
    return folder


def test_grouped_query_attention_and_qwen2_biases(tmp_path: Path) -> None:
    common: dict[str, Any] = {
        "vocab_size": 40,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(0)
    folders = [
        _save(LlamaForCausalLM(LlamaConfig(**common)), tmp_path / "llama-gqa"),
        _save(Qwen2ForCausalLM(Qwen2Config(**common)), tmp_path / "qwen2"),
    ]
    for folder in folders:
        static, loop = GenerationCore(folder, decode="static"), GenerationCore(folder, decode="loop")
        for s in (
            SamplingConfig(temperature=0.0, max_new_tokens=12, n_samples_per_prompt=2),
            SamplingConfig(temperature=1.0, max_new_tokens=12, n_samples_per_prompt=2, seed=5),
        ):
            _same(static.generate(PROMPTS, s), loop.generate(PROMPTS, s))


def test_unsupported_models_and_bad_modes(tmp_path: Path, tiny_model: Path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=20, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert "model_type 'gpt2'" in str(unsupported_reason(gpt2))
    folder = _save(gpt2, tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"decode='static': model_type 'gpt2'.*use decode='loop'"):
        GenerationCore(folder, decode="static")
    auto = GenerationCore(folder)  # auto falls back to the loop
    auto.generate([[1, 2]], SamplingConfig(max_new_tokens=3))
    assert auto.last_decode_path == "loop"
    with pytest.raises(ValueError, match="decode must be one of"):
        GenerationCore(tiny_model, decode="graphs")
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=20,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            rope_scaling={"rope_type": "dynamic", "factor": 2.0},
        )
    )
    assert "rope type 'dynamic'" in str(unsupported_reason(llama))
    assert unsupported_reason(GenerationCore(tiny_model).model) is None


def test_auto_is_the_loop_on_cpu(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model)
    core.generate(PROMPTS, SamplingConfig(max_new_tokens=3))
    assert core.last_decode_path == "loop"
    assert core._graphs is None


def test_sdpa_decode_attention_gives_the_loops_tokens(tiny_model: Path) -> None:
    static, loop = GenerationCore(tiny_model, decode="static"), GenerationCore(tiny_model, decode="loop")
    assert static._decoder is not None
    assert static._decoder.attention == "matmul"  # the default; sdpa is the alternative
    static._decoder.attention = "sdpa"
    for s in (
        SamplingConfig(temperature=0.0, max_new_tokens=30, n_samples_per_prompt=2),
        SamplingConfig(temperature=1.0, max_new_tokens=30, n_samples_per_prompt=3, seed=4),
    ):
        _same(static.generate(PROMPTS, s), loop.generate(PROMPTS, s))


# -- the fused forward against the earlier one ---------------------------------------------------------

SMALL: dict[str, Any] = {
    "vocab_size": 40,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _small_model(kind: str, layers: int = 2) -> Any:
    """A float32 Llama (GQA, no biases) or Qwen2 (GQA, q/k/v biases) with non-trivial norm weights and
    biases (fresh ones are ones and zeros, which would hide a weight or bias applied in the wrong place)."""
    torch.manual_seed(0)
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    model = model_class(config_class(**SMALL, num_hidden_layers=layers)).eval().requires_grad_(False)
    for name, param in model.named_parameters():
        if "norm" in name or name.endswith("bias"):
            param.normal_()
    if kind == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    return model


def _ragged_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, valid and positions [3, 7] of left-padded rows, as GenerationCore sets them up."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 40, (3, 7), generator=g)
    valid = torch.ones((3, 7), dtype=torch.bool)
    valid[0, :3] = False
    valid[2, :5] = False
    return ids, valid, (valid.long().cumsum(-1) - 1).clamp(min=0)


def _prefill_then_decode(decoder: LlamaStaticDecoder) -> tuple[torch.Tensor, ...]:
    """Prefill logits, two decode steps' logits (each step feeding the last one's greedy token), and
    the cache after them."""
    ids, valid, positions = _ragged_batch()
    rows, width = ids.shape
    capacity = 64
    b = decoder.allocate(rows, capacity, 4)
    with torch.inference_mode():
        prefill = decoder.forward(ids, positions, b, decoder.prefill_bias(valid), width, col=None)
        b.valid[:, :width] = valid
        b.tok.copy_(prefill.argmax(-1))
        b.pos.copy_(positions[:, -1] + 1)
        b.col.fill_(width)
        steps = []
        for _ in range(2):
            b.valid.index_fill_(1, b.col, True)
            bias = decoder._bias(b.valid[:, None, None, :capacity])
            logits = decoder.forward(b.tok[:, None], b.pos[:, None], b, bias, capacity, b.col)
            steps.append(logits)
            b.tok.copy_(logits.argmax(-1))
            b.pos.add_(1)
            b.col.add_(1)
    return (prefill, *steps, *b.keys, *b.values)


OUTPUTS = ["prefill logits", "decode 1 logits", "decode 2 logits", "keys 0", "keys 1", "values 0", "values 1"]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_forward_gives_the_earlier_forwards_logits(kind: str) -> None:
    model = _small_model(kind)
    fused, plain = LlamaStaticDecoder(model), LlamaStaticDecoder(model, fused=False)
    assert fused.fused  # the default
    assert not plain.fused
    # The fused paths are the ones taken: every norm computed by F.rms_norm, q/k/v and gate/up joined.
    assert all(n.eps == 1e-6 for n in [*fused._input_norms, *fused._post_norms, fused._final_norm])
    assert all(p is not None and p.joined() is not None for p in [*fused._qkv, *fused._gate_up])
    ours, theirs = _prefill_then_decode(fused), _prefill_then_decode(plain)
    for name, a, b in zip(OUTPUTS, ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), f"{kind} {name}: {(a - b).abs().max():.3g}"
    # Both are transformers' forward: its last-position logits for the same rows.
    ids, valid, positions = _ragged_batch()
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=valid.long(), position_ids=positions).logits[:, -1]
    assert torch.allclose(ours[0], ref, rtol=0, atol=1e-5), (ours[0] - ref).abs().max()


class _OtherNorm(LlamaRMSNorm):
    """An RMSNorm subclass with another formula: the decoder must call it, not fuse it."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden_states) + 0.5


class _OtherLinear(torch.nn.Linear):
    """A Linear subclass (as LoRA or a quantised layer would be): its forward may differ, so no joint q/k."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 2.0


def test_norms_and_projections_of_other_classes_are_called_as_they_are() -> None:
    model = _small_model("llama")
    layer = model.model.layers[1]
    other = _OtherNorm(SMALL["hidden_size"])
    other.weight.data.copy_(layer.input_layernorm.weight)
    layer.input_layernorm = other
    q = layer.self_attn.q_proj
    layer.self_attn.q_proj = _OtherLinear(q.in_features, q.out_features, bias=False)
    layer.self_attn.q_proj.weight.data.copy_(q.weight)
    fused, plain = LlamaStaticDecoder(model), LlamaStaticDecoder(model, fused=False)
    assert fused._input_norms[1].eps is None
    assert fused._input_norms[0].eps is not None
    assert fused._qkv[1] is None
    assert fused._qkv[0] is not None
    assert fused._gate_up[1] is not None
    ours, theirs = _prefill_then_decode(fused), _prefill_then_decode(plain)
    for name, a, b in zip(OUTPUTS, ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), f"{name}: {(a - b).abs().max():.3g}"
    assert RmsNorm.of(other).eps is None
    assert FusedLinear.of(model.model.layers[0].self_attn, QKV) is not None


@settings(max_examples=40, deadline=None)
@given(
    half=st.integers(1, 32),
    heads=st.integers(1, 4),
    width=st.integers(1, 5),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_rolled_rotary_is_transformers_rotary_exactly(
    half: int, heads: int, width: int, dtype: torch.dtype, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn((2, h, width, 2 * half), generator=g).to(dtype) for h in (heads, 1))
    angles = torch.randn((2, width, half), generator=g) * 10
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    cos, sin_signed = cos[:, None], signed_sin(sin[:, None])
    assert torch.equal(rotate_rolled(q, cos, sin_signed), q_ref)
    assert torch.equal(rotate_rolled(k, cos, sin_signed), k_ref)


# -- operations per layer of a decode step ----------------------------------------------------------

_ALLOCATIONS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default"}


class _CountOps(TorchDispatchMode):
    """The aten operations that produce data: those writing into an argument (``index_copy_``,
    ``mm.out``) or returning new storage. Views, no-op casts (``x.float()`` of a float32 ``x``) and bare
    allocations are left out. Under inference mode, as the engine runs, operations that are one fused
    kernel on CUDA (``rms_norm``, ``linear``, ``softmax``) arrive undecomposed: each counts once."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        if name not in _ALLOCATIONS and (writes or not _storages(out) & _storages((args, kwargs))):
            self.ops[name] += 1
        return out


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def _decode_step_ops(kind: str, layers: int, fused: bool) -> Counter[str]:
    decoder = LlamaStaticDecoder(_small_model(kind, layers), fused=fused)
    b = decoder.allocate(4, 64, 8)
    b.valid[:, :3] = True
    b.col.fill_(3)
    b.pos.fill_(3)
    sampler = make_sampler(SamplingConfig(temperature=0.0))
    with torch.inference_mode(), _CountOps() as count:
        decoder.decode_step(b, 64, sampler, pad_token_id=0)
    return count.ops


def _per_layer(kind: str, fused: bool) -> Counter[str]:
    """What one more layer adds to a decode step (2 layers against 1: the rest cancels out)."""
    return _decode_step_ops(kind, 2, fused) - _decode_step_ops(kind, 1, fused)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_decode_step_runs_fewer_operations_per_layer(kind: str) -> None:
    earlier, fused = _per_layer(kind, fused=False), _per_layer(kind, fused=True)
    assert earlier == {
        # two RMSNorms: pow, mean, add eps, rsqrt, mul, mul weight (the float32 casts are no-ops here)
        "aten.pow.Tensor_Scalar": 2,
        "aten.mean.dim": 2,
        "aten.rsqrt.default": 2,
        # rotary for q and for k: neg, cat, 2 mul, add, each
        "aten.neg.default": 2,
        "aten.cat.default": 2,
        "aten.mul.Tensor": 2 * 2 + 2 * 2 + 1 + 1,  # norms, rotary, attention scale, MLP gate * up
        "aten.add.Tensor": 2 + 2 + 1 + 2,  # eps, rotary, attention mask, residuals
        "aten.linear.default": 7,  # q, k, v, o, gate, up, down
        "aten.index_copy_.default": 2,  # the cache's keys and values
        "aten.matmul.default": 2,
        "aten.softmax.int": 1,
        "aten.silu.default": 1,
    }, earlier
    assert fused == {
        "aten.rms_norm.default": 2,
        "aten.roll.default": 1,  # one rotation for q and k together
        "aten.mul.Tensor": 2 + 2 + 1 + 1,  # norm weights, rotary, attention scale, MLP
        "aten.add.Tensor": 1 + 1 + 2,  # rotary, attention mask, residuals
        "aten.linear.default": 4,  # q/k/v joined, o, gate/up joined, down
        "aten.index_copy_.default": 2,
        "aten.matmul.default": 2,
        "aten.softmax.int": 1,
        "aten.silu.default": 1,
    }, fused
    assert (sum(earlier.values()), sum(fused.values())) == (40, 23)
