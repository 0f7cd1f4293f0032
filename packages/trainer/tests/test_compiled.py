"""``train.compile_layers``: the decoder layers run through torch.compile and train as they do eagerly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_packing import flat_weights, gqa_model, samples_of, trainer  # noqa: F401  (gqa_model: a fixture)

from ppo_trainer import AlgorithmConfig, TrainerConfig
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.compiled import compile_decoder_layers
from ppo_trainer.sharding import decoder_blocks

# inductor's CPU code is C++: without a compiler the compiled calls cannot run (the option itself is
# checked by test_compile_layers_is_checked either way)
needs_cxx = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler for inductor's CPU code",
)


def is_compiled(layer: torch.nn.Module) -> bool:
    # nn.Module.compile keeps the module and routes its calls through this compiled wrapper
    return layer._compiled_call_impl is not None


@needs_cxx
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_compiled_layers_train_like_eager_ones(gqa_model: Path, role: str) -> None:  # noqa: F811
    """Same metrics and the same weights after a phase; the actor with a KL loss, so the reference
    (compiled too) takes part."""
    torch._dynamo.reset()
    samples = samples_of(6, seed=7)
    values = torch.randn(len(samples), samples.max_response) * samples.response_mask
    alg = AlgorithmConfig(lam=0.9, num_mini_batches=2, use_kl_loss=True, kl_loss_coef=0.1)
    results = []
    for compiled in (False, True):
        t = trainer(gqa_model, role, algorithm=alg, micro_batch_size=3, compile_layers=compiled)
        models = [t.model] + ([t.reference] if t.reference is not None else [])
        layers = [layer for m in models for layer in decoder_blocks(m)]
        assert len(layers) == 2 * len(models)
        assert all(is_compiled(layer) == compiled for layer in layers)
        metrics = t.train_critic(samples)[0] if role == "critic" else t.train_actor(samples, values)
        results.append((metrics, flat_weights(t)))
    (eager_m, eager_w), (compiled_m, compiled_w) = results
    assert role == "critic" or len(models) == 2  # the actor's reference was compiled too
    assert compiled_m.keys() == eager_m.keys()
    for key, value in eager_m.items():
        assert compiled_m[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    torch.testing.assert_close(compiled_w, eager_w, rtol=1e-4, atol=1e-5)


@needs_cxx
def test_compiled_layers_under_fsdp2_train_like_eager_replication(
    gqa_model: Path,  # noqa: F811
    one_rank_group: dist.ProcessGroup,
) -> None:
    """Compiled before sharding (as torchtitan orders it): FSDP2's hooks run around the compiled
    blocks, packed with a token budget, and the trained shards equal the eager replicated weights."""
    torch._dynamo.reset()
    samples = samples_of(6, seed=8)
    alg = AlgorithmConfig(estimator="grpo", num_mini_batches=1)
    kw = {"algorithm": alg, "pack_sequences": True, "max_tokens_per_micro_batch": 40}
    plain = trainer(gqa_model, **kw)
    sharded = trainer(
        gqa_model, dp=DataParallel(shard_group=lambda: one_rank_group), compile_layers=True, **kw
    )
    assert sharded.sharded
    layers = list(
        sharded.model.model.layers
    )  # FSDP2 renamed their classes: decoder_blocks no longer finds them
    assert len(layers) == 2
    assert all(is_compiled(layer) for layer in layers)
    m_plain, m_sharded = plain.train_actor(samples, None), sharded.train_actor(samples, None)
    for key in ("pg_loss", "grad_norm", "entropy"):
        assert m_sharded[key] == pytest.approx(m_plain[key], rel=1e-4, abs=1e-5), key
    plain_weights = dict(plain.named_weights())
    for name, tensor in sharded.named_weights():
        torch.testing.assert_close(tensor, plain_weights[name], rtol=1e-4, atol=1e-5)


def test_compile_layers_is_checked() -> None:
    with pytest.raises(ValueError, match="compile_layers=true is a torch-backend option"):
        TrainerConfig(role="actor", model_path="m", backend="megatron", device="cuda", compile_layers=True)
    assert TrainerConfig(role="actor", model_path="m").compile_layers is False
    with pytest.raises(ValueError, match="Linear has no decoder layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
