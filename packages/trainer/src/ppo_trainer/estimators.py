"""The advantage estimators, one table: name -> advantage function and the properties the rest asks.

The worker, the objective and both configs (this package's and ppo-driver's) ask an estimator's
properties (``uses_critic``, ``groups_samples``, ...), never its name: adding an estimator is one entry
in ``ESTIMATORS`` and its parity test (``tests/test_estimators.py``).

Every advantage function takes ``AdvantageInputs`` and returns ``[N, R_max]`` advantages on the
generated (loss-mask) tokens, 0 elsewhere, before the optional whitening (``whiten_by_default``).
The outcome estimators score each sample by its outcome reward plus its per-turn rewards and broadcast
one advantage over its generated tokens.

The settings (``ppo_trainer.config``) import this module and must stay free of torch (``ppo-driver
validate`` reads them without it): the functions import the torch math when they run. They read the
settings through ``algorithm_types.AdvantageSettings``, not the config class, so the imports run one
way (``config -> estimators -> ppo_math -> algorithm_types``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppo_trainer.algorithm_types import AdvantageSettings, GaeUnit, OffPolicyReturns

if TYPE_CHECKING:
    import torch

    from ppo_trainer.batch import Samples


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read: the settings, the samples, and with a critic its token rewards
    (the critic's, KL-shaped) and values, and the trainer's log-probs of the tokens before the update
    (``off_policy_returns: vtrace``'s target policy), ``[N, R_max]`` each."""

    alg: AdvantageSettings
    samples: Samples
    rewards: torch.Tensor | None = None
    values: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None


AdvantageFn = Callable[[AdvantageInputs], "torch.Tensor"]


@dataclass(frozen=True)
class Estimator:
    """One estimator and what the trainer and the driver need to know of it.

    - ``uses_critic``: GAE over a learnt value function; the run needs a critic (and only such an
      estimator may have one), and reward-level KL (``kl_coef``) works only here (the critic shapes
      the rewards).
    - ``groups_samples``: the baseline comes from the other samples of the same prompt, so a step needs
      ``n_samples_per_prompt >= 2`` and a prompt's samples on one data-parallel rank.
    - ``whiten_by_default``: ``normalize_advantages: null`` resolves to this.
    - ``may_whiten``: false where the advantages are normalised per group already and whitening them
      again over the batch would give a group of equal rewards non-zero advantages.
    - ``reads_norm_by_std``: ``norm_adv_by_std_in_grpo`` applies.
    """

    name: str
    summary: str
    advantages: AdvantageFn
    uses_critic: bool
    groups_samples: bool
    whiten_by_default: bool
    may_whiten: bool = True
    reads_norm_by_std: bool = False


# ---------------------------------------------------------------------------------- GAE
def gae(
    alg: AdvantageSettings, rewards: torch.Tensor, values: torch.Tensor, samples: Samples
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and critic targets over the generated (loss-mask) tokens, ``[N, R_max]`` each:
    per token skipping observations (the default), per turn (``gae_unit: turn``), or decaying
    through observations (``gae_through_observations``, the ablation)."""
    import ppo_trainer.ppo_math as pm

    mask = samples.loss_mask
    if alg.gae_unit == "turn":
        return pm.compute_turn_gae(rewards, values, mask, samples.turn_ids, alg.gamma, alg.lam)
    if alg.gae_through_observations:
        return pm.compute_gae_through_observations(rewards, values, mask, alg.gamma, alg.lam)
    return pm.compute_gae(rewards, values, mask, alg.gamma, alg.lam)


def advantages_and_returns(
    alg: AdvantageSettings,
    rewards: torch.Tensor,
    values: torch.Tensor,
    samples: Samples,
    log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The advantages and the critic's targets, ``[N, R_max]`` each: :func:`gae`'s, or with
    ``off_policy_returns: vtrace`` V-trace's (``ppo_trainer.vtrace``) with the ratios of ``log_probs``
    (the trainer's, before the update) to the rollout's log-probs."""
    if alg.off_policy_returns != "vtrace":
        return gae(alg, rewards, values, samples)
    if log_probs is None:
        raise ValueError(
            f"algorithm.off_policy_returns={alg.off_policy_returns!r} needs the trainer's log-probs of the "
            "tokens (the actor's, before its update) for the importance ratios"
        )
    from ppo_trainer.vtrace import vtrace_returns

    log_rhos = log_probs - samples.rollout_log_probs
    return vtrace_returns(alg, rewards, values, log_rhos, samples.loss_mask)


def _gae_advantages(inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.values is None or inputs.rewards is None:
        raise ValueError(
            f"estimator={inputs.alg.estimator!r} runs GAE: it needs the critic's values and token rewards"
        )
    advantages, _ = advantages_and_returns(
        inputs.alg, inputs.rewards, inputs.values, inputs.samples, inputs.log_probs
    )
    return advantages


# ---------------------------------------------------------------------------------- outcome estimators
def sample_scores(samples: Samples) -> torch.Tensor:
    """Each sample's score ``[N]``: its outcome reward plus its per-turn rewards (verl's
    ``token_level_rewards.sum(-1)`` without a KL term; exactly the outcome reward in single-turn)."""
    return samples.reward + (samples.turn_rewards * samples.loss_mask).sum(dim=1)


def _broadcast(per_sample: torch.Tensor, samples: Samples) -> torch.Tensor:
    return per_sample[:, None] * samples.loss_mask


def _grpo(inputs: AdvantageInputs) -> torch.Tensor:
    import ppo_trainer.ppo_math as pm

    s = inputs.samples
    scores = pm.grpo_advantages(
        sample_scores(s), s.prompt_index, norm_by_std=inputs.alg.norm_adv_by_std_in_grpo
    )
    return _broadcast(scores, s)


def _rloo(inputs: AdvantageInputs) -> torch.Tensor:
    import ppo_trainer.ppo_math as pm

    s = inputs.samples
    return _broadcast(pm.rloo_advantages(sample_scores(s), s.prompt_index), s)


def _reinforce_baseline(inputs: AdvantageInputs) -> torch.Tensor:
    import ppo_trainer.ppo_math as pm

    s = inputs.samples
    return _broadcast(pm.group_mean_baseline(sample_scores(s), s.prompt_index), s)


ESTIMATORS: Mapping[str, Estimator] = {
    e.name: e
    for e in (
        Estimator(
            name="ppo",
            summary="GAE over the critic's values and the token rewards",
            advantages=_gae_advantages,
            uses_critic=True,
            groups_samples=False,
            whiten_by_default=True,
        ),
        Estimator(
            name="grpo",
            summary="the group-normalised score, (r - mean) / (std + 1e-6) over the prompt's samples",
            advantages=_grpo,
            uses_critic=False,
            groups_samples=True,
            whiten_by_default=False,
            may_whiten=False,
            reads_norm_by_std=True,
        ),
        Estimator(
            name="rloo",
            summary="the score minus the mean of the prompt's other samples (leave-one-out)",
            advantages=_rloo,
            uses_critic=False,
            groups_samples=True,
            whiten_by_default=False,
        ),
        Estimator(
            name="reinforce_plus_plus_baseline",
            summary="the score minus the prompt's mean, whitened over the batch (REINFORCE++-baseline)",
            advantages=_reinforce_baseline,
            uses_critic=False,
            groups_samples=True,
            whiten_by_default=True,
        ),
    )
}


@dataclass(frozen=True)
class _InRewardUnits:
    """The settings a group baseline is compared with the critic's under (``baseline_advantages``)."""

    estimator: str
    gamma: float = 1.0
    lam: float = 1.0
    gae_unit: GaeUnit = "token"
    gae_through_observations: bool = False
    norm_adv_by_std_in_grpo: bool = False
    off_policy_returns: OffPolicyReturns = "none"
    vtrace_rho_bar: float = 1.0
    vtrace_c_bar: float = 1.0


def baseline_advantages(samples: Samples, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """What the group-baseline estimators ``names`` would give these samples, ``[N, R_max]`` each, in
    reward units like GAE's before whitening: GRPO's without the division by the group's std (Dr.
    GRPO's form; that division rescales each group, it is not a baseline). For the critic's report
    (``critic_health``): the advantages the actor trains on are the run's estimator's."""
    out: dict[str, torch.Tensor] = {}
    for name in names:
        estimator = get(name)
        if not estimator.groups_samples:
            raise ValueError(f"{name!r} is not a group-baseline estimator")
        out[name] = estimator.advantages(AdvantageInputs(_InRewardUnits(name), samples))
    return out


def get(name: str) -> Estimator:
    """The estimator called ``name``; a ``ValueError`` naming the field and the choices otherwise."""
    estimator = ESTIMATORS.get(name)
    if estimator is None:
        raise ValueError(f"algorithm.estimator={name!r} is not an estimator; use one of {sorted(ESTIMATORS)}")
    return estimator


__all__ = [
    "ESTIMATORS",
    "AdvantageInputs",
    "Estimator",
    "advantages_and_returns",
    "baseline_advantages",
    "gae",
    "get",
    "sample_scores",
]
