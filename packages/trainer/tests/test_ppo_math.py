"""PPO math against hand-computed values and plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer import ppo_math as pm

FLOATS = st.floats(-3.0, 3.0, allow_nan=False, width=32)


@st.composite
def gae_inputs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float]:
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 7))
    rewards = torch.tensor(draw(st.lists(FLOATS, min_size=b * t, max_size=b * t))).reshape(b, t)
    values = torch.tensor(draw(st.lists(FLOATS, min_size=b * t, max_size=b * t))).reshape(b, t)
    mask = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=b * t, max_size=b * t))).reshape(
        b, t
    )
    gamma = draw(st.floats(0.0, 1.0))
    lam = draw(st.floats(0.0, 1.0))
    return rewards, values, mask, gamma, lam


def gae_loop(rewards, values, mask, gamma, lam):  # type: ignore[no-untyped-def]
    """Per sample: keep the masked-in tokens, run the textbook recursion, scatter back."""
    adv = torch.zeros_like(rewards)
    ret = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        last = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_v = float(values[i, idx[k + 1]]) if k + 1 < len(idx) else 0.0
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
            ret[i, t] = last + float(values[i, t])
    return adv, ret


@settings(max_examples=60, deadline=None)
@given(gae_inputs())
def test_gae_matches_the_loop(inputs) -> None:  # type: ignore[no-untyped-def]
    rewards, values, mask, gamma, lam = inputs
    adv, ret = pm.compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret, ref_ret, atol=1e-4, rtol=1e-4)


def test_gae_hand_values() -> None:
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # trailing padding must not leak its value
    adv, ret = pm.compute_gae(r, v, m, gamma=0.9, lam=0.5)
    # delta2 = 1 - .7 = .3; delta1 = .9*.7 - .6 = .03; delta0 = .9*.6 - .5 = .04
    # A2 = .3; A1 = .03 + .45*.3 = .165; A0 = .04 + .45*.165 = .11425
    torch.testing.assert_close(adv, torch.tensor([[0.11425, 0.165, 0.3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.61425, 0.765, 1.0, 0.0]]))
    adv1, _ = pm.compute_gae(r, v, m, gamma=1.0, lam=1.0)  # Monte Carlo: reward-to-go minus value
    torch.testing.assert_close(adv1, torch.tensor([[0.5, 0.4, 0.3, 0.0]]))


def test_gae_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="same"):
        pm.compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


def test_token_rewards_puts_reward_on_last_token_and_kl_everywhere() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    kl = torch.full((2, 5), 0.5)
    out = pm.token_rewards(torch.tensor([2.0, 3.0]), mask, kl, kl_coef=0.1)
    expected = torch.tensor([[-0.05, -0.05, 0.0, 1.95, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(out, expected)


def test_kl_estimators_hand_values() -> None:
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # d = 1
    assert pm.kl_estimate(logp, ref, "k1").item() == pytest.approx(1.0)
    assert pm.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5)
    assert pm.kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-1) - 1 + 1)
    assert pm.kl_estimate(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-1))
    assert pm.kl_estimate(ref, logp, "abs").item() == pytest.approx(1.0)
    for kind in ("k3", "low_var_kl"):  # one estimator, two names: both clamped
        far = pm.kl_estimate(torch.tensor([-40.0]), torch.tensor([0.0]), kind)  # type: ignore[arg-type]
        assert far.item() == pytest.approx(10.0)  # unclamped it would be e^40
    with pytest.raises(ValueError, match="KL estimator"):
        pm.kl_estimate(logp, ref, "k9")  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None)
@given(st.floats(-4, 4), st.floats(-4, 4))
def test_kl_estimators_are_consistent(logp: float, ref: float) -> None:
    a, b = torch.tensor([logp]), torch.tensor([ref])
    assert pm.kl_estimate(a, b, "k3").item() >= -1e-6  # k3 is never negative
    assert pm.kl_estimate(a, b, "k2").item() == pytest.approx(0.5 * (logp - ref) ** 2, rel=1e-4, abs=1e-5)


def policy_loss_scalar(logp, old, adv, lo, hi, c):  # type: ignore[no-untyped-def]
    ratio = math.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - lo), 1 + hi)
    loss = max(unclipped, clipped)
    if c is not None and adv < 0:
        loss = min(loss, -adv * c)
    return loss, float(clipped > unclipped)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-2, 0), st.floats(-2, 0), st.floats(-3, 3).filter(lambda a: abs(a) > 1e-3)),
        min_size=1,
        max_size=12,
    ),
    st.floats(0.05, 0.5),
    st.floats(0.05, 0.6),
    st.one_of(st.none(), st.floats(1.5, 5.0)),
)
def test_policy_loss_matches_scalar_formula(rows, lo, hi, c) -> None:  # type: ignore[no-untyped-def]
    logp = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    old = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    adv = torch.tensor([r[2] for r in rows], dtype=torch.float64)
    terms = pm.policy_loss(logp, old, adv, lo, hi, c)
    for i, (lp, o, a) in enumerate(rows):
        loss, clipped = policy_loss_scalar(lp, o, a, lo, hi, c)
        assert terms.loss[i].item() == pytest.approx(loss, rel=1e-4, abs=1e-5)
        assert terms.clip_fraction[i].item() == clipped


def test_policy_loss_hand_values() -> None:
    log = torch.log
    logp = log(torch.tensor([1.5, 1.5, 4.0, 0.5]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    t = pm.policy_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    # ratio 1.5, A=+1: max(-1.5, -1.28) = -1.28 (clipped high)
    # ratio 1.5, A=-1: max(1.5, 1.28) = 1.5
    # ratio 4.0, A=-1: max(4, 1.28) = 4, dual clip min(4, 3) = 3
    # ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5
    torch.testing.assert_close(t.loss, torch.tensor([-1.28, 1.5, 3.0, -0.5]))
    torch.testing.assert_close(t.clip_fraction, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(t.dual_clip_fraction, torch.tensor([0.0, 0.0, 1.0, 0.0]))
    r = torch.tensor([1.5, 1.5, 4.0, 0.5])
    torch.testing.assert_close(t.ppo_kl, -torch.log(r))  # k1 of KL(old || new)
    with pytest.raises(ValueError, match="eps_clip_c"):
        pm.policy_loss(logp, old, adv, 0.2, None, 1.0)


def test_value_loss_hand_values() -> None:
    values = torch.tensor([1.0, 0.0, 0.5])
    old = torch.tensor([0.5, 0.0, 0.4])
    returns = torch.tensor([0.0, 1.0, 0.5])
    loss, clipfrac = pm.value_loss(values, old, returns, value_clip=0.2)
    # 1: clipped 0.7 -> max((1-0)^2, (0.7-0)^2)/2 = 0.5;   2: 0.5 * 1 = 0.5;
    # 3: |0.1| <= 0.2, unclipped = clipped = 0.5 -> 0
    torch.testing.assert_close(loss, torch.tensor([0.5, 0.5, 0.0]))
    # 1 moved 0.5 > 0.2 from V_old, away from the return: the unclipped branch (1.0) wins over the
    # clipped one (0.49), so the clip does not decide this token's loss and is not counted.
    torch.testing.assert_close(clipfrac, torch.tensor([0.0, 0.0, 0.0]))
    # the clipped branch wins when it is farther from the return: the clip decides the loss
    loss2, clip2 = pm.value_loss(torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([1.0]), 0.2)
    torch.testing.assert_close(loss2, torch.tensor([0.5 * 0.8**2]))
    torch.testing.assert_close(clip2, torch.tensor([1.0]))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(2, 9), st.integers(0, 10_000))
def test_entropy_and_log_probs_match_torch(b: int, v: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, 4, v, generator=g) * 3
    targets = torch.randint(0, v, (b, 4), generator=g)
    dist = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(pm.entropy_from_logits(logits), dist.entropy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        pm.log_probs_from_logits(logits, targets), dist.log_prob(targets), atol=1e-5, rtol=1e-5
    )


def test_whiten_over_masked_tokens() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    w = pm.whiten(x, m)
    kept = w[m > 0]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert kept.pow(2).mean().item() == pytest.approx(1.0, abs=1e-5)  # population variance 1
    assert w[m == 0].abs().sum().item() == 0.0
    torch.testing.assert_close(kept, (torch.tensor([1.0, 2.0, 3.0, 4.0]) - 2.5) / math.sqrt(1.25 + 1e-8))


def test_whiten_all_reduce_sees_the_statistics() -> None:
    """Two 'ranks' holding the same data: summed statistics give the same result as one rank."""
    x = torch.tensor([[1.0, 5.0, 2.0]])
    m = torch.ones(1, 3)
    calls: list[torch.Tensor] = []

    def doubled(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.clone())
        return 2 * t

    torch.testing.assert_close(pm.whiten(x, m, doubled), pm.whiten(x, m))
    assert len(calls) == 2  # sum and count, then squared deviations


def test_grpo_advantages_hand_values() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3])
    groups = torch.tensor([7, 7, 2, 2, 9])
    adv = pm.grpo_advantages(rewards, groups, eps=1e-6)
    s = 1 / math.sqrt(2)  # unbiased std of {1, 0}
    torch.testing.assert_close(adv[:2], torch.tensor([0.5 / (s + 1e-6), -0.5 / (s + 1e-6)]))
    assert torch.isfinite(adv).all()
    assert adv[2:4].abs().sum().item() == 0.0  # equal rewards give no signal
    assert adv[4].item() == pytest.approx(0.3 / (1 + 1e-6))  # a single sample: mean 0, std 1 (verl)
    centred = pm.grpo_advantages(rewards, groups, norm_by_std=False)  # Dr. GRPO
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, 0.0, 0.0, 0.3]))
    with pytest.raises(ValueError, match="group_ids"):
        pm.grpo_advantages(rewards, groups[:3])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-2, 2)), min_size=1, max_size=20))
def test_grpo_matches_per_group_loop(rows) -> None:  # type: ignore[no-untyped-def]
    groups = torch.tensor([g for g, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=torch.float32)
    adv = pm.grpo_advantages(rewards, groups)
    for i, (g, r) in enumerate(rows):
        members = torch.tensor([rr for gg, rr in rows if gg == g], dtype=torch.float32)
        expected = (
            r / (1 + 1e-6) if len(members) == 1 else float((r - members.mean()) / (members.std() + 1e-6))
        )
        assert adv[i].item() == pytest.approx(expected, rel=1e-3, abs=1e-3)


def test_aggregation_modes_hand_values() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert pm.aggregate(loss, mask, "token_mean").item() == pytest.approx(10.0 / 4)
    assert pm.aggregate(loss, mask, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert pm.aggregate(loss, mask, "seq_mean_token_sum").item() == pytest.approx((6.0 + 4.0) / 2)
    norm = pm.aggregate(loss, mask, "seq_mean_token_sum_norm", scale=5.0)
    assert norm.item() == pytest.approx((6.0 / 5 + 4.0 / 5) / 2)
    assert pm.aggregation_denominator(mask, "token_mean").item() == 4.0
    for mode in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        assert pm.aggregation_denominator(mask, mode).item() == 2.0  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        pm.aggregate(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="aggregation"):
        pm.aggregate(loss, mask, "sum")  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 8),
    st.integers(1, 5),
    st.integers(1, 4),
    st.sampled_from(pm.LOSS_AGGREGATIONS),
    st.integers(0, 1000),
)
def test_split_aggregation_with_global_denominator_equals_whole(n, t, parts, mode, seed) -> None:  # type: ignore[no-untyped-def]
    """Summing micro-batch losses divided by the global count is the whole-batch mean (the DP rule)."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(n, t, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.3).float()
    whole = pm.aggregate(loss, mask, mode, scale=7.0)
    denominator = pm.aggregation_denominator(mask, mode).clamp(min=1.0)
    pieces = torch.tensor_split(torch.arange(n), parts)
    split = sum(pm.aggregate(loss[p], mask[p], mode, denominator, scale=7.0) for p in pieces if len(p))
    assert float(split) == pytest.approx(float(whole), rel=1e-5, abs=1e-6)
