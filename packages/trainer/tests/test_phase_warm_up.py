"""The start-up warm-up of a train phase (``ppo_trainer.warm_up``): it runs the role's phase on a
dummy batch and undoes it, so that the first real step computes exactly what it computes unwarmed."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.warm_up import dummy_samples, warm_up


def _trainer(model: Path, role: str, estimator: str = "ppo") -> TorchTrainer:
    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        algorithm=AlgorithmConfig(estimator=estimator, lam=1.0, num_mini_batches=2),  # type: ignore[arg-type]
        actor_lr=1e-2,
        critic_lr=1e-2,
        micro_batch_size=2,
        seed=7,
    )
    return TorchTrainer(config)


def _first_step(t: TorchTrainer, samples: Samples, values: torch.Tensor | None) -> dict[str, float]:
    t.set_step(1)
    if t.config.role == "critic":
        metrics, _, _ = t.train_critic(samples)
        return metrics
    return t.train_actor(samples, values, None if values is None else torch.zeros_like(values))


@pytest.mark.parametrize(("role", "estimator"), [("actor", "ppo"), ("actor", "grpo"), ("critic", "ppo")])
def test_the_first_step_after_warm_up_equals_the_unwarmed_one_bit_for_bit(
    tiny_model: Path, fields_factory: Callable, role: str, estimator: str
) -> None:
    samples = Samples.from_fields(fields_factory(6, seed=11))
    values = torch.linspace(-1, 1, samples.max_response).expand(len(samples), -1).contiguous()
    values = values if role == "actor" and estimator == "ppo" else None

    plain = _trainer(tiny_model, role, estimator)
    torch.manual_seed(5)
    expected = _first_step(plain, samples, values)

    warmed = _trainer(tiny_model, role, estimator)
    torch.manual_seed(5)
    random.seed(3)
    np.random.seed(3)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    seconds = warm_up(warmed, dummy_samples(4, 3, 5), uses_critic=values is not None)
    assert seconds is not None
    assert seconds > 0
    # Nothing the step reads changed: the random state, the gradients, the optimizer, the weights.
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    assert np.array_equal(np.random.get_state()[1], before[2])
    for entries in warmed.optimizer.state.values():  # zeros and step 0, as set up
        assert all(not v.any() for v in entries.values())
    assert all(p.grad is None for p in warmed.params)
    for a, b in zip(warmed.params, plain.params, strict=True):
        assert a.shape == b.shape
    torch.manual_seed(5)
    got = _first_step(warmed, samples, values)

    assert got == expected  # every metric, bit for bit
    for a, b in zip(warmed.params, plain.params, strict=True):
        assert torch.equal(a, b)
    got_state, expected_state = warmed.optimizer.state_dict(), plain.optimizer.state_dict()
    assert got_state["state"].keys() == expected_state["state"].keys()
    for key, entries in got_state["state"].items():
        assert all(torch.equal(v, expected_state["state"][key][k]) for k, v in entries.items())


def test_a_trainer_holding_optimizer_state_is_not_warmed(tiny_model: Path, fields_factory: Callable) -> None:
    t = _trainer(tiny_model, "critic")
    _first_step(t, Samples.from_fields(fields_factory(4, seed=1)), None)
    weights = [p.detach().clone() for p in t.params]
    assert warm_up(t, dummy_samples(4, 3, 5), uses_critic=False) is None
    assert all(torch.equal(a, b) for a, b in zip(t.params, weights, strict=True))


def test_a_warm_up_batch_needs_positive_sizes() -> None:
    with pytest.raises(ValueError, match="response_tokens >= 1"):
        dummy_samples(4, 3, 0)
