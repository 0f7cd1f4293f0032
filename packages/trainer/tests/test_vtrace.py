"""V-trace against DeepMind's reference recursion (scalable_agent ``vtrace.from_importance_weights``,
commit e331dc3140e5ef53e62ac753f56539db4c4430eb), re-stated here in plain Python on fixed inputs."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_trainer.ppo_math import compute_gae
from ppo_trainer.vtrace import compute_vtrace


def reference_vtrace(
    log_rhos: list[float],
    rewards: list[float],
    values: list[float],
    gamma: float,
    rho_bar: float,
    c_bar: float,
    lam: float,
) -> tuple[list[float], list[float]]:
    """One episode that ends after its last step (bootstrap value 0, discount gamma throughout), as the
    reference computes it: clipped rhos, cs = lam * min(c_bar, rho) (the reference's min(1, rho) when
    c_bar = lam = 1), deltas, the reverse scan ``acc = delta + discount * c * acc``, vs = acc + V, and
    the advantages ``min(rho_bar, rho) * (r + discount * vs_{t+1} - V)``."""
    n = len(rewards)
    rhos = [math.exp(x) for x in log_rhos]
    clipped = [min(rho_bar, r) for r in rhos]
    cs = [lam * min(c_bar, r) for r in rhos]
    values_next = [*values[1:], 0.0]
    deltas = [clipped[t] * (rewards[t] + gamma * values_next[t] - values[t]) for t in range(n)]
    acc, vs_minus_v = 0.0, [0.0] * n
    for t in reversed(range(n)):
        acc = deltas[t] + gamma * cs[t] * acc
        vs_minus_v[t] = acc
    vs = [a + v for a, v in zip(vs_minus_v, values, strict=True)]
    vs_next = [*vs[1:], 0.0]
    adv = [clipped[t] * (rewards[t] + gamma * vs_next[t] - values[t]) for t in range(n)]
    return vs, adv


LOG_RHOS = [0.3, -1.2, 0.05, 2.0, -0.4, 0.0]
REWARDS = [0.0, 0.1, 0.0, -0.2, 0.0, 1.0]
VALUES = [0.5, 0.4, -0.3, 0.2, 0.7, 0.1]


@pytest.mark.parametrize(
    ("gamma", "rho_bar", "c_bar", "lam"), [(1.0, 1.0, 1.0, 1.0), (0.9, 2.0, 1.0, 1.0), (0.99, 1.5, 0.8, 0.95)]
)
def test_vtrace_matches_the_reference_recursion(
    gamma: float, rho_bar: float, c_bar: float, lam: float
) -> None:
    vs, adv = reference_vtrace(LOG_RHOS, REWARDS, VALUES, gamma, rho_bar, c_bar, lam)
    row = lambda xs: torch.tensor([xs], dtype=torch.float64)  # noqa: E731
    out = compute_vtrace(
        row(REWARDS),
        row(VALUES),
        row(LOG_RHOS),
        torch.ones(1, 6),
        gamma=gamma,
        lam=lam,
        rho_bar=rho_bar,
        c_bar=c_bar,
    )
    assert out.vs[0].tolist() == pytest.approx(vs, abs=1e-6)
    assert out.pg_advantages[0].tolist() == pytest.approx(adv, abs=1e-6)


def test_masked_tokens_are_skipped_and_on_policy_vtrace_is_gae() -> None:
    # Two observation tokens in the middle and padding at the end change nothing of the others.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 1, 0]], dtype=torch.float32)
    spread = lambda xs: torch.tensor([[*xs[:2], 9.0, -9.0, *xs[2:], 5.0]])  # noqa: E731
    out = compute_vtrace(spread(REWARDS), spread(VALUES), spread(LOG_RHOS), mask, gamma=0.9, rho_bar=2.0)
    vs, adv = reference_vtrace(LOG_RHOS, REWARDS, VALUES, 0.9, 2.0, 1.0, 1.0)
    kept = mask[0] != 0
    assert out.vs[0][kept].tolist() == pytest.approx(vs, abs=1e-6)
    assert out.pg_advantages[0][kept].tolist() == pytest.approx(adv, abs=1e-6)
    assert out.vs[0][~kept].tolist() == [0.0, 0.0, 0.0]
    # rho = 1 everywhere: the value targets are GAE's returns at the same gamma and lambda.
    rewards, values = torch.tensor([REWARDS]), torch.tensor([VALUES])
    on_policy = compute_vtrace(rewards, values, torch.zeros(1, 6), torch.ones(1, 6), gamma=0.95, lam=0.9)
    _, returns = compute_gae(rewards, values, torch.ones(1, 6), gamma=0.95, lam=0.9)
    assert torch.allclose(on_policy.vs, returns, atol=1e-6)


def test_bad_shapes_and_bounds_name_the_argument() -> None:
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="same \\[batch, time\\] shape"):
        compute_vtrace(x, x, torch.zeros(1, 4), x, gamma=1.0)
    with pytest.raises(ValueError, match="rho_bar=0"):
        compute_vtrace(x, x, x, x, gamma=1.0, rho_bar=0)
