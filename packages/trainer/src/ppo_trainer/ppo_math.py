"""PPO math as pure torch functions over padded ``[batch, time]`` response tensors.

Conventions: ``mask`` is 1.0 on tokens that count and 0.0 elsewhere (padding, tokens excluded from the
loss). Masked-out positions are *selected away* (``torch.where``), never multiplied by 0, so a NaN or inf
there (a padding logit, an overflowing ratio) changes no result. Every function is elementwise or
vectorised over the batch; none touches a model, an optimizer or a process group (whitening takes an
optional ``all_reduce`` callable so that it can span DP ranks).

The formulas agree with verl's ``core_algos.py`` and OpenRLHF's ``loss.py`` / ``utils.py`` (the table
of conventions in docs/reference/trainer.md lists where, and why, they differ;
``tests/test_reference_parity.py`` re-states the references' formulas).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import torch

from ppo_trainer.algorithm_types import KLEstimator, LossAggregation

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over data-parallel ranks and returns the sum (identity on a single rank)."""

LOSS_AGGREGATIONS: tuple[LossAggregation, ...] = get_args(LossAggregation)

# exp(20) ~ 4.9e8: beyond it a token's ratio is noise that would only overflow (exp(89) is inf in float32)
# and, multiplied by a zero gradient elsewhere, turn into NaN. verl and OpenRLHF clamp at the same bound.
LOG_RATIO_CLAMP = 20.0
# verl's low_var_kl bound on the k3 value (OpenRLHF clamps every estimator to it).
KL_VALUE_CLAMP = 10.0


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x * m`` where ``m != 0`` and exactly 0 elsewhere, whatever ``x`` holds there (NaN, inf)."""
    return torch.where(mask != 0, x * mask, torch.zeros_like(x))


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_i x_i * m_i`` over the elements with ``m_i != 0`` (a NaN elsewhere does not leak in)."""
    return masked(x, mask).sum()


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over masked, variable-length responses.

    For the tokens with ``mask = 1`` of one sample, taken in order as ``t = 0 .. n-1``::

        delta_t = r_t + gamma * V_{t+1} - V_t          (V_n = 0: the response ends the episode)
        A_t     = delta_t + gamma * lam * A_{t+1}      (A_n = 0)
        R_t     = A_t + V_t                            (the critic's regression target)

    Tokens with ``mask = 0`` are skipped: the recursion carries ``A`` and ``V`` across them unchanged, so
    trailing padding and masked-out spans in the middle do not leak into the result. Their advantage and
    return are 0. Vectorised over the batch; one reverse pass over time.

    Args: ``rewards``, ``values``, ``mask`` of shape ``[B, T]``. Returns ``(advantages, returns)``.
    """
    if not rewards.shape == values.shape == mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
            "must have the same [batch, time] shape"
        )
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    batch, time = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    zero = rewards.new_zeros(batch)
    for t in reversed(range(time)):
        keep = mask[:, t] != 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        # Selected, not blended with the mask: a NaN value on a skipped token must not reach the others.
        next_adv = torch.where(keep, adv, next_adv)
        next_value = torch.where(keep, values[:, t], next_value)
        advantages[:, t] = torch.where(keep, adv, zero)
    returns = masked(advantages + values, mask)
    return advantages, returns


def compute_gae_through_observations(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE that decays through observation tokens (OpenRLHF's ``get_advantages_and_returns``, slime's):
    the ablation beside :func:`compute_gae`, which skips them.

    Values and rewards are zeroed where ``loss_mask = 0`` and the recursion runs over every position::

        delta_t = m_t r_t + gamma * m_{t+1} V_{t+1} - m_t V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + m_t V_t

    so an observation token of the middle costs the advantage a factor ``gamma * lam`` and the last
    generated token of a turn sees a next value of 0 (the observation's zeroed one). The results are
    returned on the ``loss_mask`` tokens (0 elsewhere): only those train. Trailing padding holds zero
    values and rewards, so it changes nothing.
    """
    if not rewards.shape == values.shape == loss_mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must have the same [batch, time] shape"
        )
    mask = loss_mask.float()
    rewards, values = masked(rewards.float(), mask), masked(values.float(), mask)
    batch, time = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(batch)
    next_adv = rewards.new_zeros(batch)
    for t in reversed(range(time)):
        next_adv = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * next_adv
        next_value = values[:, t]
        advantages[:, t] = next_adv
    return masked(advantages, mask), masked(advantages + values, mask)


def compute_turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE: each turn of generated tokens is one time step (AReaL's
    ``gae_timestep_unit: turn``).

    For the turns ``u = 0 .. U-1`` of a sample that hold at least one ``loss_mask`` token, in order::

        r_u = sum of r_t over turn u's loss-mask tokens       (its outcome, turn reward and KL terms)
        V_u = V_t at turn u's first loss-mask token            (the state after the last observation)
        delta_u = r_u + gamma * V_{u+1} - V_u                  (V_U = 0)
        A_u     = delta_u + gamma * lam * A_{u+1}              (A_U = 0)
        R_u     = A_u + V_u

    and every loss-mask token of turn ``u`` gets ``A_u`` and the critic target ``R_u``; other tokens get
    0. A turn is the run of tokens sharing a ``turn_ids`` value (non-decreasing along the response);
    one without a generated token is skipped. ``gamma`` discounts per turn here, not per token.
    """
    if not rewards.shape == values.shape == loss_mask.shape == turn_ids.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, loss_mask "
            f"{tuple(loss_mask.shape)} and turn_ids {tuple(turn_ids.shape)} must have one [batch, time] shape"
        )
    mask = loss_mask.float()
    batch, time = mask.shape
    if time == 0:
        return torch.zeros_like(mask), torch.zeros_like(mask)
    ids = turn_ids.long()
    # Dense turn numbers 0, 1, ... (a change of id starts a turn), so a gap in the ids costs nothing.
    dense = torch.cat([ids.new_zeros(batch, 1), (ids.diff(dim=1) != 0).long().cumsum(dim=1)], dim=1)
    turns = int(dense.max()) + 1
    keep = mask != 0
    turn_rewards = mask.new_zeros(batch, turns).scatter_add_(1, dense, masked(rewards.float(), mask))
    positions = torch.arange(time, device=mask.device).expand(batch, time)
    first = torch.full((batch, turns), time, dtype=torch.long, device=mask.device)
    first = first.scatter_reduce(1, dense, torch.where(keep, positions, time), "amin", include_self=True)
    has_tokens = first < time
    turn_values = values.float().gather(1, first.clamp(max=time - 1))
    turn_values = torch.where(has_tokens, turn_values, torch.zeros_like(turn_values))
    turn_adv, turn_returns = compute_gae(turn_rewards, turn_values, has_tokens.float(), gamma, lam)
    return masked(turn_adv.gather(1, dense), mask), masked(turn_returns.gather(1, dense), mask)


def token_rewards(
    reward: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    turn_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token rewards: the sample's scalar reward on its last masked-in token, plus the per-turn
    rewards, minus a KL penalty.

    ``r_t = reward * [t == last] + turn_reward_t - kl_coef * kl_t`` for masked-in tokens, 0 elsewhere.
    ``reward`` is ``[B]``, ``mask``, ``kl`` and ``turn_rewards`` are ``[B, T]``. With the loss mask as
    ``mask`` the outcome lands on the last generated token, also when observation tokens follow it. A
    sample without any masked-in token gets no reward.
    """
    mask = mask.float()
    batch, time = mask.shape
    positions = torch.arange(time, device=mask.device).expand(batch, time)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros_like(mask)
    has_token = last >= 0
    rows = torch.arange(batch, device=mask.device)[has_token]
    out[rows, last[has_token]] = reward.float()[has_token]
    if turn_rewards is not None:
        out = out + masked(turn_rewards.float(), mask)
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * masked(kl.float(), mask)
    return out


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: KLEstimator) -> torch.Tensor:
    """Per-token estimators of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman's k1/k2/k3).

    With ``d = log pi - log pi_ref``:

    - ``k1 = d`` (unbiased, high variance, can be negative),
    - ``abs = |d|``,
    - ``k2 = d^2 / 2``,
    - ``k3 = exp(-d) - 1 + d`` (unbiased, non-negative) with ``d`` clamped to [-20, 20] and the result to
      [-10, 10], so a single token with a huge ratio cannot blow up the loss; ``low_var_kl`` is the same
      estimator under verl's other name for it.
    """
    d = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        # Clamping d first keeps exp(-d) finite, so the gradient is 0 (not 0 * inf) beyond the bound.
        d = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return (torch.expm1(-d) + d).clamp(-KL_VALUE_CLAMP, KL_VALUE_CLAMP)
    raise ValueError(f"kind={kind!r} is not a KL estimator; use 'k1', 'abs', 'k2', 'k3' or 'low_var_kl'")


@dataclass(frozen=True)
class PolicyLossTerms:
    """Per-token terms of the clipped policy loss, all ``[B, T]``; aggregate them with ``aggregate``."""

    loss: torch.Tensor
    clip_fraction: torch.Tensor  # 1.0 where the clipped branch is strictly larger (the clip is active)
    dual_clip_fraction: torch.Tensor  # 1.0 where the dual clip bounds the loss
    ppo_kl: torch.Tensor  # k1 estimate of KL(old || new) per token: old - new log-prob, clamped


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> PolicyLossTerms:
    """PPO clipped surrogate with separate low and high bounds and optional dual clip.

    With ``ratio = exp(clamp(log_probs - old_log_probs, -20, 20))`` and advantage ``A``::

        L_clip = max(-A * ratio, -A * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))
        L      = min(L_clip, -A * eps_clip_c)   where A < 0 and eps_clip_c is set (dual clip, c > 1)
        L      = L_clip                         elsewhere

    The clamp of the log-ratio (verl's and OpenRLHF's) bounds the ratio at ``e^20`` and gives a token
    beyond it no gradient, where the bare ``exp`` gave 8.8e9 at a log-ratio of 24 and inf (a NaN
    gradient) near 89. ``clip_fraction`` marks tokens where the clipped branch is strictly larger;
    ``ppo_kl`` is ``old_log_probs - log_probs`` after the clamp (k1 of KL(old || new), verl's
    ``ppo_kl``).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"eps_clip_c={eps_clip_c!r} must be > 1 (dual-clip lower bound)")
    log_ratio = (log_probs.float() - old_log_probs.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    clip_fraction = (clipped > unclipped).float()
    dual = torch.zeros_like(loss)
    if eps_clip_c is not None:
        bound = -adv * eps_clip_c
        dual = ((adv < 0) & (loss > bound)).float()
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
    return PolicyLossTerms(
        loss=loss, clip_fraction=clip_fraction, dual_clip_fraction=dual, ppo_kl=-log_ratio.detach()
    )


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss, per token.

    ``V_clip = clamp(V, V_old - value_clip, V_old + value_clip)`` and
    ``L = 0.5 * max((V - R)^2, (V_clip - R)^2)``. Returns ``(loss, clip_fraction)`` where
    ``clip_fraction`` is 1.0 on tokens where the clipped branch is strictly larger, i.e. where the clip
    decides the loss (verl's ``vf_clipfrac``); a value outside the band that moved toward the return is
    not counted, since the unclipped branch wins there.
    """
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    # Clamping V itself (not V_old + clamp(V - V_old)) keeps V_clip == V bit for bit inside the band,
    # so rounding never makes the clipped branch win there and count as clipped.
    clipped = torch.clamp(values, old_values - value_clip, old_values + value_clip)
    unclipped_loss, clipped_loss = (values - returns).square(), (clipped - returns).square()
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    clip_fraction = (clipped_loss > unclipped_loss).float()
    return loss, clip_fraction


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution per position: ``H = logsumexp(z) - sum softmax(z) z``."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(z)[target]`` per position, in float32."""
    logits = logits.float()
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    all_reduce: AllReduce | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Whiten over masked-in elements, optionally across data-parallel ranks.

    ``mu = sum(x m) / sum(m)``, ``var = sum((x - mu)^2 m) / sum(m)`` (population variance, as
    OpenRLHF; verl's ``masked_whiten`` uses the unbiased one), both summed over every rank through
    ``all_reduce``; returns ``(x - mu) / sqrt(var + eps) * m``.
    """
    reduce: AllReduce = all_reduce if all_reduce is not None else (lambda t: t)
    x32, mask32 = x.float(), mask.float()
    stats = reduce(torch.stack([masked_sum(x32, mask32), mask32.sum()]))
    count = stats[1].clamp(min=1.0)
    mean = stats[0] / count
    var = reduce(masked_sum((x32 - mean).square(), mask32).reshape(1))[0] / count
    return masked((x32 - mean) * torch.rsqrt(var + eps), mask32)


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, norm_by_std: bool = True
) -> torch.Tensor:
    """Group-normalised outcome advantages (GRPO), one per sample.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` over the samples ``g`` sharing ``group_ids[i]``, with the
    unbiased standard deviation; ``norm_by_std=False`` gives ``A_i = r_i - mean_g`` (Dr. GRPO, verl's
    ``norm_adv_by_std_in_grpo: false``). A group of equal rewards gets ``A = 0``. A group of one sample
    has no baseline: as in verl it takes mean 0 and std 1, so ``A = r / (1 + eps)`` (``r`` without the
    std). ``rewards`` and ``group_ids`` are ``[N]``; the caller broadcasts ``A_i`` over the sample's
    response tokens.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]"
        )
    rewards = rewards.float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(groups, device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    sums = torch.zeros(groups, device=rewards.device).index_add_(0, inverse, rewards)
    single = counts == 1
    mean = torch.where(single, torch.zeros_like(sums), sums / counts)
    sq = torch.zeros(groups, device=rewards.device).index_add_(0, inverse, (rewards - mean[inverse]).square())
    std = torch.where(single, torch.ones_like(sums), torch.sqrt(sq / (counts - 1.0).clamp(min=1.0)))
    centred = rewards - mean[inverse]
    if not norm_by_std:
        return centred
    return centred / (std[inverse] + eps)


def _group_sums(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: the sum of the rewards of its group and the group's size, ``[N]`` each."""
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(groups, device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))
    sums = torch.zeros(groups, device=rewards.device).index_add_(0, inverse, rewards)
    return sums[inverse], counts[inverse]


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out, one advantage per sample: ``A_i = r_i - (S_g - r_i) / (n_g - 1)``, the
    reward minus the mean of the other samples of its group ``g`` (``n_g`` samples, rewards summing to
    ``S_g``); a group of one has no baseline: ``A_i = r_i`` (verl's and OpenRLHF's ``rloo``)."""
    rewards = rewards.float()
    sums, counts = _group_sums(rewards, group_ids)
    others = (sums - rewards) / (counts - 1.0).clamp(min=1.0)
    return torch.where(counts > 1, rewards - others, rewards)


def group_mean_baseline(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``A_i = r_i - mean_g``, the reward minus its group's mean (a group of one: mean 0, as verl's
    ``reinforce_plus_plus_baseline``); REINFORCE++-baseline whitens the result over the batch."""
    rewards = rewards.float()
    sums, counts = _group_sums(rewards, group_ids)
    mean = torch.where(counts > 1, sums / counts, torch.zeros_like(sums))
    return rewards - mean


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """A token-level log-ratio ``[B, T]`` at ``level``, over the tokens ``mask`` keeps, broadcast back
    over them: ``token`` as it is, ``sequence`` the sample's sum (the log of the product of its ratios),
    ``geometric`` the sample's mean (the log of their geometric mean). 0 where ``mask`` is 0."""
    kept = masked(log_ratio.float(), mask.float())
    if level == "token":
        return kept
    total = kept.sum(dim=1, keepdim=True)
    if level == "sequence":
        return masked(total.expand_as(kept), mask)
    if level == "geometric":
        return masked((total / mask.float().sum(dim=1, keepdim=True).clamp(min=1.0)).expand_as(kept), mask)
    raise ValueError(f"level={level!r}: use 'token', 'sequence' or 'geometric'")


def importance_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    bound: str,
    upper: float,
    lower: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights for the rollout-trainer mismatch, ``[B, T]``, 0 where ``mask`` is 0, and
    where the bound changed them (1.0 there).

    ``rho = exp(level_log_ratio(log_ratio))`` (the log clamped at 20 first: ``exp`` stays finite) with
    ``log_ratio = log pi_old - log pi_rollout``; ``bound``: ``truncate`` ``min(rho, upper)`` (TIS;
    verl's ``rollout_is`` with ``rollout_is_threshold``, slime's ``tis_mode truncate``), ``clip``
    ``clamp(rho, lower, upper)`` (slime's ``clip``), ``none`` ``rho`` (IcePop's coefficient before its
    mask). No gradient flows through them.
    """
    rho = torch.exp(level_log_ratio(log_ratio, mask, level).clamp(max=LOG_RATIO_CLAMP)).detach()
    if bound == "truncate":
        weight, bounded = rho.clamp(max=upper), rho > upper
    elif bound == "clip":
        weight, bounded = rho.clamp(min=lower, max=upper), (rho > upper) | (rho < lower)
    elif bound == "none":
        weight, bounded = rho, torch.zeros_like(rho, dtype=torch.bool)
    else:
        raise ValueError(f"bound={bound!r}: use 'truncate', 'clip' or 'none'")
    return masked(weight, mask), masked(bounded.float(), mask)


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, level: str, lower: float, upper: float
) -> torch.Tensor:
    """Masked importance sampling: 1.0 on the tokens ``mask`` keeps whose ratio at ``level`` lies in
    ``[lower, upper]``, 0 elsewhere (at ``sequence`` / ``geometric`` a sample is kept or dropped
    whole). slime's ``mask`` mode, OpenRLHF's ``icepop`` (token) and ``seq-mask-tis`` (geometric)."""
    rho = torch.exp(level_log_ratio(log_ratio, mask, level).clamp(max=LOG_RATIO_CLAMP))
    return masked(((rho >= lower) & (rho <= upper)).float(), mask)


def mismatch_kl(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token estimates of ``KL(pi_rollout || pi_old)`` from the rollout's own samples, ``(k1, k3)``:
    ``k1 = log pi_rollout - log pi_old``; ``k3 = rho - 1 - log rho`` with ``rho = pi_old / pi_rollout``
    (non-negative; the log clamped at 20). verl's ``rollout_corr/kl`` and ``rollout_corr/k3_kl``."""
    log_rho = old_log_probs.float() - rollout_log_probs.float()
    log_rho_safe = log_rho.clamp(max=LOG_RATIO_CLAMP)
    return -log_rho, torch.expm1(log_rho_safe) - log_rho_safe


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: LossAggregation,
    denominator: float | torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token ``[B, T]`` loss to a scalar, with ``S_i = sum_t L_it m_it``, sample i's sum.

    - ``token_mean``: ``sum_i S_i / D`` with ``D`` the number of masked-in tokens.
    - ``seq_mean_token_mean``: ``sum_i (S_i / n_i) / D`` with ``n_i`` sample i's masked-in tokens and
      ``D`` the number of samples having at least one.
    - ``seq_mean_token_sum``: ``sum_i S_i / D``, the same ``D``: long answers weigh more.
    - ``seq_mean_token_sum_norm`` (Dr. GRPO): ``sum_i (S_i / scale) / D``, the same ``D``, ``scale`` a
      constant (the longest response the rollout may give), so that no sample's tokens are reweighted by
      its length and the loss keeps one scale through training.

    ``denominator`` overrides ``D``: the trainer passes the count over the whole global batch (all
    micro-batches, all ranks), so that summing the micro-batch losses of every rank yields exactly the
    global mean and the gradient does not depend on how the batch was split.
    """
    loss, mask = loss.float(), mask.float()
    if mode in ("token_mean", "seq_mean_token_sum"):
        total = masked_sum(loss, mask)
    elif mode == "seq_mean_token_mean":
        total = (masked(loss, mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum()
    elif mode == "seq_mean_token_sum_norm":
        if scale is None or not scale > 0:
            raise ValueError(f"mode='seq_mean_token_sum_norm' needs scale > 0 (got {scale!r})")
        total = masked_sum(loss, mask) / scale
    else:
        raise ValueError(
            f"mode={mode!r} is not a loss aggregation; use one of {', '.join(map(repr, LOSS_AGGREGATIONS))}"
        )
    d = aggregation_denominator(mask, mode).clamp(min=1.0) if denominator is None else denominator
    return total / d


def aggregation_denominator(mask: torch.Tensor, mode: LossAggregation) -> torch.Tensor:
    """The local ``D`` of ``aggregate`` (sum it over micro-batches and ranks for the global one)."""
    if mode == "token_mean":
        return mask.float().sum()
    return (mask.float().sum(dim=1) > 0).float().sum()
