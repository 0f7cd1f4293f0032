"""``train.compile_layers``: the decoder layers run through torch.compile and train as they do eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_packing import flat_weights, gqa_model, samples_of, trainer  # noqa: F401  (gqa_model: a fixture)

from ppo_trainer import AlgorithmConfig, TrainerConfig
from ppo_trainer.compiled import compile_decoder_layers
from ppo_trainer.sharding import decoder_blocks


def is_compiled(layer: torch.nn.Module) -> bool:
    # nn.Module.compile keeps the module and routes its calls through this compiled wrapper
    return layer._compiled_call_impl is not None


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
        assert all(is_compiled(layer) == compiled for m in models for layer in decoder_blocks(m))
        metrics = t.train_critic(samples)[0] if role == "critic" else t.train_actor(samples, values)
        results.append((metrics, flat_weights(t)))
    (eager_m, eager_w), (compiled_m, compiled_w) = results
    assert role == "critic" or len(models) == 2  # the actor's reference was compiled too
    for key, value in eager_m.items():
        assert compiled_m[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    torch.testing.assert_close(compiled_w, eager_w, rtol=1e-4, atol=1e-5)


def test_compile_layers_is_checked() -> None:
    with pytest.raises(ValueError, match="compile_layers=true is a torch-backend option"):
        TrainerConfig(role="actor", model_path="m", backend="megatron", device="cuda", compile_layers=True)
    assert TrainerConfig(role="actor", model_path="m").compile_layers is False
    with pytest.raises(ValueError, match="Linear has no decoder layers"):
        compile_decoder_layers(torch.nn.Linear(2, 2))
