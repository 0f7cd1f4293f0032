"""The estimator table (``ppo_trainer.estimators``): the configs follow its properties, and each
estimator's advantages match the references' published formulas.

Each ``verl_*`` / ``openrlhf_*`` function re-states, in this file's own code, a reference as published at:

- verl: https://github.com/volcengine/verl, commit b178a3cd56f58b2d502255daba591e92833930a7,
  ``verl/trainer/ppo/core_algos.py``: ``compute_rloo_outcome_advantage`` and
  ``compute_reinforce_plus_plus_baseline_outcome_advantage`` (with ``verl/utils/torch_functional.py``'s
  ``masked_whiten``: unbiased variance).
- OpenRLHF: https://github.com/OpenRLHF/OpenRLHF, commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
  ``openrlhf/trainer/ppo_utils/experience_maker.py``: the ``rloo`` and ``reinforce_baseline`` reward
  shaping in ``compute_advantages_and_returns``, ``get_cumulative_returns`` (gamma 1) and the batch
  normalisation it applies to ``reinforce_baseline`` (population variance, ``var.clamp(min=1e-8).rsqrt()``).
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ppo_trainer import estimators, objective
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig

ATOL = 1e-5


# ---------------------------------------------------------------------------------- references
def verl_scores(token_level_rewards: torch.Tensor, index: list[int]) -> tuple[torch.Tensor, dict, dict]:
    scores = token_level_rewards.sum(dim=-1)
    id2score: dict[int, list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    id2mean = {
        idx: torch.tensor(0.0) if len(v) == 1 else torch.mean(torch.stack(v)) for idx, v in id2score.items()
    }
    return scores.clone(), id2score, id2mean


def verl_rloo(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> torch.Tensor:
    scores, id2score, id2mean = verl_scores(token_level_rewards, index)
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


def verl_masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mean = (x * mask).sum() / (mask.sum() + 1e-8)
    n = mask.sum()
    var = (((x - mean) ** 2) * mask).sum() / (mask.sum() + 1e-8) * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def verl_reinforce_pp_baseline(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: list[int]
) -> torch.Tensor:
    scores, _, id2mean = verl_scores(token_level_rewards, index)
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, response_mask.shape[1]]) * response_mask
    return verl_masked_whiten(scores, response_mask) * response_mask


def openrlhf_outcome(
    rewards: torch.Tensor, n: int, action_mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Rewards of prompts with n samples each (consecutive): shaped by the estimator, put on each sample's
    last action token (compute_reward without KL), returns accumulated backwards at gamma 1; the
    reinforce_baseline advantages then normalised over the batch."""
    grouped = rewards.reshape(-1, n)
    if estimator == "rloo":
        baseline = (grouped.sum(-1, keepdim=True) - grouped) / (n - 1)
        grouped = grouped - baseline
    else:
        grouped = grouped - grouped.mean(-1, keepdim=True)
    shaped = grouped.reshape(-1)
    last = action_mask.cumsum(1).eq(action_mask.sum(1, keepdim=True)) & action_mask.bool()
    token_rewards = shaped[:, None] * last.float()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] * action_mask[:, t] + running
        returns[:, t] = running
    if estimator == "rloo":
        return returns
    count = action_mask.sum()
    mean = (returns * action_mask).sum() / count
    var = ((returns - mean).pow(2) * action_mask).sum() / count
    return (returns - mean) * var.clamp(min=1e-8).rsqrt()


# ---------------------------------------------------------------------------------- batches
def outcome_batch(rewards: list[float], groups: list[int], lengths: list[int]) -> Samples:
    """Single-turn samples (every response token generated) with the given rewards and prompts."""
    fields: dict[str, list[torch.Tensor]] = {
        "tokens": [torch.arange(r + 2) % 5 for r in lengths],
        "response_length": [torch.tensor([r]) for r in lengths],
        "loss_mask": [torch.ones(r) for r in lengths],
        "reward": [torch.tensor([x]) for x in rewards],
        "rollout_log_probs": [-torch.ones(r) for r in lengths],
        "prompt_index": [torch.tensor([g]) for g in groups],
    }
    return Samples.from_fields(fields)


def advantages(name: str, samples: Samples) -> torch.Tensor:
    adv, _ = objective.advantages_of(AlgorithmConfig(estimator=name), DataParallel(), samples, None, None)
    return adv


def token_level_rewards(samples: Samples) -> torch.Tensor:
    m = samples.loss_mask
    last = m.cumsum(1).eq(m.sum(1, keepdim=True)) & m.bool()
    return samples.reward[:, None] * last.float()


ROWS = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.0]), st.integers(1, 5)),
    min_size=2,
    max_size=14,
)


# ---------------------------------------------------------------------------------- RLOO
@settings(max_examples=60, deadline=None)
@given(ROWS)
def test_rloo_matches_verl_uneven_groups_and_singletons(rows) -> None:  # type: ignore[no-untyped-def]
    samples = outcome_batch([r for _, r, _ in rows], [g for g, _, _ in rows], [n for _, _, n in rows])
    expected = verl_rloo(token_level_rewards(samples), samples.response_mask, [g for g, _, _ in rows])
    torch.testing.assert_close(advantages("rloo", samples), expected, atol=ATOL, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6), st.integers(1, 4))
def test_rloo_matches_openrlhf(seed: int, n: int, prompts: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (n * prompts,), generator=g).float()
    lengths = torch.randint(1, 6, (n * prompts,), generator=g).tolist()
    samples = outcome_batch(rewards.tolist(), torch.arange(prompts).repeat_interleave(n).tolist(), lengths)
    expected = openrlhf_outcome(rewards, n, samples.response_mask, "rloo")
    torch.testing.assert_close(advantages("rloo", samples), expected, atol=ATOL, rtol=1e-5)


def test_rloo_hand_values() -> None:
    # group 0: rewards 1, 0, 0 -> 1 - 0, 0 - .5, 0 - .5; group 1 alone: its reward
    samples = outcome_batch([1.0, 0.0, 0.0, 3.0], [0, 0, 0, 1], [2, 1, 1, 1])
    expected = torch.tensor([[1.0, 1.0], [-0.5, 0.0], [-0.5, 0.0], [3.0, 0.0]])
    torch.testing.assert_close(advantages("rloo", samples), expected)


# ---------------------------------------------------------------------------------- REINFORCE++-baseline
@settings(max_examples=60, deadline=None)
@given(ROWS)
@example(rows=[(0, 1.0, 1), (0, 1.0, 1), (1, 1.0, 1)])  # equal scores, one group of one
def test_reinforce_pp_baseline_is_verls_up_to_bessel(rows) -> None:  # type: ignore[no-untyped-def]
    samples = outcome_batch([r for _, r, _ in rows], [g for g, _, _ in rows], [n for _, _, n in rows])
    ours = advantages("reinforce_plus_plus_baseline", samples)
    expected = verl_reinforce_pp_baseline(
        token_level_rewards(samples), samples.response_mask, [g for g, _, _ in rows]
    )
    # verl whitens with the unbiased variance, this project (and OpenRLHF) with the population one:
    # the same advantages scaled by sqrt(n / (n - 1)) over the n tokens, where the spread is not ~0.
    m = samples.loss_mask
    n = m.sum()
    # The spread that is whitened is of the scores less their group's mean (a one-sample group's
    # mean is 0, as in verl), not of the raw scores: equal scores in groups of one still vary.
    if float(expected.abs().max()) > 1e-3:
        torch.testing.assert_close(ours, expected * torch.sqrt(n / (n - 1)), atol=1e-4, rtol=1e-4)
    else:  # every centred score equal: nothing to prefer
        assert torch.all(ours == 0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 6), st.integers(1, 4))
def test_reinforce_pp_baseline_matches_openrlhf(seed: int, n: int, prompts: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (n * prompts,), generator=g).float()
    lengths = torch.randint(1, 6, (n * prompts,), generator=g).tolist()
    samples = outcome_batch(rewards.tolist(), torch.arange(prompts).repeat_interleave(n).tolist(), lengths)
    expected = openrlhf_outcome(rewards, n, samples.response_mask, "reinforce_baseline")
    m = samples.loss_mask.bool()
    ours = advantages("reinforce_plus_plus_baseline", samples)
    torch.testing.assert_close(ours[m], expected[m], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------- multi-turn scores
@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_outcome_estimators_score_turn_rewards_and_broadcast_over_generated_tokens(name: str) -> None:
    mask = [torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0, 1.0])]
    fields = {
        "tokens": [torch.arange(6), torch.arange(6)],
        "response_length": [torch.tensor([4]), torch.tensor([4])],
        "loss_mask": mask,
        "reward": [torch.tensor([1.0]), torch.tensor([1.0])],
        "rollout_log_probs": [-m for m in mask],
        "prompt_index": [torch.tensor([0]), torch.tensor([0])],
        "turn_rewards": [torch.tensor([0.0, 0.5, 0.0, 0.0]), torch.zeros(4)],
        "turn_ids": [torch.tensor([0, 0, 0, 1]), torch.tensor([0, 0, 1, 1])],
    }
    samples = Samples.from_fields(fields)
    assert estimators.sample_scores(samples).tolist() == [1.5, 1.0]
    adv = advantages(name, samples)
    assert torch.all(adv[samples.loss_mask == 0] == 0)
    first, second = adv[0, 0].item(), adv[1, 0].item()
    assert first > 0 > second  # the sample with the turn reward is the better one
    assert torch.all(adv[0][samples.loss_mask[0] == 1] == first)


# ---------------------------------------------------------------------------- the table drives the rules
@pytest.mark.parametrize("name", sorted(estimators.ESTIMATORS))
def test_the_configs_ask_the_estimators_properties(name: str) -> None:
    info = estimators.get(name)
    alg = AlgorithmConfig(estimator=name)
    assert alg.estimator_info is info
    assert alg.normalize_advantages is info.whiten_by_default
    if info.may_whiten:
        AlgorithmConfig(estimator=name, normalize_advantages=True)
    else:
        with pytest.raises(ValueError, match=r"algorithm\.normalize_advantages=true"):
            AlgorithmConfig(estimator=name, normalize_advantages=True)
    if info.uses_critic:
        AlgorithmConfig(estimator=name, kl_coef=0.1)
        TrainerConfig(role="critic", model_path="m", algorithm=alg)
    else:
        with pytest.raises(ValueError, match=r"algorithm.kl_coef > 0"):
            AlgorithmConfig(estimator=name, kl_coef=0.1)
        with pytest.raises(ValueError, match="a critic is not used"):
            TrainerConfig(role="critic", model_path="m", algorithm=alg)
    if not info.reads_norm_by_std:
        with pytest.raises(ValueError, match="norm_adv_by_std_in_grpo=false has no effect"):
            AlgorithmConfig(estimator=name, norm_adv_by_std_in_grpo=False)


def test_an_unknown_estimator_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"algorithm.estimator='reinforce' is not an estimator; use one of"):
        AlgorithmConfig(estimator="reinforce")
