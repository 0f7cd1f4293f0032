"""The PPO objective: the critic's and the actor's training steps over any ``ModelBackend``.

Everything that decides what is learnt lives here, once, for every backend: token rewards (with the
reference KL and per-turn rewards) on the generated tokens, the estimator's advantages
(``ppo_trainer.estimators``), whitening, the rollout-trainer mismatch and its correction, the policy,
entropy, KL and value losses, their aggregation over the mini-batch, and the metrics. A backend supplies the
model (``backend_protocol.ModelBackend``: a forward over a micro-batch, backward, optimizer step, a
data-parallel sum) and nothing of the algorithm.

Losses are divided by the token (or sequence) count of the whole global mini-batch (``Counts``), so the
sum of the gradients over data-parallel ranks is the gradient of the global mean: the backend sums them
(the torch backend all-reduces or lets FSDP reduce-scatter; megatron's DDP sums with
``calculate_per_token_loss``), and a 2-rank run matches a 1-rank run on the same global batch up to
float summation order.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ppo_trainer import critic_health, estimators, micro_batches, packing, vtrace
from ppo_trainer import ppo_math as pm
from ppo_trainer.backend_protocol import Batch, DataParallel, Forward, ModelBackend
from ppo_trainer.batch import Samples, collate, split_even, to_device
from ppo_trainer.config import AlgorithmConfig


@dataclass(frozen=True)
class Counts:
    """A mini-batch's global counts (all micro-batches, all ranks), the divisors of its micro-batch terms.

    ``loss``: the loss aggregation's ``D`` (tokens or samples); ``tokens``: the loss tokens, for the
    metrics that are token means whatever the aggregation (clip fractions, ``ppo_kl``), as in verl.
    """

    loss: torch.Tensor
    tokens: torch.Tensor


@dataclass(frozen=True)
class Micro:
    """One micro-batch of a mini-batch: its ``rows`` of the rank's samples, the model inputs ``mb``,
    their loss mask ``[b, R_max]`` on the device, and the mini-batch's global ``counts``."""

    rows: list[int]
    mb: Batch
    mask: torch.Tensor
    counts: Counts


# A micro-batch's terms: {"loss": the term to differentiate, metric name: its share of the metric}.
MicroLoss = Callable[[Micro], dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------- scoring
def score(backend: ModelBackend, samples: Samples, *, reference: bool = False) -> torch.Tensor:
    """Without gradients, ``[N, R_max]`` (0 on padding): the actor's log-probs of the response tokens,
    the critic's values before each of them, or (``reference``) the reference policy's log-probs."""
    parts: list[tuple[list[int], torch.Tensor]] = []
    with backend.inference(reference):
        for rows in micro_batches_of(backend, samples, range(len(samples))):
            scored = backend.forward(inputs_of(backend, samples, rows), reference=reference)
            parts.append((rows, _scores(scored).float()))
    return _in_row_order(parts, samples) * samples.response_mask


def micro_batches_of(backend: ModelBackend, samples: Samples, rows: Sequence[int]) -> list[list[int]]:
    """``rows`` in micro-batches (``micro_batch_size`` samples, or a token budget; as many on every
    data-parallel rank)."""
    dp = backend.dp
    return micro_batches.for_rows(backend.config, samples, rows, dp.rank, dp.world_size, dp.all_reduce)


def inputs_of(backend: ModelBackend, samples: Samples, rows: list[int]) -> Batch:
    """The model inputs of ``rows``: packed (``train.pack_sequences``) or right-padded."""
    if backend.config.pack_sequences:
        return packing.pack(samples, rows, backend.device)
    return collate(samples, rows, backend.device)


def _in_row_order(parts: list[tuple[list[int], torch.Tensor]], samples: Samples) -> torch.Tensor:
    """Micro-batch results (``[b, R_max]`` each, for their rows) as one ``[N, R_max]`` CPU tensor:
    one copy to the host for all of them (a copy per micro-batch would wait for the GPU each time)."""
    out = torch.zeros(len(samples), samples.max_response)
    if parts:
        out[[r for rows, _ in parts for r in rows]] = torch.cat([x for _, x in parts]).cpu()
    return out


def _scores(forward: Forward) -> torch.Tensor:
    scores = forward.values if forward.values is not None else forward.log_probs
    if scores is None:
        raise RuntimeError("the backend's forward returned neither log-probs nor values")
    return scores


def token_rewards(backend: ModelBackend, samples: Samples) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's per-token rewards, ``[N, R_max]``, on the loss-mask (generated) tokens only: the
    outcome reward on the last generated token, the per-turn rewards, minus ``kl_coef`` times the KL
    of the rollout policy to the reference.

    The KL is estimated from the rollout's log-probs (the policy that drew the tokens) and the
    reference's, so it is known before any role trains; the critic computes it once and the
    actor trains on the same tensor.
    """
    alg = backend.config.algorithm
    kl = None
    metrics: dict[str, float] = {}
    if alg.kl_coef > 0.0:
        if not backend.has_reference:
            raise RuntimeError(
                f"{backend.config.role}: kl_coef={alg.kl_coef} but no reference model is loaded; "
                "the critic computes the KL-shaped rewards"
            )
        ref_log_probs = score(backend, samples, reference=True)
        kl = pm.kl_estimate(samples.rollout_log_probs, ref_log_probs, alg.kl_estimator)
        metrics["reward_kl"] = masked_global_mean(backend.dp, kl, samples.loss_mask)
    rewards = pm.token_rewards(samples.reward, samples.loss_mask, kl, alg.kl_coef, samples.turn_rewards)
    metrics["token_reward_sum_mean"] = sample_mean(backend.dp, rewards.sum(dim=1))
    return rewards, metrics


# ---------------------------------------------------------------------------------- the critic
def train_critic(
    backend: ModelBackend, samples: Samples, policy_log_probs: torch.Tensor | None = None
) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """Token rewards, values (before the update), GAE returns (V-trace's with ``off_policy_returns:
    vtrace``, over ``policy_log_probs``: the actor's log-probs of the tokens before its update),
    value-loss steps.

    Returns ``(metrics, old_values, token_rewards)``: the actor trains on the same rewards.
    """
    if backend.config.role != "critic":
        raise RuntimeError("train_critic called on an actor")
    alg = backend.config.algorithm
    rewards, reward_metrics = token_rewards(backend, samples)
    old_values = score(backend, samples)
    advantages, returns = estimators.advantages_and_returns(
        alg, rewards, old_values, samples, policy_log_probs
    )
    reward_metrics |= off_policy_metrics(backend.dp, alg, samples, policy_log_probs)
    # Before the update: how well the values predict these returns (critic_health.py).
    health = _critic_health(backend, samples, old_values, returns, advantages)
    loss = functools.partial(_critic_micro_loss, backend, old_values, returns)
    metrics = run_epochs(backend, samples, loss) | health
    metrics["values_mean"] = masked_global_mean(backend.dp, old_values, samples.loss_mask)
    metrics["returns_mean"] = masked_global_mean(backend.dp, returns, samples.loss_mask)
    return metrics | reward_metrics, old_values, rewards


def _critic_health(
    backend: ModelBackend,
    samples: Samples,
    values: torch.Tensor,
    returns: torch.Tensor,
    advantages: torch.Tensor,
) -> dict[str, float]:
    """``critic_health``'s metrics of the step (``critic_health: false``: none). Their cost is measured
    once, in the algorithms guide, not logged: a timing among the metrics would make two equal runs'
    metrics differ."""
    if not backend.config.critic_health:
        return {}
    inputs = critic_health.inputs_of(samples, values, returns, advantages)
    return critic_health.critic_health(backend.dp, inputs)


def _critic_micro_loss(
    backend: ModelBackend, old_values: torch.Tensor, returns: torch.Tensor, micro: Micro
) -> dict[str, torch.Tensor]:
    alg, device, rows = backend.config.algorithm, backend.device, micro.rows
    values = backend.forward(micro.mb).values
    if values is None:
        raise RuntimeError("the critic's forward returned no values")
    loss, clipped = pm.value_loss(
        values, to_device(old_values[rows], device), to_device(returns[rows], device), alg.value_clip
    )
    value_loss = aggregate(alg, loss, micro.mask, micro.counts)
    return {
        "loss": value_loss,
        "value_loss": value_loss,
        "value_clip_fraction": token_mean(clipped, micro.mask, micro.counts),
    }


# ---------------------------------------------------------------------------------- the actor
@dataclass(frozen=True)
class ActorTargets:
    """What the actor's micro-batch losses compare the policy with, ``[N, R_max]`` each: the log-probs
    before the update, the reference's (KL loss), the advantages and the truncated IS weights."""

    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor | None
    advantages: torch.Tensor
    tis_weight: torch.Tensor | None


def train_actor(
    backend: ModelBackend,
    samples: Samples,
    values: torch.Tensor | None,
    rewards: torch.Tensor | None = None,
) -> dict[str, float]:
    """Old (and reference) log-probs, advantages (the estimator's: GAE with ``values``, or an outcome
    estimator), the mismatch metrics and correction, policy-loss steps.

    ``rewards``: the critic's per-token rewards (:func:`token_rewards`); required with ``kl_coef > 0``
    (only the critic holds the reference for them), else the outcome rewards are used.
    """
    if backend.config.role != "actor":
        raise RuntimeError("train_actor called on a critic")
    dp = backend.dp
    old_log_probs = score(backend, samples)
    ref_log_probs = score(backend, samples, reference=True) if backend.has_reference else None
    advantages, metrics = advantages_of(backend.config.algorithm, dp, samples, values, rewards, old_log_probs)
    metrics |= _policy_drift(backend, samples, old_log_probs, ref_log_probs)
    metrics |= mismatch_metrics(dp, backend.config.algorithm, samples, old_log_probs)
    tis_weight, trained, tis_metrics = rollout_correction(backend, samples, old_log_probs)
    targets = ActorTargets(old_log_probs, ref_log_probs, advantages, tis_weight)
    loss = functools.partial(_actor_micro_loss, backend, targets)
    return run_epochs(backend, trained, loss) | metrics | tis_metrics


def advantages_of(
    alg: AlgorithmConfig,
    dp: DataParallel,
    samples: Samples,
    values: torch.Tensor | None,
    rewards: torch.Tensor | None,
    log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's advantages ``[N, R_max]`` by ``alg.estimator`` (``ppo_trainer.estimators``: GAE over
    the critic's values and token rewards, or an outcome estimator over the samples' scores), whitened
    when ``alg.whiten_advantages``; their metrics. ``log_probs``: the actor's before its update, the
    target policy of ``off_policy_returns: vtrace``."""
    metrics: dict[str, float] = {}
    estimator = alg.estimator_info
    if estimator.uses_critic:
        if values is None:
            raise ValueError(f"estimator={alg.estimator!r} needs the critic's values")
        if rewards is None:
            if alg.kl_coef > 0.0:
                raise ValueError(
                    f"kl_coef={alg.kl_coef}: the actor trains on the critic's KL-shaped token rewards; "
                    "pass the rewards train_critic returned"
                )
            rewards = pm.token_rewards(samples.reward, samples.loss_mask, turn_rewards=samples.turn_rewards)
        metrics["token_reward_sum_mean"] = sample_mean(dp, (rewards * samples.loss_mask).sum(1))
        metrics |= off_policy_metrics(dp, alg, samples, log_probs)
    advantages = estimator.advantages(estimators.AdvantageInputs(alg, samples, rewards, values, log_probs))
    metrics["advantages_mean"] = masked_global_mean(dp, advantages, samples.loss_mask)
    # Group-normalised advantages are not whitened again (AlgorithmConfig.whiten_advantages).
    if alg.whiten_advantages:
        advantages = pm.whiten(advantages, samples.loss_mask, dp.all_reduce)
    return advantages, metrics


def off_policy_metrics(
    dp: DataParallel, alg: AlgorithmConfig, samples: Samples, log_probs: torch.Tensor | None
) -> dict[str, float]:
    """``off_policy_returns: vtrace``: its importance weights' ``vtrace_*`` metrics
    (``vtrace.weight_metrics``); none otherwise."""
    if alg.off_policy_returns != "vtrace" or log_probs is None:
        return {}
    log_rhos = log_probs - samples.rollout_log_probs
    return vtrace.weight_metrics(
        dp, log_rhos, samples.loss_mask, rho_bar=alg.vtrace_rho_bar, c_bar=alg.vtrace_c_bar, lam=alg.lam
    )


def _policy_drift(
    backend: ModelBackend,
    samples: Samples,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor | None,
) -> dict[str, float]:
    """How far the policy is from the reference and from the rollout's, and the batch's reward."""
    dp, alg = backend.dp, backend.config.algorithm
    metrics: dict[str, float] = {}
    if ref_log_probs is not None:
        ref_kl = pm.kl_estimate(old_log_probs, ref_log_probs, alg.kl_estimator)
        metrics["ref_kl"] = masked_global_mean(dp, ref_kl, samples.loss_mask)
    metrics["train_rollout_logp_abs_diff"] = masked_global_mean(
        dp, (old_log_probs - samples.rollout_log_probs).abs(), samples.loss_mask
    )
    n = dp.all_reduce(torch.tensor([float(len(samples)), float(samples.reward.sum())]))
    metrics["reward_mean"] = float(n[1] / n[0])
    return metrics


def mismatch_metrics(
    dp: DataParallel, alg: AlgorithmConfig, samples: Samples, old_log_probs: torch.Tensor
) -> dict[str, float]:
    """How far the engine's log-probs of the generated tokens are from the trainer's, every step:
    ``mismatch_kl_k1`` and ``mismatch_kl_k3`` (``KL(pi_rollout || pi_old)``, token means),
    ``mismatch_log_ratio_abs_max`` (the largest ``|log pi_old - log pi_rollout|`` of any rank) and
    ``mismatch_ratio_outside_band`` (the share of tokens whose ratio ``pi_old / pi_rollout`` is outside
    ``rollout_correction``'s band ``[reject_lower, reject_upper]``)."""
    mask = samples.loss_mask
    k1, k3 = pm.mismatch_kl(old_log_probs, samples.rollout_log_probs)
    band = alg.correction
    inside = pm.rejection_mask(-k1, mask, "token", band.lower_reject, band.reject_upper)
    # Each rank's max in its own slot: the sum over ranks then holds every rank's max.
    slots = torch.zeros(dp.world_size)
    slots[dp.rank] = pm.masked(k1.abs(), mask).max() if mask.numel() else 0.0
    return {
        "mismatch_kl_k1": masked_global_mean(dp, k1, mask),
        "mismatch_kl_k3": masked_global_mean(dp, k3, mask),
        "mismatch_log_ratio_abs_max": float(dp.all_reduce(slots).max()),
        "mismatch_ratio_outside_band": masked_global_mean(dp, 1.0 - inside, mask),
    }


def rollout_correction(
    backend: ModelBackend, samples: Samples, old_log_probs: torch.Tensor
) -> tuple[torch.Tensor | None, Samples, dict[str, float]]:
    """``algorithm.rollout_correction`` (with ``tis_cap`` folded in): the importance weight of each
    token's policy loss (None: off) and the samples to train on, their loss mask without the rejected
    tokens (which then count in no denominator, as in verl and slime); the metrics ``tis_weight_mean``,
    ``tis_capped_fraction`` (share of tokens the bound changed) and ``rejected_fraction``."""
    corr, dp = backend.config.algorithm.correction, backend.dp
    mask, metrics = samples.loss_mask, {}
    log_ratio = old_log_probs - samples.rollout_log_probs
    weight = None
    if corr.weight != "none":
        weight, bounded = pm.importance_weights(
            log_ratio, mask, corr.weight, corr.weight_bound, corr.weight_upper, corr.lower_weight
        )
        metrics["tis_weight_mean"] = masked_global_mean(dp, weight, mask)
        metrics["tis_capped_fraction"] = masked_global_mean(dp, bounded, mask)
    if corr.reject != "none":
        keep = pm.rejection_mask(log_ratio, mask, corr.reject, corr.lower_reject, corr.reject_upper)
        metrics["rejected_fraction"] = masked_global_mean(dp, 1.0 - keep, mask)
        samples = dataclasses.replace(samples, loss_mask=mask * keep)
    return weight, samples, metrics


def _actor_micro_loss(backend: ModelBackend, targets: ActorTargets, micro: Micro) -> dict[str, torch.Tensor]:
    alg, device, rows = backend.config.algorithm, backend.device, micro.rows
    mask, counts = micro.mask, micro.counts
    out = backend.forward(micro.mb, entropy=True)
    log_probs, entropy = out.log_probs, out.entropy
    if log_probs is None or entropy is None:
        raise RuntimeError("the actor's forward returned no log-probs or no entropy")
    terms = pm.policy_loss(
        log_probs,
        to_device(targets.old_log_probs[rows], device),
        to_device(targets.advantages[rows], device),
        alg.eps_clip,
        alg.eps_clip_high,
        alg.eps_clip_c,
    )
    tis = targets.tis_weight
    token_loss = terms.loss if tis is None else terms.loss * to_device(tis[rows], device)
    pg_loss = aggregate(alg, token_loss, mask, counts)
    # Aggregated like the loss it enters (verl's entropy metric is the same term).
    entropy_mean = aggregate(alg, entropy, mask, counts)
    loss = pg_loss - alg.entropy_coef * entropy_mean if alg.entropy_coef > 0 else pg_loss
    terms_out = {
        "pg_loss": pg_loss,
        "entropy": entropy_mean,
        "pg_clip_fraction": token_mean(terms.clip_fraction, mask, counts),
        "dual_clip_fraction": token_mean(terms.dual_clip_fraction, mask, counts),
        "ppo_kl": token_mean(terms.ppo_kl, mask, counts),
    }
    if alg.use_kl_loss:
        assert targets.ref_log_probs is not None  # needs_reference holds when use_kl_loss
        kl_term = pm.kl_estimate(log_probs, to_device(targets.ref_log_probs[rows], device), alg.kl_estimator)
        kl_loss = aggregate(alg, kl_term, mask, counts)
        loss = loss + alg.kl_loss_coef * kl_loss
        terms_out["kl_loss"] = kl_loss
    terms_out["loss"] = loss
    return terms_out


# ---------------------------------------------------------------------------------- the steps
def run_epochs(backend: ModelBackend, samples: Samples, micro_loss: MicroLoss) -> dict[str, float]:
    """PPO epochs x mini-batches of optimizer steps (the role's: ``AlgorithmConfig.epochs_for``,
    ``mini_batches_for``); ``micro_loss`` returns ``{"loss": .., metrics}``.
    The metrics come back averaged over the steps, with ``grad_norm`` and ``optimizer_steps``."""
    alg, dp, role = backend.config.algorithm, backend.dp, backend.config.role
    parts = alg.mini_batches_for(role)
    short = dp.all_reduce(torch.tensor([float(len(samples) < parts)]))
    if short.item() > 0:
        # Every rank must take the same number of optimizer steps (each one is a collective).
        raise ValueError(
            f"{int(short.item())} rank(s) hold fewer samples than num_mini_batches={parts} "
            f"(rank {dp.rank} holds {len(samples)}); lower num_mini_batches or send more samples"
        )
    totals: dict[str, float] = {}
    steps = 0
    backend.train_mode()
    for _ in range(alg.epochs_for(role)):
        for mini in split_even(len(samples), parts):
            reduced = _mini_batch_step(backend, samples, mini, micro_loss)
            for name, number in reduced.items():
                totals[name] = totals.get(name, 0.0) + number
            steps += 1
    return {name: value / steps for name, value in totals.items()} | {"optimizer_steps": float(steps)}


def _mini_batch_step(
    backend: ModelBackend, samples: Samples, mini: list[int], micro_loss: MicroLoss
) -> dict[str, float]:
    """One optimizer step over the mini-batch ``mini``, gradients accumulated over its micro-batches;
    its metrics summed over the ranks, and ``grad_norm``."""
    counts = global_counts(backend, samples.loss_mask[mini])
    sums: dict[str, torch.Tensor] = {}
    for rows in micro_batches_of(backend, samples, mini):
        mb = inputs_of(backend, samples, rows)
        terms = micro_loss(Micro(rows, mb, to_device(samples.loss_mask[rows], backend.device), counts))
        backend.backward(terms["loss"])
        # Summed where they are: one copy to the host per mini-batch, not a sync per micro-batch.
        for name, value in terms.items():
            sums[name] = sums.get(name, 0.0) + value.detach().float()
    reduced = reduce_metrics(backend.dp, sums)
    reduced["grad_norm"] = backend.optimizer_step()
    return reduced


# ---------------------------------------------------------------------------------- global means
def global_counts(backend: ModelBackend, mask: torch.Tensor) -> Counts:
    """The mini-batch's ``Counts`` (its loss mask ``mask`` on this rank, summed over the ranks)."""
    aggregation = backend.config.algorithm.loss_aggregation
    local = torch.stack(
        [pm.aggregation_denominator(mask, aggregation), pm.aggregation_denominator(mask, "token_mean")]
    )
    total = backend.dp.all_reduce(local).clamp(min=1.0)
    return Counts(loss=total[0], tokens=total[1])


def aggregate(alg: AlgorithmConfig, loss: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """A loss term's share of the mini-batch's loss, by ``loss_aggregation``."""
    scale = None if alg.loss_scale_factor is None else float(alg.loss_scale_factor)
    return pm.aggregate(loss, mask, alg.loss_aggregation, counts.loss, scale)


def token_mean(x: torch.Tensor, mask: torch.Tensor, counts: Counts) -> torch.Tensor:
    """A metric's share of its mean over the mini-batch's loss tokens."""
    return pm.aggregate(x, mask, "token_mean", counts.tokens)


def reduce_metrics(dp: DataParallel, sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each metric's sum over the ranks."""
    names = sorted(sums)
    total = dp.all_reduce(torch.stack([sums[n].detach().float().cpu() for n in names]))
    return {n: float(v) for n, v in zip(names, total.tolist(), strict=True)}


def masked_global_mean(dp: DataParallel, x: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean of ``x`` over the elements ``mask`` keeps, on every rank."""
    stats = dp.all_reduce(torch.stack([pm.masked_sum(x.float(), mask), mask.sum()]))
    return float(stats[0] / stats[1].clamp(min=1.0))


def sample_mean(dp: DataParallel, per_sample: torch.Tensor) -> float:
    """The mean of a per-sample value over every rank's samples."""
    stats = dp.all_reduce(torch.tensor([float(per_sample.double().sum()), float(len(per_sample))]))
    return float(stats[0] / stats[1].clamp(min=1.0))
