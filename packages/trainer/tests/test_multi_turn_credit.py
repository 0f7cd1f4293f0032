"""Credit across turns: GAE, rewards and losses over the generated (loss-mask) tokens of multi-turn samples.

A multi-turn response is each turn's generated tokens with the observation (tool, environment) tokens
between turns; ``loss_mask`` is 1 exactly on generated tokens. Three GAE variants:

- ``compute_gae`` over the loss mask (the default): observation tokens are skipped, so the result on the
  generated tokens is plain GAE on the sequence with the observations removed;
- ``compute_turn_gae`` (``gae_unit: turn``): one step per turn, re-stated below from AReaL,
  https://github.com/areal-project/AReaL commit 8966ca17970010a23094071cd8a55e1c53385955,
  ``areal/trainer/ppo/gae.py`` (``_compute_turn_level_gae``);
- ``compute_gae_through_observations`` (the ablation), re-stated below from OpenRLHF,
  https://github.com/OpenRLHF/OpenRLHF commit 3c3be6234e0cb353e76bb8019947db9dfe99fca7,
  ``openrlhf/trainer/ppo_utils/experience_maker.py`` (``get_advantages_and_returns``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_trainer import objective
from ppo_trainer import ppo_math as pm
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig

ATOL = 1e-5


# ---------------------------------------------------------------------------------- references
def openrlhf_gae(
    values: torch.Tensor, rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's get_advantages_and_returns: values and rewards times the action mask, then the
    recursion over every position; returns = advantages + (masked) values."""
    lastgaelam = torch.zeros(rewards.shape[0])
    reversed_advantages = []
    length = rewards.size(1)
    values = action_mask * values
    rewards = action_mask * rewards
    for t in reversed(range(length)):
        nextvalues = values[:, t + 1] if t < length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        reversed_advantages.append(lastgaelam)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return advantages, advantages + values


def areal_turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    discount: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's _compute_turn_level_gae for EOS-ended samples (seq_no_eos_mask = 0: no bootstrap): turn
    rewards summed over the turn's active tokens, the turn's value at its first active token, GAE over
    the turns, advantages and returns gathered back to the turn's tokens and multiplied by the mask.
    (Their returns keep ``values`` on inactive tokens; this project zeroes them, as it does in every GAE.)
    """
    bs, max_seqlen = rewards.shape
    valid = loss_mask.bool()
    safe_turn_ids = torch.clamp(turn_ids.long(), min=0, max=max_seqlen - 1)
    turn_rewards = torch.zeros_like(rewards)
    turn_rewards.scatter_add_(1, safe_turn_ids, rewards * valid.float())
    positions = torch.arange(max_seqlen).expand(bs, -1)
    first = torch.full_like(safe_turn_ids, max_seqlen)
    first.scatter_reduce_(
        1, safe_turn_ids, torch.where(valid, positions, torch.full_like(positions, max_seqlen)), "amin"
    )
    valid_turn = first < max_seqlen
    turn_values = values.gather(1, first.clamp(max=max_seqlen - 1)) * valid_turn.float()
    turn_advantages = torch.zeros(bs, max_seqlen)
    lastgaelam = torch.zeros(bs)
    nextvalues = torch.zeros(bs)
    for u in reversed(range(max_seqlen)):
        delta = turn_rewards[:, u] + discount * nextvalues - turn_values[:, u]
        newgaelam = delta + discount * gae_lambda * lastgaelam
        m = valid_turn[:, u]
        turn_advantages[:, u] = torch.where(m, newgaelam, torch.zeros_like(newgaelam))
        nextvalues = torch.where(m, turn_values[:, u], nextvalues)
        lastgaelam = torch.where(m, newgaelam, lastgaelam)
    turn_returns = turn_advantages + turn_values
    advantages = torch.gather(turn_advantages, 1, safe_turn_ids) * loss_mask
    returns = torch.gather(turn_returns, 1, safe_turn_ids) * loss_mask
    return advantages, returns


# ---------------------------------------------------------------------------------- strategies
@st.composite
def multi_turn(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A few samples of turns: generated tokens (1-4 each), then 0-3 observation tokens, right-padded."""
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        mask: list[float] = []
        ids: list[int] = []
        for turn in range(draw(st.integers(1, 4))):
            gen, obs = draw(st.integers(1, 4)), draw(st.integers(0, 3))
            mask += [1.0] * gen + [0.0] * obs
            ids += [turn] * (gen + obs)
        rows.append((mask, ids))
    width = max(len(m) for m, _ in rows) + draw(st.integers(0, 2))
    n = len(rows)
    floats = st.floats(-3, 3, allow_nan=False, width=32)
    size = n * width
    out = {
        "mask": torch.zeros(n, width),
        "response": torch.zeros(n, width),
        "turn_ids": torch.zeros(n, width, dtype=torch.int64),
        "rewards": torch.tensor(draw(st.lists(floats, min_size=size, max_size=size))).view(n, width),
        "values": torch.tensor(draw(st.lists(floats, min_size=size, max_size=size))).view(n, width),
    }
    for i, (mask, ids) in enumerate(rows):
        out["mask"][i, : len(mask)] = torch.tensor(mask)
        out["response"][i, : len(mask)] = 1.0
        out["turn_ids"][i, : len(ids)] = torch.tensor(ids)
    return out


GAMMA_LAM = st.tuples(st.sampled_from([0.0, 0.5, 0.9, 1.0]), st.sampled_from([0.0, 0.8, 0.95, 1.0]))


# ---------------------------------------------------------------------------------- token-level GAE
@settings(max_examples=80, deadline=None)
@given(multi_turn(), GAMMA_LAM)
def test_masked_gae_is_gae_on_the_sequence_without_observations(batch, gamma_lam) -> None:  # type: ignore[no-untyped-def]
    gamma, lam = gamma_lam
    mask = batch["mask"]
    adv, ret = pm.compute_gae(batch["rewards"], batch["values"], mask, gamma, lam)
    for i in range(mask.shape[0]):
        kept = mask[i] != 0
        r, v = batch["rewards"][i, kept][None], batch["values"][i, kept][None]
        a_c, ret_c = pm.compute_gae(r, v, torch.ones_like(r), gamma, lam)
        torch.testing.assert_close(adv[i, kept], a_c[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(ret[i, kept], ret_c[0], atol=ATOL, rtol=0)
        assert torch.all(adv[i, ~kept] == 0)
        assert torch.all(ret[i, ~kept] == 0)


def test_masked_gae_hand_values() -> None:
    # generated, generated, observation, observation, generated; the outcome 1 on the last generated token
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    rewards = pm.token_rewards(torch.tensor([1.0]), mask)
    values = torch.tensor([[0.5, 0.2, 7.0, -7.0, 0.4]])
    adv, ret = pm.compute_gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # compressed: V = [.5, .2, .4], r = [0, 0, 1]
    # A2 = 1 - .4 = .6;  A1 = (0 + .4 - .2) + .5 * .6 = .5;  A0 = (0 + .2 - .5) + .5 * .5 = -.05
    torch.testing.assert_close(adv, torch.tensor([[-0.05, 0.5, 0.0, 0.0, 0.6]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor([[0.45, 0.7, 0.0, 0.0, 1.0]]), atol=1e-6, rtol=0)
    # decaying through the two observations instead (the ablation) gives another answer
    adv_through, _ = pm.compute_gae_through_observations(rewards, values, mask, gamma=1.0, lam=0.5)
    assert not torch.allclose(adv_through, adv)


def test_outcome_lands_on_the_last_generated_token_at_gamma_zero_and_before_trailing_observations() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0, 0.0]])  # 2nd: ends in padding
    rewards = pm.token_rewards(torch.tensor([2.0, -1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0, 0.0]]
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9, 1.0]])
    adv, ret = pm.compute_gae(rewards, values, mask, gamma=0.0, lam=0.95)
    # gamma = 0: A_t = r_t - V_t on generated tokens, so only the last one sees the outcome
    torch.testing.assert_close(adv, torch.tensor([[-0.1, -0.2, 1.7, 0, 0], [-0.6, 0, -0.8, -1.9, 0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.0, 2.0, 0, 0], [0.0, 0, 0.0, -1.0, 0]]))


def test_turn_rewards_land_on_each_turns_last_generated_token() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    turns = torch.tensor([[0.0, 0.5, 0.0, 0.0, -0.25, 0.0, 0.0, 0.0]])
    kl = torch.full((1, 8), 0.1)
    rewards = pm.token_rewards(torch.tensor([1.0]), mask, kl, kl_coef=0.5, turn_rewards=turns)
    expected = torch.tensor([[0.0, 0.5, 0.0, 0.0, -0.25, 0.0, 1.0, 0.0]]) - 0.05 * mask
    torch.testing.assert_close(rewards, expected)
    # through Samples: the fields arrive per sample and are validated
    fields = _fields(mask[0], turns[0], torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]))
    samples = Samples.from_fields(fields)
    torch.testing.assert_close(samples.turn_rewards, turns)
    assert samples.turn_ids.tolist() == [[0, 0, 0, 1, 1, 1, 2, 2]]


# ---------------------------------------------------------------------------------- ablation
@settings(max_examples=60, deadline=None)
@given(multi_turn(), GAMMA_LAM)
def test_through_observations_is_openrlhfs_gae(batch, gamma_lam) -> None:  # type: ignore[no-untyped-def]
    gamma, lam = gamma_lam
    mask = batch["mask"]
    adv, ret = pm.compute_gae_through_observations(batch["rewards"], batch["values"], mask, gamma, lam)
    ref_adv, ref_ret = openrlhf_gae(batch["values"], batch["rewards"], mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv * mask, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, ref_ret * mask, atol=ATOL, rtol=0)


@settings(max_examples=40, deadline=None)
@given(multi_turn(), GAMMA_LAM)
def test_through_observations_equals_masked_gae_without_observations(batch, gamma_lam) -> None:  # type: ignore[no-untyped-def]
    gamma, lam = gamma_lam
    single = batch["response"]  # every response token generated: nothing to decay through
    masked_gae = pm.compute_gae(batch["rewards"], batch["values"], single, gamma, lam)
    through = pm.compute_gae_through_observations(batch["rewards"], batch["values"], single, gamma, lam)
    for a, b in zip(masked_gae, through, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------- turn-level GAE
@settings(max_examples=80, deadline=None)
@given(multi_turn(), GAMMA_LAM)
def test_turn_gae_is_areals(batch, gamma_lam) -> None:  # type: ignore[no-untyped-def]
    gamma, lam = gamma_lam
    args = (batch["rewards"], batch["values"], batch["mask"], batch["turn_ids"], gamma, lam)
    adv, ret = pm.compute_turn_gae(*args)
    ref_adv, ref_ret = areal_turn_gae(*args)
    torch.testing.assert_close(adv, ref_adv, atol=ATOL, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=ATOL, rtol=0)


@settings(max_examples=40, deadline=None)
@given(multi_turn(), GAMMA_LAM)
def test_turn_gae_with_one_token_per_turn_is_token_gae(batch, gamma_lam) -> None:  # type: ignore[no-untyped-def]
    gamma, lam = gamma_lam
    mask = batch["mask"]
    # every generated token starts a turn; the observations after it belong to it
    ids = (mask != 0).long().cumsum(dim=1).clamp(min=1) - 1
    turn = pm.compute_turn_gae(batch["rewards"], batch["values"], mask, ids, gamma, lam)
    token = pm.compute_gae(batch["rewards"], batch["values"], mask, gamma, lam)
    for a, b in zip(turn, token, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_turn_gae_hand_values() -> None:
    # turn 0: two generated tokens and an observation; turn 1: two generated tokens, then padding
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0, 0.0]])  # turn reward .5, outcome 1
    values = torch.tensor([[0.3, 9.0, 9.0, 0.6, 9.0, 9.0]])  # read at each turn's first token only
    adv, ret = pm.compute_turn_gae(rewards, values, mask, ids, gamma=1.0, lam=1.0)
    # A1 = 1 - .6 = .4;  A0 = (.5 + .6 - .3) + .4 = 1.2;  R = A + V: 1.5 and 1.0
    torch.testing.assert_close(adv, torch.tensor([[1.2, 1.2, 0.0, 0.4, 0.4, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.5, 0.0, 1.0, 1.0, 0.0]]))


# ---------------------------------------------------------------------------------- losses
def test_value_and_policy_losses_and_their_gradients_are_zero_on_observation_tokens() -> None:
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    obs = mask == 0
    # the critic's values and the policy's log-probs on observation tokens are real model outputs: finite
    values = torch.tensor([[0.1, 5.0, -3.0, 0.3], [0.2, 0.4, 1e6, 1.0]], requires_grad=True)
    old_values, returns = values.detach() + 0.05, torch.full((2, 4), 2.0)
    v_loss, _ = pm.value_loss(values, old_values, returns, value_clip=0.2)
    total = pm.aggregate(v_loss, mask, "token_mean")
    total.backward()
    assert torch.isfinite(total)
    assert values.grad is not None
    assert torch.all(values.grad[obs] == 0)
    assert torch.all(values.grad[~obs] != 0)

    log_probs = torch.tensor([[-1.0, -9.0, -30.0, -0.5], [-2.0, -0.1, 40.0, -3.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 3.0, 3.0, -1.0], [0.5, -0.5, 2.0, 2.0]])
    terms = pm.policy_loss(log_probs, torch.full((2, 4), -1.0), advantages, eps_clip=0.2)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        log_probs.grad = None
        loss = pm.aggregate(terms.loss, mask, mode)
        loss.backward(retain_graph=True)
        assert torch.isfinite(loss)
        assert log_probs.grad is not None
        assert torch.all(log_probs.grad[obs] == 0), mode
    # whatever the observation tokens hold, the masked loss is the same
    other_log_probs = torch.where(obs, torch.tensor(float("nan")), log_probs.detach())
    other = pm.policy_loss(other_log_probs, torch.full((2, 4), -1.0), advantages, 0.2)
    assert pm.aggregate(other.loss, mask, "token_mean") == pm.aggregate(terms.loss, mask, "token_mean")


# ---------------------------------------------------------------------------------- the objective
def _fields(
    mask: torch.Tensor, turn_rewards: torch.Tensor | None = None, turn_ids: torch.Tensor | None = None
) -> dict[str, list[torch.Tensor]]:
    r = mask.numel()
    fields = {
        "tokens": [torch.arange(r + 3) % 7],
        "response_length": [torch.tensor([r])],
        "loss_mask": [mask],
        "reward": [torch.tensor([1.0])],
        "rollout_log_probs": [-mask],
        "prompt_index": [torch.tensor([0])],
    }
    if turn_rewards is not None:
        fields["turn_rewards"] = [turn_rewards]
    if turn_ids is not None:
        fields["turn_ids"] = [turn_ids]
    return fields


def _batch(masks: list[list[float]], rewards: list[float], groups: list[int]) -> Samples:
    fields: dict[str, list[torch.Tensor]] = {k: [] for k in _fields(torch.ones(1))}
    for mask, reward, group in zip(masks, rewards, groups, strict=True):
        one = _fields(torch.tensor(mask))
        one["reward"] = [torch.tensor([reward])]
        one["prompt_index"] = [torch.tensor([group])]
        for k, v in one.items():
            fields[k] += v
    return Samples.from_fields(fields)


def test_grpo_broadcasts_its_advantage_over_generated_tokens_only() -> None:
    samples = _batch([[1, 0, 0, 1], [1, 1, 1, 1], [1, 1, 0]], [1.0, 0.0, 1.0], [0, 0, 1])
    alg = AlgorithmConfig(estimator="grpo")
    adv, _ = objective.advantages_of(alg, DataParallel(), samples, None, None)
    a = 1 / (2**0.5 / 2 + 1e-6) / 2  # (1 - .5) / (std + eps), unbiased std of {1, 0}
    expected = torch.tensor([[a, 0, 0, a], [-a, -a, -a, -a], [1 / (1 + 1e-6), 1 / (1 + 1e-6), 0, 0]])
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize(
    ("unit", "through"),
    [("token", False), ("token", True), ("turn", False)],
    ids=["masked", "through", "turn"],
)
def test_advantages_of_runs_the_configured_gae(unit: str, through: bool) -> None:
    mask = [1.0, 1.0, 0.0, 0.0, 1.0]
    fields = _fields(torch.tensor(mask), turn_ids=torch.tensor([0, 0, 0, 0, 1]))
    samples = Samples.from_fields(fields)
    values = torch.tensor([[0.5, 0.2, 7.0, -7.0, 0.4]])
    alg = AlgorithmConfig(
        gae_unit=unit, gae_through_observations=through, lam=0.5, normalize_advantages=False
    )
    adv, _ = objective.advantages_of(alg, DataParallel(), samples, values, None)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    m = torch.tensor([mask])
    if unit == "turn":
        expected, _ = pm.compute_turn_gae(rewards, values, m, samples.turn_ids, 1.0, 0.5)
    elif through:
        expected, _ = pm.compute_gae_through_observations(rewards, values, m, 1.0, 0.5)
    else:
        expected = torch.tensor([[-0.05, 0.5, 0.0, 0.0, 0.6]])
    torch.testing.assert_close(adv, expected)


def test_a_single_turn_batch_trains_on_exactly_the_same_numbers(fields_factory) -> None:  # type: ignore[no-untyped-def]
    """Without the new fields and with an all-ones loss mask, the rewards and advantages are those of
    the single-turn formulas bit for bit (explicit zero turn fields change nothing either)."""
    fields = fields_factory(6, seed=3)
    fields["loss_mask"] = [torch.ones_like(m) for m in fields["loss_mask"]]
    plain = Samples.from_fields(fields)
    explicit = Samples.from_fields(
        fields
        | {
            "turn_rewards": [torch.zeros_like(m) for m in fields["loss_mask"]],
            "turn_ids": [torch.zeros(m.numel(), dtype=torch.int64) for m in fields["loss_mask"]],
        }
    )
    values = torch.randn(plain.response_mask.shape, generator=torch.Generator().manual_seed(0))
    alg = AlgorithmConfig()
    old_rewards = pm.token_rewards(plain.reward, plain.response_mask)
    old_adv, _ = pm.compute_gae(old_rewards, values, plain.response_mask, alg.gamma, alg.lam)
    old_adv = pm.whiten(old_adv, plain.loss_mask)
    for samples in (plain, explicit):
        adv, _ = objective.advantages_of(alg, DataParallel(), samples, values, None)
        assert torch.equal(adv, old_adv)


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("turn_rewards", torch.tensor([0.0, 0.0, 1.0, 0.0]), "'turn_rewards' is 1.0 at response token 2"),
        ("turn_rewards", torch.tensor([0.0, 0.0, 0.0]), "'turn_rewards' has 3 entries"),
        ("turn_ids", torch.tensor([0, 1, 1, 0]), "'turn_ids' must be >= 0 and non-decreasing"),
        ("turn_ids", torch.tensor([-1, 0, 0, 0]), "'turn_ids' must be >= 0 and non-decreasing"),
        ("turn_ids", torch.tensor([0.0, 0.5, 1.0, 1.0]), "'turn_ids' holds non-integers"),
    ],
)
def test_turn_fields_are_validated(field: str, value: torch.Tensor, message: str) -> None:
    fields = _fields(torch.tensor([1.0, 1.0, 0.0, 1.0]))
    fields[field] = [value]
    with pytest.raises(ValueError, match=message):
        Samples.from_fields(fields)


def test_gae_options_are_validated() -> None:
    with pytest.raises(ValueError, match="gae_through_observations"):
        AlgorithmConfig(gae_unit="turn", gae_through_observations=True)
    with pytest.raises(ValueError, match=r"algorithm\.gae_unit"):
        AlgorithmConfig(estimator="grpo", gae_unit="turn")


# ---------------------------------------------------------------------------------- through a backend
def _multi_turn_fields(n: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """``n`` samples of two or three turns (generated tokens, then an observation), with turn rewards."""
    g = torch.Generator().manual_seed(seed)
    fields: dict[str, list[torch.Tensor]] = {
        k: [] for k in _fields(torch.ones(1), torch.ones(1), torch.ones(1))
    }
    for i in range(n):
        mask: list[float] = []
        ids: list[int] = []
        turns: list[float] = []
        for turn in range(int(torch.randint(2, 4, (1,), generator=g))):
            gen, obs = (int(x) for x in torch.randint(1, 4, (2,), generator=g))
            mask += [1.0] * gen + [0.0] * obs
            ids += [turn] * (gen + obs)
            turns += [0.0] * (gen - 1) + [float(torch.rand(1, generator=g))] + [0.0] * obs
        r = len(mask)
        fields["tokens"].append(torch.randint(0, 16, (3 + r,), generator=g))
        fields["response_length"].append(torch.tensor([r]))
        fields["loss_mask"].append(torch.tensor(mask))
        fields["reward"].append(torch.tensor([float(i % 2)]))
        fields["rollout_log_probs"].append(-torch.tensor(mask) * 2.5)
        fields["prompt_index"].append(torch.tensor([i // 2]))
        fields["turn_rewards"].append(torch.tensor(turns))
        fields["turn_ids"].append(torch.tensor(ids))
    return fields


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("unit", ["token", "turn"])
def test_the_critic_trains_on_the_configured_gae_of_multi_turn_samples(
    tiny_model, pack: bool, unit: str
) -> None:  # type: ignore[no-untyped-def]
    from ppo_trainer.backend import TorchTrainer
    from ppo_trainer.config import TrainerConfig

    samples = Samples.from_fields(_multi_turn_fields(6, seed=1))
    alg = AlgorithmConfig(gae_unit=unit, lam=0.9, num_mini_batches=1)
    config = TrainerConfig(
        role="critic", model_path=str(tiny_model), algorithm=alg, micro_batch_size=3, pack_sequences=pack
    )
    critic = TorchTrainer(config)
    values = critic.compute_values(samples)
    rewards = pm.token_rewards(samples.reward, samples.loss_mask, turn_rewards=samples.turn_rewards)
    if unit == "turn":
        _, returns = pm.compute_turn_gae(rewards, values, samples.loss_mask, samples.turn_ids, 1.0, 0.9)
    else:
        _, returns = pm.compute_gae(rewards, values, samples.loss_mask, 1.0, 0.9)
    metrics, old_values, trained_on = critic.train_critic(samples)
    torch.testing.assert_close(old_values, values)
    torch.testing.assert_close(trained_on, rewards)
    mask = samples.loss_mask
    assert metrics["returns_mean"] == pytest.approx(float((returns * mask).sum() / mask.sum()), abs=1e-5)
    assert torch.all(trained_on[mask == 0] == 0)
