"""The phase's model FLOPs: matmul parameters (a lookup embedding left out, a tied one counted once),
the passes a role's train call makes, and the metrics' units."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_llama
from transformers import AutoModel, AutoModelForCausalLM

from ppo_trainer import AlgorithmConfig, TrainerConfig
from ppo_trainer.throughput import PhaseCost, PhaseMeter, matmul_limit, matmul_parameters

VOCAB, HIDDEN = 16, 32


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_parameters_leave_out_a_lookup_only_embedding(tmp_path: Path, tied: bool) -> None:
    folder = save_tiny_llama(tmp_path, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    embedding = VOCAB * HIDDEN
    # Untied: the input embedding is a lookup, the head a matmul. Tied: the one weight is the head's.
    assert matmul_parameters(model) == (total - embedding if not tied else total)
    backbone = AutoModel.from_pretrained(folder)
    assert matmul_parameters(backbone) == sum(p.numel() for p in backbone.parameters()) - embedding


def cost(model: Path, role: str, alg: AlgorithmConfig) -> PhaseCost:
    return PhaseCost.for_config(TrainerConfig(role=role, model_path=str(model), algorithm=alg))  # type: ignore[arg-type]


def test_phase_cost_counts_each_pass_of_a_train_call(tiny_model: Path) -> None:
    policy = matmul_parameters(AutoModelForCausalLM.from_pretrained(tiny_model))
    backbone = matmul_parameters(AutoModel.from_pretrained(tiny_model))
    plain = AlgorithmConfig(ppo_epochs=2)
    actor = cost(tiny_model, "actor", plain)
    assert actor == PhaseCost(trained=policy, reference=0, epochs=2)
    # One no-grad forward (old log-probs) and two forward-and-backward passes.
    assert actor.flops(10) == 10 * (2 * policy + 2 * 6 * policy)
    kl_loss = AlgorithmConfig(estimator="grpo", use_kl_loss=True, kl_loss_coef=0.1)
    with_ref = PhaseCost.for_config(
        TrainerConfig(role="actor", model_path=str(tiny_model), algorithm=kl_loss)
    )
    assert with_ref.reference == policy
    kl_reward = AlgorithmConfig(kl_coef=0.1)
    critic = PhaseCost.for_config(
        TrainerConfig(role="critic", model_path=str(tiny_model), algorithm=kl_reward)
    )
    assert critic == PhaseCost(trained=backbone + HIDDEN + 1, reference=policy, epochs=1)


def test_phase_meter_reports_tflops_and_tokens_per_second() -> None:
    meter = PhaseMeter(torch.device("cpu"))
    meter.start -= 2.0  # as if the phase took two seconds (and a half of them was not compute)
    out = meter.metrics(4e12, tokens=1000, excluded_s=1.0)
    assert set(out) == {"tflops", "tokens_per_s"}  # peak memory on CUDA only
    assert out["tflops"] == pytest.approx(4.0, rel=0.01)
    assert out["tokens_per_s"] == pytest.approx(1000.0, rel=0.01)


def test_matmul_limit_times_a_float32_matmul_on_the_cpu() -> None:
    tflops, what = matmul_limit(torch.device("cpu"))
    assert what == "2048^3 float32 matmul"
    assert 1e-4 < tflops < 100  # any CPU: from a slow core to a many-core server
