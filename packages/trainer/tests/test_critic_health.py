"""Critic health (``critic_health.py``): the explained variance and its companions, computed exactly
over uneven micro-batches and over two real gloo ranks, against a hand computation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ppo_testsupport import run_ranks
from ppo_trainer import critic_health as ch
from ppo_trainer import estimators
from ppo_trainer import ppo_math as pm
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig

WORKER = Path(__file__).with_name("_critic_health_worker.py")


def step_of(fields: dict, seed: int = 0) -> tuple[Samples, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples, made-up values, and GAE's advantages and returns over the outcome rewards."""
    samples = Samples.from_fields(fields)
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(samples.response_mask.shape, generator=g) * samples.response_mask
    rewards = pm.token_rewards(samples.reward, samples.loss_mask)
    advantages, returns = pm.compute_gae(rewards, values, samples.loss_mask, 1.0, 0.95)
    return samples, values, advantages, returns


def by_hand(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the masked tokens, with numpy's (population) variance."""
    keep = mask.numpy() != 0
    r, v = returns.numpy()[keep].astype(np.float64), values.numpy()[keep].astype(np.float64)
    return float(1.0 - np.var(r - v) / np.var(r))


def test_sums_over_uneven_micro_batches_add_up_to_the_whole_batch(fields_factory: Callable) -> None:
    samples, values, advantages, returns = step_of(fields_factory(7, seed=3))
    whole = ch.inputs_of(samples, values, returns, advantages)
    value_range = (float(values.min()), float(values.max()))
    parts = []
    for rows in ([0, 1], [2, 3, 4], [5], [6]):  # micro-batches of 2, 3, 1 and 1 samples
        part = ch.HealthInputs(
            values=values[rows],
            returns=returns[rows],
            advantages=advantages[rows],
            loss_mask=samples.loss_mask[rows],
            response_mask=samples.response_mask[rows],
            turn_ids=samples.turn_ids[rows],
            scores=whole.scores[rows],
            baselines={k: v[rows] for k, v in whole.baselines.items()},
            grouped=whole.grouped[rows],
        )
        parts.append(ch.local_sums(part, value_range))
    summed = ch.finalize(torch.stack(parts).sum(0))
    direct = ch.finalize(ch.local_sums(whole, value_range))
    assert summed.keys() == direct.keys()
    for name, value in direct.items():
        assert summed[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    expected = by_hand(values, returns, samples.loss_mask)
    assert direct["explained_variance"] == pytest.approx(expected, rel=1e-9)
    # The mean of the micro-batches' own explained variances (RLinf #1297) is another number.
    per_micro = []
    for rows in ([0, 1], [2, 3, 4], [5, 6]):
        per_micro.append(by_hand(values[rows], returns[rows], samples.loss_mask[rows]))
    assert float(np.mean(per_micro)) != pytest.approx(expected, rel=1e-3)


def random_health_inputs(n: int, width: int, longest: int, seed: int) -> tuple[ch.HealthInputs, list[int]]:
    """``n`` samples of 1 .. ``longest`` response tokens, padded to ``width`` with values, returns and
    turn ids that must not count; a quarter of the generated tokens masked out (observations); turn ids
    non-decreasing up to 10 (past ``MAX_TURNS``). Returns the inputs and the response lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    loss_mask = response_mask * (torch.rand(n, width, generator=g) > 0.25)
    steps = (torch.rand(n, width, generator=g) < 0.3).long()
    turn_ids = torch.where(
        response_mask > 0, steps.cumsum(1).clamp(max=10), torch.randint(0, 12, (n, width), generator=g)
    )
    inputs = ch.HealthInputs(
        values=torch.randn(n, width, generator=g),
        returns=torch.randn(n, width, generator=g) + torch.where(response_mask > 0, 0.0, 1e3),
        advantages=torch.randn(n, width, generator=g),
        loss_mask=loss_mask,
        response_mask=response_mask,
        turn_ids=turn_ids,
        scores=torch.randn(n, generator=g),
        baselines={},
        grouped=torch.zeros(n, dtype=torch.bool),
    )
    return inputs, lengths


def per_group_sums(inputs: ch.HealthInputs, lengths: list[int]) -> np.ndarray:
    """``[1 + POSITION_BUCKETS + MAX_TURNS, 5]``: sum w, w R, w R^2, w D, w D^2 (D = R - V) for the whole
    step, each tenth of the response and each turn, one token at a time."""
    out = np.zeros((1 + ch.POSITION_BUCKETS + ch.MAX_TURNS, 5))
    for i, length in enumerate(lengths):
        for t in range(length):
            w, v, r = (float(x[i, t]) for x in (inputs.loss_mask, inputs.values, inputs.returns))
            terms = np.array([w, w * r, w * r * r, w * (r - v), w * (r - v) ** 2])
            turn = min(int(inputs.turn_ids[i, t]), ch.MAX_TURNS - 1)
            for group in (0, 1 + t * ch.POSITION_BUCKETS // length, 1 + ch.POSITION_BUCKETS + turn):
                out[group] += terms
    return out


def rows_of(inputs: ch.HealthInputs, rows: list[int]) -> ch.HealthInputs:
    """The ``rows`` samples, as wide as their own longest response (as one rank's tensors are)."""
    width = int(inputs.response_mask[rows].sum(1).max())
    fields = {k: getattr(inputs, k)[rows][:, :width] for k in ("values", "returns", "advantages")}
    fields |= {k: getattr(inputs, k)[rows][:, :width] for k in ("loss_mask", "response_mask", "turn_ids")}
    return ch.HealthInputs(**fields, scores=inputs.scores[rows], baselines={}, grouped=inputs.grouped[rows])


@pytest.mark.parametrize(("longest", "seed"), [(13, 0), (13, 1), (37, 2), (3, 3)])
def test_grouped_sums_match_a_per_group_computation(longest: int, seed: int) -> None:
    inputs, lengths = random_health_inputs(9, longest + 4, longest, seed)
    expected = per_group_sums(inputs, lengths)
    groups = len(expected)
    whole = ch.local_sums(inputs, (-1.0, 1.0))[: 5 * groups].reshape(groups, 5).numpy()
    np.testing.assert_allclose(whole, expected, rtol=1e-12, atol=1e-12)
    # Two ranks' sums (uneven shares, each as wide as its own longest response) add up to the whole's.
    ranks = [ch.local_sums(rows_of(inputs, rows), (-1.0, 1.0)) for rows in ([0, 1, 2], [3, 4, 5, 6, 7, 8])]
    merged = (ranks[0] + ranks[1])[: 5 * groups].reshape(groups, 5).numpy()
    np.testing.assert_allclose(merged, expected, rtol=1e-12, atol=1e-12)
    # Each tenth's metric is its own sums' (absent for an empty one); the whole step's is every token's.
    got = ch.finalize(ranks[0] + ranks[1])
    for b in range(ch.POSITION_BUCKETS):
        want = ch.explained_variance(torch.from_numpy(expected[1 + b]))
        assert got.get(f"ev_pos_{b}") == (None if want is None else pytest.approx(want, rel=1e-9)), b
    assert got["explained_variance"] == pytest.approx(
        by_hand(inputs.values, inputs.returns, inputs.loss_mask)
    )
    assert expected[0, 0] == float((inputs.loss_mask != 0).sum())  # the padding counted nowhere
    empty = {b for b in range(ch.POSITION_BUCKETS) if expected[1 + b, 0] == 0}
    assert not {f"ev_pos_{b}" for b in empty} & got.keys()
    if longest == 3:  # responses of 1-3 tokens: only the tenths 0, 3, 5 and 6 can hold a token
        assert empty >= {1, 2, 4, 7, 8, 9}


def test_a_perfect_critic_explains_everything_and_a_constant_one_nothing(fields_factory: Callable) -> None:
    samples, _values, advantages, returns = step_of(fields_factory(6, seed=4))
    dp = DataParallel()
    perfect = ch.critic_health(dp, ch.inputs_of(samples, returns.clone(), returns, advantages))
    assert perfect["explained_variance"] == pytest.approx(1.0)
    constant = ch.critic_health(dp, ch.inputs_of(samples, torch.full_like(returns, 0.3), returns, advantages))
    assert constant["explained_variance"] == pytest.approx(0.0, abs=1e-9)


def test_position_buckets_are_tenths_of_each_response() -> None:
    mask = torch.zeros(2, 10)
    mask[0, :] = 1.0
    mask[1, :3] = 1.0
    buckets = ch.positions(mask)
    assert buckets[0].tolist() == list(range(10))
    assert buckets[1, :3].tolist() == [0, 3, 6]


def test_position_and_turn_metrics_match_a_hand_computation() -> None:
    # Two samples of 4 response tokens, two turns each (tokens 0-1 turn 0, 2-3 turn 1).
    values = torch.tensor([[0.1, 0.4, 0.2, 0.9], [0.5, 0.3, 0.8, 0.0]])
    returns = torch.tensor([[0.0, 1.0, 0.5, 1.0], [1.0, 0.0, 1.0, 0.2]])
    ones = torch.ones(2, 4)
    turns = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1]])
    inputs = ch.HealthInputs(
        values=values,
        returns=returns,
        advantages=returns - values,
        loss_mask=ones,
        response_mask=ones,
        turn_ids=turns,
        scores=torch.tensor([1.0, 0.2]),
        baselines={},
        grouped=torch.zeros(2, dtype=torch.bool),
    )
    got = ch.critic_health(DataParallel(), inputs)
    first_turn = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.float32)
    assert got["ev_turn_1"] == pytest.approx(by_hand(values, returns, first_turn))
    assert got["ev_turn_2"] == pytest.approx(by_hand(values, returns, 1 - first_turn))
    # Position tenths of a 4-token response: tokens 0, 1, 2, 3 are in tenths 0, 2, 5, 7.
    assert {k for k in got if k.startswith("ev_pos_")} == {"ev_pos_0", "ev_pos_2", "ev_pos_5", "ev_pos_7"}
    assert got["ev_pos_0"] == pytest.approx(1 - np.var([-0.1, 0.5]) / np.var([0.0, 1.0]))
    # The first value against the score: (0.1, 1.0) and (0.5, 0.2).
    assert got["first_value_vs_score_corr"] == pytest.approx(-1.0)
    assert got["first_value_score_abs_gap"] == pytest.approx((0.9 + 0.3) / 2)
    assert not any(k.startswith("adv_") for k in got)


def test_single_turn_steps_log_no_turns(fields_factory: Callable) -> None:
    samples, values, advantages, returns = step_of(fields_factory(6, seed=5))
    got = ch.critic_health(DataParallel(), ch.inputs_of(samples, values, returns, advantages))
    assert not any(k.startswith("ev_turn_") for k in got)
    assert "explained_variance" in got


def test_calibration_deciles_hold_the_mean_value_and_return() -> None:
    values = torch.arange(100, dtype=torch.float32)[None, :]
    ones = torch.ones(1, 100)
    inputs = ch.HealthInputs(
        values=values,
        returns=2 * values,
        advantages=values,
        loss_mask=ones,
        response_mask=ones,
        turn_ids=torch.zeros(1, 100, dtype=torch.int64),
        scores=torch.zeros(1),
        baselines={},
        grouped=torch.zeros(1, dtype=torch.bool),
    )
    got = ch.critic_health(DataParallel(), inputs)
    for d in range(10):
        assert got[f"calib_value_d{d}"] == pytest.approx(10 * d + 4.5)
        assert got[f"calib_return_d{d}"] == pytest.approx(2 * (10 * d + 4.5))


def test_group_baselines_compared_with_the_critics_advantages_by_hand() -> None:
    # Two prompts of two one-token samples; gamma = lam = 1: A = score - V at the only token.
    fields = {
        "tokens": [torch.tensor([1, 2, 3])] * 4,
        "response_length": [torch.tensor([1])] * 4,
        "loss_mask": [torch.ones(1)] * 4,
        "reward": [torch.tensor([r]) for r in (1.0, 0.0, 1.0, 1.0)],
        "rollout_log_probs": [torch.zeros(1)] * 4,
        "prompt_index": [torch.tensor([p]) for p in (0, 0, 1, 1)],
    }
    samples = Samples.from_fields(fields)
    values = torch.tensor([[0.6], [0.5], [0.9], [0.8]])
    rewards = pm.token_rewards(samples.reward, samples.loss_mask)
    advantages, returns = pm.compute_gae(rewards, values, samples.loss_mask, 1.0, 1.0)
    got = ch.critic_health(DataParallel(), ch.inputs_of(samples, values, returns, advantages))
    a = np.array([0.4, -0.5, 0.1, 0.2])
    grpo = np.array([0.5, -0.5, 0.0, 0.0])  # centred on the group's mean (reward units)
    rloo = np.array([1.0, -1.0, 0.0, 0.0])  # minus the other sample's reward
    assert got["adv_var_ratio_grpo"] == pytest.approx(np.var(grpo) / np.var(a))
    assert got["adv_var_ratio_rloo"] == pytest.approx(np.var(rloo) / np.var(a))
    assert got["adv_corr_grpo"] == pytest.approx(np.corrcoef(a, grpo)[0, 1])
    assert got["adv_corr_rloo"] == pytest.approx(np.corrcoef(a, rloo)[0, 1])


def test_group_baselines_are_the_estimator_tables_in_reward_units(fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(6, seed=8, samples_per_prompt=3))
    got = estimators.baseline_advantages(samples, ("grpo", "rloo"))
    scores = estimators.sample_scores(samples)
    centred = pm.grpo_advantages(scores, samples.prompt_index, norm_by_std=False)
    assert torch.allclose(got["grpo"], centred[:, None] * samples.loss_mask)
    assert torch.allclose(
        got["rloo"], pm.rloo_advantages(scores, samples.prompt_index)[:, None] * samples.loss_mask
    )
    with pytest.raises(ValueError, match="not a group-baseline"):
        estimators.baseline_advantages(samples, ("ppo",))


def test_two_gloo_ranks_give_the_whole_batchs_numbers(tmp_path: Path, fields_factory: Callable) -> None:
    fields = fields_factory(8, seed=6, samples_per_prompt=2)
    samples, values, advantages, returns = step_of(fields)
    expected = ch.critic_health(DataParallel(), ch.inputs_of(samples, values, returns, advantages))
    # Rank 0 holds 1 prompt (2 samples), rank 1 holds 3 (6 samples): uneven, groups whole.
    run_ranks(WORKER, 2, lambda r: [tmp_path / f"{r}.json"], timeout_s=120)
    for rank in range(2):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            assert got[name] == pytest.approx(value, rel=1e-9, abs=1e-12), (rank, name)
    assert by_hand(values, returns, samples.loss_mask) == pytest.approx(expected["explained_variance"])


def test_the_critic_step_logs_its_health_unless_switched_off(
    tiny_model: Path, fields_factory: Callable
) -> None:
    from ppo_trainer.backend import TorchTrainer

    samples = Samples.from_fields(fields_factory(6, seed=9))
    alg = AlgorithmConfig(num_mini_batches=1)
    on = TorchTrainer(TrainerConfig(role="critic", model_path=str(tiny_model), algorithm=alg))
    metrics, values, rewards = on.train_critic(samples)
    _, returns = pm.compute_gae(rewards, values, samples.loss_mask, alg.gamma, alg.lam)
    # Measured on the values before the update (the ones handed to the actor).
    assert metrics["explained_variance"] == pytest.approx(by_hand(values, returns, samples.loss_mask))
    assert {"ev_pos_0", "first_value_vs_score_corr", "adv_var_ratio_grpo"} <= metrics.keys()
    assert not [k for k in metrics if k.endswith("_s")]  # no timing: equal runs log equal metrics
    off = TorchTrainer(
        TrainerConfig(role="critic", model_path=str(tiny_model), algorithm=alg, critic_health=False)
    )
    assert "explained_variance" not in off.train_critic(samples)[0]


def test_the_critic_takes_its_own_epochs_and_mini_batches(tiny_model: Path, fields_factory: Callable) -> None:
    from ppo_trainer.backend import TorchTrainer

    samples = Samples.from_fields(fields_factory(8, seed=10))
    alg = AlgorithmConfig(num_mini_batches=4, ppo_epochs=1, critic_num_mini_batches=2, critic_ppo_epochs=3)
    critic = TorchTrainer(TrainerConfig(role="critic", model_path=str(tiny_model), algorithm=alg))
    assert critic.train_critic(samples)[0]["optimizer_steps"] == 6.0
    actor = TorchTrainer(TrainerConfig(role="actor", model_path=str(tiny_model), algorithm=alg))
    values = torch.zeros(samples.response_mask.shape)
    assert actor.train_actor(samples, values)["optimizer_steps"] == 4.0
    with pytest.raises(ValueError, match="critic_ppo_epochs"):
        AlgorithmConfig(estimator="grpo", critic_ppo_epochs=2)
