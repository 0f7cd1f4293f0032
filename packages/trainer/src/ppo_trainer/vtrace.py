"""V-trace (Espeholt et al., 2018, "IMPALA"): value targets and policy-gradient advantages from
tokens another policy drew, with truncated importance weights, over masked ``[batch, time]`` responses.

For the tokens with ``mask = 1`` of one sample, in order ``t = 0 .. n-1``, with ``rho_t = pi(a_t) /
mu(a_t)`` (the target policy over the behaviour policy that drew the token)::

    delta_t = min(rho_bar, rho_t) * (r_t + gamma * V_{t+1} - V_t)       (V_n = 0: the response ends)
    v_t     = V_t + delta_t + gamma * c_t * (v_{t+1} - V_{t+1})         c_t = lam * min(c_bar, rho_t)
    A_t     = min(rho_bar, rho_t) * (r_t + gamma * v_{t+1} - V_t)       (v_n = 0)

``v_t`` is the critic's regression target, ``A_t`` the policy gradient's advantage. With every
``rho_t = 1`` and ``rho_bar, c_bar >= 1`` it is GAE's return (``ppo_math.compute_gae``). Tokens with
``mask = 0`` are skipped as GAE skips them. The recursion is DeepMind's ``scalable_agent``
``vtrace.from_importance_weights`` (commit e331dc3140e5ef53e62ac753f56539db4c4430eb), whose traces are
``min(1, rho)``; ``c_bar`` and ``lam`` (the paper's remark on lambda) generalise them, and
``tests/test_vtrace.py`` checks the two agree on fixed inputs.

The trainer runs it with ``algorithm.off_policy_returns: vtrace`` (``estimators.advantages_and_returns``):
``pi`` is the actor's policy before the step's update (its log-probs computed at training time), ``mu``
the engine's log-probs stored with each token (``rollout_log_probs``, older weights' under partial
rollouts), ``V`` the critic's values computed at training time, ``gamma`` and ``lam`` the algorithm's.
:func:`weight_metrics` describes the weights (``vtrace_*`` metrics of both roles).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ppo_trainer.algorithm_types import AdvantageSettings
from ppo_trainer.ppo_math import LOG_RATIO_CLAMP, masked, masked_sum

__all__ = ["Ranks", "VTrace", "compute_vtrace", "vtrace_returns", "weight_metrics"]


class Ranks(Protocol):
    """Where this rank sits among the data-parallel ranks and how to sum over them
    (``backend_protocol.DataParallel`` is one)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class VTrace:
    """``vs``: value targets; ``pg_advantages``; ``clipped_rhos``: ``min(rho_bar, rho)``, each ``[B, T]``
    and 0 where the mask is 0."""

    vs: torch.Tensor
    pg_advantages: torch.Tensor
    clipped_rhos: torch.Tensor


def compute_vtrace(
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rhos: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> VTrace:
    """V-trace targets and advantages (the module docstring's recursion); one reverse pass over time."""
    if not rewards.shape == values.shape == log_rhos.shape == mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, log_rhos "
            f"{tuple(log_rhos.shape)} and mask {tuple(mask.shape)} must have the same [batch, time] shape"
        )
    if rho_bar <= 0 or c_bar <= 0:
        raise ValueError(f"V-trace needs rho_bar > 0 and c_bar > 0, got rho_bar={rho_bar}, c_bar={c_bar}")
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    rhos = torch.exp(log_rhos.float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = rhos.clamp(max=rho_bar)
    traces = lam * rhos.clamp(max=c_bar)
    batch, time = rewards.shape
    vs = torch.zeros_like(rewards)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(batch)  # V_{t+1}
    next_vs = rewards.new_zeros(batch)  # v_{t+1}
    zero = rewards.new_zeros(batch)
    for t in reversed(range(time)):
        keep = mask[:, t] != 0
        target = rewards[:, t] + gamma * next_value - values[:, t]
        v_t = values[:, t] + clipped[:, t] * target + gamma * traces[:, t] * (next_vs - next_value)
        adv = clipped[:, t] * (rewards[:, t] + gamma * next_vs - values[:, t])
        vs[:, t] = torch.where(keep, v_t, zero)
        advantages[:, t] = torch.where(keep, adv, zero)
        next_vs = torch.where(keep, v_t, next_vs)
        next_value = torch.where(keep, values[:, t], next_value)
    return VTrace(masked(vs, mask), masked(advantages, mask), masked(clipped, mask))


def vtrace_returns(
    alg: AdvantageSettings,
    rewards: torch.Tensor,
    values: torch.Tensor,
    log_rhos: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` as ``estimators.gae`` gives them: V-trace's ``pg_advantages`` and
    ``vs`` at the settings' ``gamma``, ``lam``, ``vtrace_rho_bar`` and ``vtrace_c_bar``."""
    out = compute_vtrace(
        rewards,
        values,
        log_rhos,
        mask,
        gamma=alg.gamma,
        lam=alg.lam,
        rho_bar=alg.vtrace_rho_bar,
        c_bar=alg.vtrace_c_bar,
    )
    return out.pg_advantages, out.vs


def weight_metrics(
    dp: Ranks, log_rhos: torch.Tensor, mask: torch.Tensor, *, rho_bar: float, c_bar: float, lam: float
) -> dict[str, float]:
    """The importance weights over the ``mask`` tokens of every rank: ``vtrace_rho_mean`` and
    ``vtrace_rho_max`` (``rho = pi / mu`` before truncation), ``vtrace_rho_clipped_fraction`` (share of
    tokens with ``rho > rho_bar``), ``vtrace_c_mean`` and ``vtrace_c_max`` (the traces
    ``lam * min(c_bar, rho)`` as used) and ``vtrace_c_clipped_fraction`` (``rho > c_bar``)."""
    mask = mask.float()
    rhos = torch.exp(log_rhos.float().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    traces = lam * rhos.clamp(max=c_bar)
    sums = torch.stack(
        [
            masked_sum(rhos, mask),
            masked_sum((rhos > rho_bar).float(), mask),
            masked_sum(traces, mask),
            masked_sum((rhos > c_bar).float(), mask),
            mask.sum(),
        ]
    )
    # Each rank's maxima in its own slots: the sum over ranks then holds every rank's.
    slots = torch.zeros(dp.world_size, 2)
    if mask.any():
        slots[dp.rank] = torch.stack([masked(rhos, mask).max(), masked(traces, mask).max()])
    sums, slots = dp.all_reduce(sums), dp.all_reduce(slots)
    n = sums[4].clamp(min=1.0)
    return {
        "vtrace_rho_mean": float(sums[0] / n),
        "vtrace_rho_max": float(slots[:, 0].max()),
        "vtrace_rho_clipped_fraction": float(sums[1] / n),
        "vtrace_c_mean": float(sums[2] / n),
        "vtrace_c_max": float(slots[:, 1].max()),
        "vtrace_c_clipped_fraction": float(sums[3] / n),
    }
