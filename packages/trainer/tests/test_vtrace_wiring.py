"""``algorithm.off_policy_returns: vtrace`` wired into training: the critic's targets and the actor's
advantages are V-trace's over the trainer's log-probs and the critic's values of the step, its
importance weights are reported, and the settings that cannot go with it are refused.

The recursion itself is checked against DeepMind's reference in ``test_vtrace.py``, whose plain-Python
re-statement (``reference_vtrace``) gives the expected numbers here.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_vtrace import LOG_RHOS, REWARDS, VALUES, reference_vtrace

from ppo_trainer import estimators, objective
from ppo_trainer import ppo_math as pm
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.vtrace import compute_vtrace

# Row 0: the reference's six tokens with an observation token after the second and one at the end.
# Row 1: the first four tokens in reverse order, then padding.
MASK = [[1, 1, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0, 0, 0]]
ROW1 = slice(3, None, -1)


def _spread(xs: list[float], fill: float) -> list[float]:
    return [*xs[:2], fill, *xs[2:], fill]


def _row1(xs: list[float]) -> list[float]:
    return [*xs[ROW1], 0.0, 0.0, 0.0, 0.0]


def _table(xs: list[float], fill: float) -> torch.Tensor:
    return torch.tensor([_spread(xs, fill), _row1(xs)])


def _samples() -> Samples:
    """Two samples whose behaviour log-probs are -1 on every token (the ratios are the log-probs')."""
    lengths = [8, 4]
    return Samples.from_fields(
        {
            "tokens": [torch.arange(n + 3) % 7 for n in lengths],
            "response_length": [torch.tensor([n]) for n in lengths],
            "loss_mask": [
                torch.tensor(m[:n], dtype=torch.float32) for m, n in zip(MASK, lengths, strict=True)
            ],
            "reward": [torch.tensor([0.0])] * 2,
            "rollout_log_probs": [torch.full((n,), -1.0) for n in lengths],
            "prompt_index": [torch.tensor([0]), torch.tensor([1])],
        }
    )


def _vtrace_alg(**overrides: object) -> AlgorithmConfig:
    settings: dict[str, object] = {
        "off_policy_returns": "vtrace",
        "gamma": 0.9,
        "lam": 1.0,
        "vtrace_rho_bar": 2.0,
        "normalize_advantages": False,
    }
    return AlgorithmConfig(**{**settings, **overrides})  # type: ignore[arg-type]


def test_the_wiring_gives_the_reference_vtrace_targets_and_advantages() -> None:
    samples = _samples()
    log_probs = _table([x - 1.0 for x in LOG_RHOS], 9.0)  # the observation tokens' 9.0 must not count
    rewards, values = _table(REWARDS, 0.0), _table(VALUES, -5.0)
    alg = _vtrace_alg()
    advantages, metrics = objective.advantages_of(alg, DataParallel(), samples, values, rewards, log_probs)
    _, returns = estimators.advantages_and_returns(alg, rewards, values, samples, log_probs)

    kept = samples.loss_mask != 0
    for row, pick in ((0, list), (1, lambda xs: list(xs[ROW1]))):
        vs, adv = reference_vtrace(pick(LOG_RHOS), pick(REWARDS), pick(VALUES), 0.9, 2.0, 1.0, 1.0)
        assert returns[row][kept[row]].tolist() == pytest.approx(vs, abs=1e-6)
        assert advantages[row][kept[row]].tolist() == pytest.approx(adv, abs=1e-6)
    assert torch.all(advantages[~kept] == 0)
    assert torch.all(returns[~kept] == 0)

    # The weights over the ten generated tokens: rho = exp(log-ratio), the traces lam * min(c_bar, rho).
    rhos = [math.exp(x) for x in [*LOG_RHOS, *LOG_RHOS[ROW1]]]
    assert metrics["vtrace_rho_mean"] == pytest.approx(sum(rhos) / 10, rel=1e-6)
    assert metrics["vtrace_rho_max"] == pytest.approx(math.exp(2.0), rel=1e-6)
    assert metrics["vtrace_rho_clipped_fraction"] == pytest.approx(2 / 10)  # e^2 > rho_bar, in both rows
    assert metrics["vtrace_c_mean"] == pytest.approx(sum(min(1.0, r) for r in rhos) / 10, rel=1e-6)
    assert metrics["vtrace_c_max"] == pytest.approx(1.0)
    assert metrics["vtrace_c_clipped_fraction"] == pytest.approx(6 / 10)  # 0.3, 0.05 and 2.0, twice


def test_on_policy_vtrace_trains_on_gae_with_lambda_one() -> None:
    """Ratios of 1 (the trainer's log-probs are the rollout's) and lam = 1: the advantages the actor
    trains on, whitened as usual, are GAE's; the critic's targets are GAE's returns."""
    samples = _samples()
    rewards, values = _table(REWARDS, 0.0), _table(VALUES, -5.0)
    on_policy = samples.rollout_log_probs
    vtrace_alg = AlgorithmConfig(off_policy_returns="vtrace", gamma=0.95, lam=1.0)
    gae_alg = AlgorithmConfig(gamma=0.95, lam=1.0)
    got, metrics = objective.advantages_of(vtrace_alg, DataParallel(), samples, values, rewards, on_policy)
    want, _ = objective.advantages_of(gae_alg, DataParallel(), samples, values, rewards, on_policy)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    _, returns = estimators.advantages_and_returns(vtrace_alg, rewards, values, samples, on_policy)
    _, gae_returns = pm.compute_gae(rewards, values, samples.loss_mask, 0.95, 1.0)
    torch.testing.assert_close(returns, gae_returns, atol=1e-6, rtol=0)
    weights = {k.removeprefix("vtrace_"): v for k, v in metrics.items() if k.startswith("vtrace_")}
    assert weights == {
        "rho_mean": 1.0,
        "rho_max": 1.0,
        "rho_clipped_fraction": 0.0,
        "c_mean": 1.0,
        "c_max": 1.0,
        "c_clipped_fraction": 0.0,
    }
    _, gae_metrics = objective.advantages_of(gae_alg, DataParallel(), samples, values, rewards)
    assert not [k for k in gae_metrics if k.startswith("vtrace_")]


def _trainer(model: Path, role: str, alg: AlgorithmConfig) -> TorchTrainer:
    return TorchTrainer(TrainerConfig(role=role, model_path=str(model), algorithm=alg, micro_batch_size=3))  # type: ignore[arg-type]


def _off_policy(samples: Samples) -> torch.Tensor:
    """Log-probs the rollout did not have: its own, moved by up to +-1 per token."""
    shift = torch.rand(samples.rollout_log_probs.shape, generator=torch.Generator().manual_seed(5)) * 2 - 1
    return samples.rollout_log_probs + shift * samples.response_mask


def test_the_critic_regresses_on_vtrace_targets_of_its_own_values(tiny_model: Path, fields_factory) -> None:  # type: ignore[no-untyped-def]
    samples = Samples.from_fields(fields_factory(6, seed=2))
    alg = _vtrace_alg(lam=0.9, vtrace_rho_bar=1.0, num_mini_batches=1)
    critic = _trainer(tiny_model, "critic", alg)
    policy = _off_policy(samples)
    values = critic.compute_values(samples)  # the critic at training time, as train_critic scores it
    rewards = pm.token_rewards(samples.reward, samples.loss_mask)
    mask = samples.loss_mask
    log_rhos = policy - samples.rollout_log_probs
    vs = compute_vtrace(rewards, values, log_rhos, mask, gamma=0.9, lam=0.9).vs
    _, gae_returns = pm.compute_gae(rewards, values, mask, 0.9, 0.9)

    metrics, old_values, _ = critic.train_critic(samples, policy)
    torch.testing.assert_close(old_values, values)
    expected = float((vs * mask).sum() / mask.sum())
    assert metrics["returns_mean"] == pytest.approx(expected, abs=1e-5)
    assert abs(expected - float((gae_returns * mask).sum() / mask.sum())) > 1e-3  # V-trace, not GAE
    rhos = torch.exp(log_rhos)[mask != 0]
    assert metrics["vtrace_rho_mean"] == pytest.approx(float(rhos.mean()), rel=1e-5)
    assert metrics["vtrace_rho_clipped_fraction"] == pytest.approx(float((rhos > 1.0).float().mean()))
    with pytest.raises(ValueError, match=r"off_policy_returns='vtrace' needs the trainer's log-probs"):
        critic.train_critic(samples)


def test_the_actor_weighs_by_its_own_log_probs_before_the_update(tiny_model: Path, fields_factory) -> None:  # type: ignore[no-untyped-def]
    samples = Samples.from_fields(fields_factory(6, seed=4))
    actor = _trainer(tiny_model, "actor", _vtrace_alg(num_mini_batches=1))
    before = actor.compute_log_probs(samples)
    values = torch.zeros(len(samples), samples.max_response)
    metrics = actor.train_actor(samples, values)
    rhos = torch.exp(before - samples.rollout_log_probs)[samples.loss_mask != 0]
    assert metrics["vtrace_rho_mean"] == pytest.approx(float(rhos.mean()), rel=1e-5)
    assert metrics["vtrace_rho_max"] == pytest.approx(float(rhos.max()), rel=1e-5)
    assert "tis_weight_mean" not in metrics


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"estimator": "grpo"},
            "algorithm.off_policy_returns='vtrace' corrects a critic's returns and "
            "algorithm.estimator='grpo' has no critic; set algorithm.off_policy_returns=none",
        ),
        ({"estimator": "rloo"}, "algorithm.estimator='rloo' has no critic"),
        ({"tis_cap": 2.0}, "would apply it twice: remove it"),
        ({"rollout_correction": {"weight": "token"}}, r"algorithm.tis_cap or rollout_correction.weight"),
        ({"gae_unit": "turn"}, "remove algorithm.gae_unit / gae_through_observations"),
        ({"off_policy_returns": "none", "vtrace_c_bar": 2.0}, "apply to algorithm.off_policy_returns="),
        ({"vtrace_rho_bar": 0.0}, "vtrace_rho_bar"),
        ({"off_policy_returns": "retrace"}, "off_policy_returns"),
    ],
)
def test_settings_that_cannot_go_with_vtrace_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**{"off_policy_returns": "vtrace", **settings})  # type: ignore[arg-type]


def test_vtrace_keeps_rejection_and_the_default_changes_nothing() -> None:
    alg = AlgorithmConfig(off_policy_returns="vtrace", rollout_correction={"reject": "token"})  # type: ignore[arg-type]
    assert alg.correction.reject == "token"
    assert AlgorithmConfig().off_policy_returns == "none"
    assert (AlgorithmConfig().vtrace_rho_bar, AlgorithmConfig().vtrace_c_bar) == (1.0, 1.0)
