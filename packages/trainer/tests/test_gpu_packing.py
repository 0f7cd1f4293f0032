"""GPU: packed sequences against the padded path in bf16 (SmolLM2-135M's layout, fewer layers).

Packed and padded forwards round differently in bf16 (another attention kernel, other matmul
shapes), so they are compared with stated tolerances, over tokens whose log-probs are about -10.8
(a random model over a 49 152-token vocabulary): log-probs and values within 0.05 on average and
0.5 at worst, and an update whose direction agrees (cosine similarity of the two SGD updates of
at least 0.99). The float32 CPU tests (test_packing.py) check the same paths at 1e-6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_fields

from ppo_trainer import AlgorithmConfig, TrainerConfig
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

VOCAB = 49152


@pytest.fixture(scope="module")
def smol_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("smol")
    LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ).save_pretrained(folder)  # config only: every trainer makes the same weights from the seed
    return folder


def samples_of(n: int, seed: int = 0) -> Samples:
    """Prompts of 20-119 tokens, responses of 1-79, over the whole vocabulary."""
    return Samples.from_fields(
        make_fields(
            n, seed, samples_per_prompt=4, vocab=VOCAB, prompt_tokens=(20, 119), response_tokens=(1, 79)
        )
    )


def make(model: Path, role: str, **kwargs: object) -> TorchTrainer:
    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        algorithm=AlgorithmConfig(num_mini_batches=1, entropy_coef=0.01),
        device="cuda",
        **kwargs,  # type: ignore[arg-type]
    )
    return TorchTrainer(config)


PACKED = [
    {"pack_sequences": True, "packed_attention": "varlen", "max_tokens_per_micro_batch": 4096},
    {"pack_sequences": True, "packed_attention": "sdpa", "max_tokens_per_micro_batch": 4096},
    {"pack_sequences": True, "packed_attention": "flex_attention", "micro_batch_size": 16},
]


def assert_near(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor, what: str) -> None:
    diff = (got - want)[mask].abs()
    assert diff.mean() < 0.05, f"{what}: mean |diff| {diff.mean():.4f}"
    assert diff.max() < 0.5, f"{what}: max |diff| {diff.max():.4f}"


@pytest.mark.parametrize("settings", PACKED, ids=lambda s: str(s["packed_attention"]))
def test_packed_log_probs_and_values_match_padded_in_bf16(smol_model: Path, settings: dict) -> None:
    samples = samples_of(48)
    mask = samples.response_mask > 0
    padded = make(smol_model, "actor", micro_batch_size=16)
    packed = make(smol_model, "actor", **settings)
    assert_near(packed.compute_log_probs(samples), padded.compute_log_probs(samples), mask, "log-probs")
    padded_v = make(smol_model, "critic", micro_batch_size=16).compute_values(samples)
    packed_v = make(smol_model, "critic", **settings).compute_values(samples)
    assert_near(packed_v, padded_v, mask, "values")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_packed_update_matches_padded_in_bf16_with_less_memory(smol_model: Path, role: str) -> None:
    samples = samples_of(64, seed=1)
    values = torch.randn(len(samples), samples.max_response) * samples.response_mask
    updates, losses, peaks = [], [], []
    for settings in ({"micro_batch_size": 16}, PACKED[0]):
        t = make(smol_model, role, **settings)
        t.optimizer = torch.optim.SGD(t.params, lr=1.0)
        before = torch.cat([p.detach().reshape(-1).clone() for p in t.params])
        torch.cuda.reset_peak_memory_stats()
        metrics = t.train_critic(samples)[0] if role == "critic" else t.train_actor(samples, values)
        peaks.append(torch.cuda.max_memory_allocated())
        losses.append(metrics["value_loss" if role == "critic" else "pg_loss"])
        updates.append(torch.cat([p.detach().reshape(-1) for p in t.params]) - before)
        del t
        torch.cuda.empty_cache()
    cosine = torch.nn.functional.cosine_similarity(updates[0], updates[1], dim=0)
    assert cosine > 0.99, f"{role}: cosine similarity of the updates {cosine:.4f}"
    assert losses[1] == pytest.approx(losses[0], rel=0.02, abs=1e-3)
    if role == "actor":
        # Padded holds [b, L, 49152] bf16 logits and their gradient; packed one chunk's.
        assert peaks[1] < peaks[0], (
            f"peak memory packed {peaks[1] / 1e9:.2f} GB, padded {peaks[0] / 1e9:.2f} GB"
        )


def test_varlen_runs_the_flash_kernel_under_autocast_with_float32_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The torch backend's float32 master weights hand attention a float32 query under bf16 autocast;
    varlen must still take the flash kernel (the per-sample SDPA fallback is 7x slower at 135M), in
    autocast's dtype, and agree with the per-sample causal SDPA in float32 within bf16 rounding."""
    from ppo_trainer import packing

    def no_fallback(*args: object) -> torch.Tensor:
        raise AssertionError("varlen fell back to one SDPA call per sample")

    generator = torch.Generator().manual_seed(0)
    lengths = [17, 80, 3, 41]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 9, sum(lengths), 64, generator=generator).cuda()
    k, v = (torch.randn(1, 3, sum(lengths), 64, generator=generator).cuda() for _ in range(2))
    expected = packing.block_causal_sdpa(q, k, v, cu, 0.125).transpose(1, 2)
    monkeypatch.setattr(packing, "block_causal_sdpa", no_fallback)
    longest = max(lengths)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = packing.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.125, **kwargs)
    assert out.dtype == torch.bfloat16
    assert out.shape == expected.shape
    assert (out.float() - expected).abs().max().item() < 2e-2
    assert packing._flash_dtype(q) is None  # outside autocast, a float32 query has no flash kernel
