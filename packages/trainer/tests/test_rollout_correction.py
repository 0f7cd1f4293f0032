"""Rollout-trainer mismatch: its metrics and ``algorithm.rollout_correction`` (importance weights at token,
sequence and geometric-mean level, truncated or clipped; rejection, i.e. masked importance sampling; IcePop)
against the references' published formulas, each re-stated here in this file's own code, as read at:

- verl: https://github.com/volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7,
  ``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights`` (``rollout_is``
  token / sequence, ``rollout_is_threshold``), ``compute_rollout_rejection_mask`` (``token_k1``,
  ``seq_sum_k1``, ``seq_mean_k1``) and ``compute_offpolicy_metrics`` (``kl``, ``k3_kl``);
  ``docs/algo/rollout_corr.md``.
- slime: https://github.com/THUDM/slime, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515,
  ``examples/train_infer_mismatch_helper/mis.py``: ``compute_mis_weights`` (``tis_level`` token /
  sequence / geometric, ``tis_mode`` truncate / clip / mask).
- OpenRLHF: https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
  ``openrlhf/models/loss.py``: ``PolicyLoss.forward``'s ``vllm_is_correction_type`` tis / icepop /
  seq-mask-tis.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer import ppo_math as pm
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, RolloutCorrection, TrainerConfig

ATOL = 1e-5
SAFETY_BOUND = 20.0


# ---------------------------------------------------------------------------------- references
def verl_is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float
) -> torch.Tensor:
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    else:
        total = (log_ratio * mask).sum(dim=-1, keepdim=True)
        w = torch.exp(torch.clamp(total, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    return (w * mask).clamp(max=threshold)


def verl_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, option: str, lower: float, upper: float):  # type: ignore[no-untyped-def]
    """token_k1 / seq_sum_k1 / seq_mean_k1 keep where log(lower) <= k1 stat <= log(upper), with
    k1 = -log_ratio = log(pi_rollout / pi_old)."""
    k1 = -torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    lo, hi = torch.log(torch.tensor(lower)), torch.log(torch.tensor(upper))
    if option == "token_k1":
        keep = (k1 >= lo) & (k1 <= hi)
    else:
        total = (k1 * mask).sum(-1)
        stat = total if option == "seq_sum_k1" else total / (mask.sum(-1) + 1e-8)
        keep = ((stat >= lo) & (stat <= hi)).unsqueeze(-1).expand_as(mask)
    return keep.float() * mask


def slime_mis(
    train: torch.Tensor,
    rollout: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    mode: str,
    lower: float,
    upper: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: (weights, modified loss mask)."""
    raw = train - rollout
    if level == "token":
        lr = raw
    elif level == "sequence":
        lr = (raw * mask).sum().expand_as(raw)
    else:
        lr = ((raw * mask).sum() / torch.clamp_min(mask.sum(), 1)).expand_as(raw)
    w = torch.exp(torch.clamp(lr, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    if mode == "truncate":
        return w.clamp(0, upper) * mask, mask
    if mode == "clip":
        return w.clamp(lower, upper) * mask, mask
    in_range = (w >= lower) & (w <= upper)
    return w * mask, mask * in_range.float()


def openrlhf_coefficient(
    old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, kind: str, low: float, high: float
) -> torch.Tensor:
    """What PolicyLoss multiplies each token's loss by."""
    log_ratio = old - rollout
    if kind == "icepop":
        w = torch.exp(log_ratio)
        return w * ((w >= low) & (w <= high))
    if kind == "seq-mask-tis":
        seq = torch.exp((log_ratio * mask).sum(-1) / mask.sum(-1))
        seq_mask = (seq >= low) & (seq <= high)
        return seq_mask.unsqueeze(-1) * torch.exp(log_ratio)
    return torch.exp(log_ratio).clamp(min=low, max=high)


# ---------------------------------------------------------------------------------- inputs
@st.composite
def mismatch(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old log-probs, rollout log-probs, loss mask) ``[B, T]``: a small mismatch, sometimes a large one,
    observation tokens and padding in the mask."""
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 10_000))
    spread = draw(st.sampled_from([0.05, 0.3, 1.5]))
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(b, t, generator=g) * 3
    old = rollout + torch.randn(b, t, generator=g) * spread
    mask = (torch.rand(b, t, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    return old, rollout, mask


LEVELS = st.sampled_from(["token", "sequence", "geometric"])
BANDS = st.sampled_from([(0.5, 2.0), (0.8, 1.25), (0.2, 5.0)])


# ---------------------------------------------------------------------------------- weights
@settings(max_examples=80, deadline=None)
@given(mismatch(), st.sampled_from(["token", "sequence"]), st.sampled_from([1.5, 2.0, 5.0]))
def test_truncated_weights_match_verl(inputs, level: str, threshold: float) -> None:  # type: ignore[no-untyped-def]
    old, rollout, mask = inputs
    ours, _ = pm.importance_weights(old - rollout, mask, level, "truncate", threshold, 1 / threshold)
    torch.testing.assert_close(
        ours, verl_is_weights(old - rollout, mask, level, threshold), atol=ATOL, rtol=1e-5
    )


@settings(max_examples=80, deadline=None)
@given(mismatch(), LEVELS, st.sampled_from(["truncate", "clip"]), BANDS)
def test_weights_match_slime_mis(inputs, level: str, mode: str, band) -> None:  # type: ignore[no-untyped-def]
    old, rollout, mask = inputs
    lower, upper = band
    ours, bounded = pm.importance_weights(old - rollout, mask, level, mode, upper, lower)
    for i in range(old.shape[0]):
        expected, _ = slime_mis(old[i], rollout[i], mask[i], level, mode, lower, upper)
        torch.testing.assert_close(ours[i], expected, atol=ATOL, rtol=1e-5)
    rho = torch.exp(pm.level_log_ratio(old - rollout, mask, level))
    outside = (rho > upper) | ((rho < lower) if mode == "clip" else False)
    assert torch.equal(bounded, (outside & mask.bool()).float())


def test_token_truncation_is_the_tis_cap_it_replaces() -> None:
    old = torch.tensor([[-1.0, -0.2, -3.0, 30.0]])
    rollout = torch.tensor([[-1.5, -0.1, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    ours, bounded = pm.importance_weights(old - rollout, mask, "token", "truncate", 2.0, 0.5)
    # the former TIS: exp(old - rollout) on the loss tokens, capped
    tis = (torch.exp(old - rollout) * mask).clamp(max=2.0)
    assert torch.equal(ours, tis)
    assert bounded.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    torch.testing.assert_close(ours, torch.tensor([[1.6487213, 0.9048374, 0.1353353, 0.0]]))


# ---------------------------------------------------------------------------------- rejection
@settings(max_examples=80, deadline=None)
@given(mismatch(), LEVELS, BANDS)
def test_rejection_matches_slimes_mask_mode(inputs, level: str, band) -> None:  # type: ignore[no-untyped-def]
    old, rollout, mask = inputs
    lower, upper = band
    keep = pm.rejection_mask(old - rollout, mask, level, lower, upper)
    for i in range(old.shape[0]):
        _, modified = slime_mis(old[i], rollout[i], mask[i], level, "mask", lower, upper)
        assert torch.equal(keep[i], modified)


@settings(max_examples=80, deadline=None)
@given(mismatch(), st.sampled_from(["token", "sequence", "geometric"]), BANDS)
def test_rejection_is_verls_with_the_band_inverted(inputs, level: str, band) -> None:  # type: ignore[no-untyped-def]
    """verl's k1 options bound log(pi_rollout / pi_old), the inverse ratio: its band [a, b] is ours
    [1 / b, 1 / a]."""
    old, rollout, mask = inputs
    lower, upper = band
    option = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}[level]
    keep = pm.rejection_mask(old - rollout, mask, level, lower, upper)
    expected = verl_rejection(old - rollout, mask, option, 1 / upper, 1 / lower)
    # at the band's edge the two can round apart (exp of a mean against a mean of logs): equal elsewhere
    rho = torch.exp(pm.level_log_ratio(old - rollout, mask, level))
    edge = ((rho - lower).abs() < 1e-5) | ((rho - upper).abs() < 1e-5)
    assert torch.equal(keep[~edge], expected[~edge])


@settings(max_examples=80, deadline=None)
@given(mismatch(), BANDS)
def test_icepop_and_seq_mask_tis_are_openrlhfs(inputs, band) -> None:  # type: ignore[no-untyped-def]
    old, rollout, mask = inputs
    low, high = band
    log_ratio = old - rollout
    weight, _ = pm.importance_weights(log_ratio, mask, "token", "none", high, low)
    icepop = weight * pm.rejection_mask(log_ratio, mask, "token", low, high)
    expected = openrlhf_coefficient(old, rollout, mask, "icepop", low, high) * mask
    torch.testing.assert_close(icepop, expected, atol=ATOL, rtol=1e-5)
    seq_mask_tis = weight * pm.rejection_mask(log_ratio, mask, "geometric", low, high)
    expected = openrlhf_coefficient(old, rollout, mask, "seq-mask-tis", low, high) * mask
    rho = torch.exp(pm.level_log_ratio(log_ratio, mask, "geometric"))
    edge = ((rho - low).abs() < 1e-5) | ((rho - high).abs() < 1e-5)
    torch.testing.assert_close(seq_mask_tis[~edge], expected[~edge], atol=ATOL, rtol=1e-5)
    tis, _ = pm.importance_weights(log_ratio, mask, "token", "clip", high, low)
    torch.testing.assert_close(tis, openrlhf_coefficient(old, rollout, mask, "tis", low, high) * mask)


def test_rejection_hand_values() -> None:
    log_ratio = torch.log(torch.tensor([[1.0, 3.0, 0.4, 1.0], [1.5, 1.5, 1.0, 9.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    token = pm.rejection_mask(log_ratio, mask, "token", 0.5, 2.0)
    assert token.tolist() == [[1, 0, 0, 1], [1, 1, 1, 0]]
    # products 1.2 and 2.25; geometric means 1.2 ** (1/4) and 2.25 ** (1/3)
    assert pm.rejection_mask(log_ratio, mask, "sequence", 0.5, 2.0).tolist() == [[1, 1, 1, 1], [0, 0, 0, 0]]
    assert pm.rejection_mask(log_ratio, mask, "geometric", 0.5, 2.0).tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]


# ---------------------------------------------------------------------------------- mismatch metrics
@settings(max_examples=60, deadline=None)
@given(mismatch())
def test_mismatch_kl_is_verls_off_policy_kl(inputs) -> None:  # type: ignore[no-untyped-def]
    old, rollout, mask = inputs
    k1, k3 = pm.mismatch_kl(old, rollout)
    n = mask.sum()
    verl_kl = ((rollout - old) * mask).sum() / n
    log_ratio = old - rollout
    verl_k3 = ((torch.exp(log_ratio) - log_ratio - 1) * mask).sum() / n
    torch.testing.assert_close(pm.masked_sum(k1, mask) / n, verl_kl, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(pm.masked_sum(k3, mask) / n, verl_k3, atol=ATOL, rtol=1e-5)
    assert torch.all(k3[mask.bool()] >= -1e-7)


# ---------------------------------------------------------------------------------- the actor step
def _actor(model: Path, **alg: object) -> TorchTrainer:
    algorithm = AlgorithmConfig(estimator="grpo", num_mini_batches=1, **alg)  # type: ignore[arg-type]
    return TorchTrainer(
        TrainerConfig(role="actor", model_path=str(model), algorithm=algorithm, micro_batch_size=4)
    )


def test_the_actor_reports_the_mismatch_every_step(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(4, seed=5))
    actor = _actor(tiny_model)
    old = actor.compute_log_probs(samples)
    metrics = actor.train_actor(samples, None)
    mask = samples.loss_mask
    log_ratio = old - samples.rollout_log_probs
    assert metrics["mismatch_kl_k1"] == pytest.approx(
        float(pm.masked_sum(-log_ratio, mask) / mask.sum()), abs=1e-5
    )
    assert metrics["mismatch_log_ratio_abs_max"] == pytest.approx(
        float(pm.masked(log_ratio.abs(), mask).max()), abs=1e-5
    )
    outside = ((log_ratio.exp() > 2.0) | (log_ratio.exp() < 0.5)).float()
    assert metrics["mismatch_ratio_outside_band"] == pytest.approx(
        float(pm.masked_sum(outside, mask) / mask.sum())
    )
    assert metrics["mismatch_kl_k3"] > 0
    assert "tis_weight_mean" not in metrics  # no correction configured


def test_tis_cap_and_its_rollout_correction_train_alike(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(4, seed=6))
    torch.manual_seed(0)
    old_style = _actor(tiny_model, tis_cap=1.0)
    first = old_style.train_actor(samples, None)
    torch.manual_seed(0)
    new_style = _actor(tiny_model, rollout_correction=RolloutCorrection(weight="token", weight_upper=1.0))
    second = new_style.train_actor(samples, None)
    assert first == second
    assert 0 < first["tis_capped_fraction"] <= 1
    for (name, a), (_, b) in zip(old_style.named_weights(), new_style.named_weights(), strict=True):
        assert torch.equal(a, b), name


def test_rejected_tokens_do_not_train(tiny_model: Path, fields_factory: Callable) -> None:
    """A band nothing falls into rejects every token: the step changes no weight (AdamW without weight
    decay moves nothing on zero gradients), and the metric says all were rejected."""
    samples = Samples.from_fields(fields_factory(4, seed=7))
    actor = _actor(
        tiny_model, rollout_correction=RolloutCorrection(reject="token", reject_lower=1e3, reject_upper=1e4)
    )
    before = [w.clone() for _, w in actor.named_weights()]
    metrics = actor.train_actor(samples, None)
    assert metrics["rejected_fraction"] == 1.0
    for b, (name, a) in zip(before, actor.named_weights(), strict=True):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"tis_cap": 2.0, "rollout_correction": RolloutCorrection(weight="sequence")},
            "both set an importance weight",
        ),
    ],
)
def test_tis_cap_and_a_weight_are_not_both_set(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AlgorithmConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"weight": "token", "weight_lower": 0.5},
            r"rollout_correction.weight_lower=0.5 only applies to weight_bound='clip'",
        ),
        (
            {"weight": "token", "weight_bound": "clip", "weight_lower": 3.0},
            r"weight_lower \(3.0\) must be below weight_upper",
        ),
        ({"reject": "token", "reject_lower": 2.0}, r"reject_lower \(2.0\) must be below reject_upper"),
        ({"weight_bound": "none"}, r"weight_bound='none' bounds no weight"),
        ({"weight": "tokens"}, "weight"),
    ],
)
def test_rollout_correction_is_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)


def test_tis_cap_folds_into_the_correction() -> None:
    alg = AlgorithmConfig(tis_cap=3.0, rollout_correction=RolloutCorrection(reject="geometric"))
    assert alg.correction == RolloutCorrection(weight="token", weight_upper=3.0, reject="geometric")
    assert AlgorithmConfig().correction.active is False
