"""Packed sequences and token-budget micro-batches against the padded path, in float32 on the CPU.

The model has the SmolLM2 layout in miniature (grouped-query attention, tied embeddings). Packed and
padded forwards compute every real position from the same numbers in another layout, so log-probs,
entropies, values and the updates they give agree to float32 rounding (1e-6; BLAS may block a
``[T, hidden]`` matmul otherwise than a ``[b, L, hidden]`` one, so equal bits are not promised).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import make_fields

from ppo_trainer import AlgorithmConfig, TrainerConfig, objective, packing
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples

VOCAB = 40
CLOSE = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("gqa_llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def samples_of(n: int, seed: int) -> Samples:
    """Prompts of 2-9 tokens and responses of 0-8, a masked-out token in the longer ones."""
    return Samples.from_fields(
        make_fields(n, seed, vocab=VOCAB, prompt_tokens=(2, 9), response_tokens=(0, 8))
    )


def trainer(model: Path, role: str = "actor", dp: DataParallel | None = None, **kwargs) -> TorchTrainer:  # type: ignore[no-untyped-def]
    alg = kwargs.pop("algorithm", AlgorithmConfig(lam=0.9, num_mini_batches=2, entropy_coef=0.01))
    config = TrainerConfig(role=role, model_path=str(model), algorithm=alg, **kwargs)  # type: ignore[arg-type]
    t = TorchTrainer(config, dp)
    # Plain SGD: the update is the gradient itself (Adam's first step is about lr * sign(g)).
    t.optimizer = torch.optim.SGD(t.params, lr=1.0)
    return t


def flat_weights(t: TorchTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in t.model.parameters()])


# ---------------------------------------------------------------------------------- layout


def test_pack_lays_samples_back_to_back_with_restarting_positions() -> None:
    samples = samples_of(5, seed=0)
    rows = [3, 0, 1]  # samples 0 and 1 have no response token
    assert samples.response_lengths[[0, 1]].tolist() == [0, 0]
    mb = packing.pack(samples, rows, torch.device("cpu"))
    lengths = [samples.tokens[i].numel() for i in rows]
    assert mb.input_ids.shape == (1, sum(lengths))
    assert torch.equal(mb.input_ids[0], torch.cat([samples.tokens[i] for i in rows]))
    assert mb.cu_seqlens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == max(lengths)
    assert torch.equal(mb.position_ids[0], torch.cat([torch.arange(n) for n in lengths]))
    # The output at response_index predicts the token right after it: the response token.
    assert torch.equal(mb.input_ids[0, mb.response_index + 1], mb.targets)
    assert mb.targets.numel() == int(samples.response_lengths[rows].sum())
    assert torch.equal(mb.response_slots, samples.response_mask[rows] > 0)
    flat = torch.arange(1.0, mb.targets.numel() + 1)
    out = mb.scatter(flat)
    assert out.shape == (3, samples.max_response)
    assert torch.equal(out[mb.response_slots], flat)
    assert not out[~mb.response_slots].any()


def test_block_causal_attention_is_causal_attention_per_sample() -> None:
    """Against the definition: softmax(q k^T scale) v over the same sample's earlier positions."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 3, 4, 9, 11], dtype=torch.int32)
    q = torch.randn(1, 6, 11, 8, generator=g)
    k, v = torch.randn(1, 2, 11, 8, generator=g), torch.randn(1, 2, 11, 8, generator=g)
    out = packing.block_causal_sdpa(q, k, v, cu, scale=0.3)
    sample = torch.tensor([0, 0, 0, 1, 2, 2, 2, 2, 2, 3, 3])
    position = torch.arange(11)
    allowed = (sample[:, None] == sample[None, :]) & (position[:, None] >= position[None, :])
    kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)  # 2 key-value heads for 6
    scores = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~allowed, float("-inf"))
    torch.testing.assert_close(out, torch.softmax(scores, dim=-1) @ vv, **CLOSE)


# ---------------------------------------------------------------------------------- packed vs padded


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_packed_log_probs_and_values_equal_the_padded_ones(gqa_model: Path, attention: str) -> None:
    samples = samples_of(7, seed=2)
    mask = samples.response_mask > 0
    kw = {"micro_batch_size": 3}
    padded_lp = trainer(gqa_model, **kw).compute_log_probs(samples)
    packed_lp = trainer(gqa_model, pack_sequences=True, packed_attention=attention, **kw).compute_log_probs(
        samples
    )
    torch.testing.assert_close(packed_lp[mask], padded_lp[mask], **CLOSE)
    assert not packed_lp[~mask].any()
    padded_v = trainer(gqa_model, "critic", **kw).compute_values(samples)
    packed_v = trainer(
        gqa_model, "critic", pack_sequences=True, packed_attention=attention, **kw
    ).compute_values(samples)
    torch.testing.assert_close(packed_v[mask], padded_v[mask], **CLOSE)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_packed_updates_equal_the_padded_ones(gqa_model: Path, role: str) -> None:
    """The same loss, entropy and metrics, and the same gradient (an SGD step of rate 1 is it)."""
    samples = samples_of(8, seed=3)
    values = torch.randn(len(samples), samples.max_response) * samples.response_mask
    results = []
    for pack in (False, True):
        t = trainer(gqa_model, role, micro_batch_size=3, pack_sequences=pack, logprob_chunk_tokens=5)
        metrics = t.train_critic(samples)[0] if role == "critic" else t.train_actor(samples, values)
        results.append((metrics, flat_weights(t)))
    (padded_m, padded_w), (packed_m, packed_w) = results
    assert set(packed_m) == set(padded_m)
    for key, value in padded_m.items():
        assert packed_m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(packed_w, padded_w, **CLOSE)


@pytest.mark.parametrize("pack", [False, True])
def test_token_budget_gives_the_gradient_of_one_big_batch(
    gqa_model: Path, pack: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = samples_of(8, seed=4)
    values = torch.randn(len(samples), samples.max_response) * samples.response_mask
    alg = AlgorithmConfig(
        lam=0.9, num_mini_batches=1, entropy_coef=0.01, loss_aggregation="seq_mean_token_mean"
    )
    whole = trainer(gqa_model, algorithm=alg, micro_batch_size=8, pack_sequences=pack)
    whole_m = whole.train_actor(samples, values)
    longest = max(t.numel() for t in samples.tokens)
    budget = trainer(gqa_model, algorithm=alg, max_tokens_per_micro_batch=longest + 3, pack_sequences=pack)
    seen: list[list[int]] = []
    split = objective.micro_batches_of

    def recorded(backend: Any, s: Samples, rows: Any) -> list[list[int]]:
        groups = split(backend, s, rows)
        seen.extend(groups)
        return groups

    monkeypatch.setattr(objective, "micro_batches_of", recorded)
    budget_m = budget.train_actor(samples, values)
    assert len(seen) >= 2 * 3  # old log-probs and the update, several micro-batches each
    torch.testing.assert_close(flat_weights(budget), flat_weights(whole), **CLOSE)
    for key in ("pg_loss", "entropy", "ppo_kl", "grad_norm"):
        assert budget_m[key] == pytest.approx(whole_m[key], rel=1e-5, abs=1e-6), key


def test_token_budget_micro_batches_fit_and_cover_the_mini_batch(gqa_model: Path) -> None:
    samples = samples_of(9, seed=5)
    lengths = [t.numel() for t in samples.tokens]
    for pack in (False, True):
        t = trainer(gqa_model, max_tokens_per_micro_batch=30, pack_sequences=pack)
        groups = objective.micro_batches_of(t, samples, range(9))
        assert sorted(r for g in groups for r in g) == list(range(9))
        for g in groups:
            tokens = len(g) * max(lengths[i] for i in g) if not pack else sum(lengths[i] for i in g)
            assert tokens <= 30
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=5"):
        trainer(gqa_model, max_tokens_per_micro_batch=5).compute_log_probs(samples)


def test_packed_fsdp2_trains_like_packed_replication(
    gqa_model: Path, one_rank_group: dist.ProcessGroup
) -> None:
    """FSDP gathers the root's parameters in the model's forward: the head that runs after it on the
    hidden states gets them, and their gradients reach the shards."""
    samples = samples_of(6, seed=6)
    alg = AlgorithmConfig(estimator="grpo", use_kl_loss=True, kl_loss_coef=0.1, num_mini_batches=1)
    kw = {"algorithm": alg, "pack_sequences": True, "max_tokens_per_micro_batch": 40}
    plain = trainer(gqa_model, **kw)
    sharded = trainer(gqa_model, dp=DataParallel(shard_group=lambda: one_rank_group), **kw)
    assert sharded.sharded
    m_plain, m_sharded = plain.train_actor(samples, None), sharded.train_actor(samples, None)
    for key in ("pg_loss", "kl_loss", "ref_kl", "grad_norm", "entropy"):
        assert m_sharded[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
    plain_weights = dict(plain.named_weights())
    for name, tensor in sharded.named_weights():
        torch.testing.assert_close(tensor, plain_weights[name], **CLOSE)


def test_packing_config_is_checked() -> None:
    megatron = {
        "role": "actor",
        "model_path": "m",
        "backend": "megatron",
        "device": "cuda",
        "pack_sequences": True,
    }
    assert TrainerConfig(**megatron).packed_attention == "varlen"  # megatron packs with its own varlen
    with pytest.raises(ValueError, match="packed_attention='sdpa' is a transformers attention"):
        TrainerConfig(**megatron, packed_attention="sdpa")
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        TrainerConfig(role="actor", model_path="m", max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="packed_attention"):
        TrainerConfig(role="actor", model_path="m", packed_attention="dense")  # type: ignore[arg-type]
    base = TrainerConfig(role="actor", model_path="m")
    assert (base.pack_sequences, base.max_tokens_per_micro_batch) == (False, None)
    assert dataclasses.replace(base, pack_sequences=True).packed_attention == "varlen"


def test_an_unpacked_call_through_the_packed_attention_is_plain_causal_attention(
    gqa_model: Path, fields_factory: Callable
) -> None:
    """A model switched to packed attention still serves padded (right-padded) batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gqa_model)
    ids = torch.randint(0, VOCAB, (2, 9))
    before = model(input_ids=ids).logits
    packing.use_attention(model, "varlen")
    assert model.config._attn_implementation == packing.VARLEN
    torch.testing.assert_close(model(input_ids=ids).logits, before, **CLOSE)
