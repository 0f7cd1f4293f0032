"""The torch backend in one process: positions of log-probs and values, the critic's checkpoint
handling, micro-batching, and the PPO/GRPO updates."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_model
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from ppo_trainer import ppo_math as pm
from ppo_trainer import sharding
from ppo_trainer.backend import TorchTrainer
from ppo_trainer.backend_protocol import DataParallel
from ppo_trainer.batch import Samples
from ppo_trainer.config import AlgorithmConfig, TrainerConfig
from ppo_trainer.models import count_parameters, load_critic, load_policy_state_into_critic


def trainer(model: Path, role: str = "actor", **kwargs) -> TorchTrainer:  # type: ignore[no-untyped-def]
    alg = kwargs.pop("algorithm", AlgorithmConfig(lam=1.0, num_mini_batches=1))
    lr = kwargs.pop("lr", 1e-2)
    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        algorithm=alg,
        actor_lr=lr,
        critic_lr=lr,
        **kwargs,
    )
    return TorchTrainer(config)


def test_log_probs_are_taken_before_each_response_token(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(5, seed=3))
    t = trainer(tiny_model, micro_batch_size=2)
    got = t.compute_log_probs(samples)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).float().eval()
    for i, tokens in enumerate(samples.tokens):
        r = int(samples.response_lengths[i])
        p = tokens.numel() - r
        with torch.no_grad():
            logp = torch.log_softmax(model(tokens[None]).logits[0].float(), -1)
        expected = torch.stack([logp[p + k - 1, tokens[p + k]] for k in range(r)])
        torch.testing.assert_close(got[i, :r], expected, atol=1e-5, rtol=1e-5)
        assert got[i, r:].abs().sum() == 0.0


def test_critic_values_are_read_at_the_token_before(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(5, seed=4))
    t = trainer(tiny_model, role="critic", micro_batch_size=3)
    got = t.compute_values(samples)
    critic = t.model
    for i, tokens in enumerate(samples.tokens):
        r = int(samples.response_lengths[i])
        p = tokens.numel() - r
        with torch.no_grad():
            hidden = critic.backbone(input_ids=tokens[None]).last_hidden_state[0]
            per_position = critic.value_head(hidden).squeeze(-1)
        torch.testing.assert_close(got[i, :r], per_position[p - 1 : p - 1 + r], atol=1e-5, rtol=1e-5)


def test_critic_loads_a_policy_checkpoint_with_a_fresh_head(tiny_model: Path, tmp_path: Path) -> None:
    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    critic = load_critic(tiny_model, seed=7)
    backbone = dict(critic.backbone.named_parameters())
    for name, p in policy.named_parameters():
        if name.startswith("model."):
            torch.testing.assert_close(backbone[name[len("model.") :]], p, atol=0, rtol=0)
    head = critic.value_head.weight.detach().clone()
    assert head.abs().sum() > 0
    torch.testing.assert_close(load_critic(tiny_model, seed=7).value_head.weight, head)  # seeded
    # A policy state dict (e.g. an actor's model.safetensors) loads into a critic; the head stays fresh.
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    save_model(policy, str(tmp_path / "policy.safetensors"))
    missing = load_policy_state_into_critic(critic, load_file(str(tmp_path / "policy.safetensors")))
    assert missing == ["value_head.weight", "value_head.bias"]
    torch.testing.assert_close(critic.value_head.weight, head)
    torch.testing.assert_close(critic.backbone.norm.weight, policy.model.norm.weight)
    # Something that is not this architecture is refused with the reason.
    bad = {"model.norm.weight": torch.zeros(3)}
    with pytest.raises(ValueError, match="shape"):
        load_policy_state_into_critic(critic, bad)
    with pytest.raises(ValueError, match="backbone tensors"):
        load_policy_state_into_critic(critic, {"lm_head.weight": policy.lm_head.weight})


def test_model_path_without_config_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        trainer(tmp_path)


def test_batch_validation_names_the_field(fields_factory: Callable) -> None:
    fields = fields_factory(3, seed=0)
    fields["loss_mask"][1] = torch.ones(99)
    with pytest.raises(ValueError, match="sample 1: field 'loss_mask'"):
        Samples.from_fields(fields)
    fields = fields_factory(3, seed=0)
    del fields["reward"]
    with pytest.raises(ValueError, match="reward"):
        Samples.from_fields(fields)
    fields = fields_factory(3, seed=0)
    fields["response_length"][0] = torch.tensor([fields["tokens"][0].numel()])
    with pytest.raises(ValueError, match="response_length"):
        Samples.from_fields(fields)
    samples = Samples.from_fields(fields_factory(3, seed=0))
    with pytest.raises(ValueError, match="2 tensors for a batch of 3"):
        samples.pad_values([torch.zeros(1), torch.zeros(1)])


@pytest.mark.parametrize("aggregation", pm.LOSS_AGGREGATIONS)
def test_micro_batch_size_does_not_change_the_update(
    tiny_model: Path, fields_factory: Callable, aggregation: str
) -> None:
    samples = Samples.from_fields(fields_factory(6, seed=5))
    values = torch.randn(len(samples), samples.max_response) * samples.response_mask
    scale = 8 if aggregation == "seq_mean_token_sum_norm" else None
    alg = AlgorithmConfig(
        num_mini_batches=1,
        lam=0.9,
        loss_aggregation=aggregation,  # type: ignore[arg-type]
        loss_scale_factor=scale,
        entropy_coef=0.01,
    )
    updated = []
    for micro in (1, 4, 6):
        t = trainer(tiny_model, micro_batch_size=micro, algorithm=alg)
        # Plain SGD makes the update proportional to the gradient (Adam's first step is ~lr * sign(g),
        # which magnifies float noise on near-zero gradients).
        t.optimizer = torch.optim.SGD(t.params, lr=1.0)
        t.train_actor(samples, values)
        updated.append(torch.cat([p.detach().reshape(-1) for p in t.model.parameters()]))
    torch.testing.assert_close(updated[0], updated[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(updated[0], updated[2], atol=1e-6, rtol=1e-5)


def test_critic_value_loss_goes_down(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=6))
    t = trainer(tiny_model, role="critic", micro_batch_size=3, lr=1e-3)
    losses = [t.train_critic(samples)[0]["value_loss"] for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_grpo_and_kl_loss_train_without_a_critic(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=8, samples_per_prompt=4))
    alg = AlgorithmConfig(
        num_mini_batches=1,
        estimator="grpo",
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_estimator="k3",
        ppo_epochs=2,
    )
    t = trainer(tiny_model, algorithm=alg, micro_batch_size=4)
    assert t.reference is not None
    first = t.train_actor(samples, None)
    assert first["ref_kl"] == pytest.approx(0.0, abs=1e-7)  # the policy starts as the reference
    assert first["optimizer_steps"] == 2.0
    second = t.train_actor(samples, None)
    assert second["ref_kl"] > 0.0
    assert second["kl_loss"] > 0.0
    assert not any(p.requires_grad for p in t.reference.parameters())


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_trains_on_the_group_advantages_as_they_are(
    tiny_model: Path, fields_factory: Callable, monkeypatch: pytest.MonkeyPatch, norm_by_std: bool
) -> None:
    """No second whitening: a group of equal rewards has zero advantages on every token, the others
    their group's normalised (or, Dr. GRPO, centred) reward, not shifted by the batch's mean."""
    fields = fields_factory(8, seed=8, samples_per_prompt=4)
    fields["reward"] = [torch.tensor([r]) for r in (1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)]
    samples = Samples.from_fields(fields)
    seen: list[torch.Tensor] = []
    original = pm.policy_loss

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(args[2].detach().cpu())  # the advantages of the micro-batch
        return original(*args, **kwargs)

    monkeypatch.setattr(pm, "policy_loss", spy)
    alg = AlgorithmConfig(estimator="grpo", num_mini_batches=1, norm_adv_by_std_in_grpo=norm_by_std)
    trainer(tiny_model, algorithm=alg, micro_batch_size=8).train_actor(samples, None)
    advantages = seen[0]
    assert advantages[:4].abs().max().item() == 0.0
    std = torch.tensor([1.0, 0.0, 0.0, 0.0]).std().item() if norm_by_std else 1.0
    eps = 1e-6 if norm_by_std else 0.0
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + eps)
    # broadcast over the generated (loss-mask) tokens only
    torch.testing.assert_close(advantages[4:], expected[:, None] * samples.loss_mask[4:])


def test_ppo_actor_moves_towards_rewarded_responses(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=9))
    values = torch.zeros(len(samples), samples.max_response)
    alg = AlgorithmConfig(lam=1.0, eps_clip=0.2, kl_coef=0.0, num_mini_batches=1)
    t = trainer(tiny_model, algorithm=alg, micro_batch_size=4)
    before = t.compute_log_probs(samples)
    for _ in range(4):
        metrics = t.train_actor(samples, values)
    after = t.compute_log_probs(samples)
    gain = ((after - before) * samples.loss_mask).sum(1) / samples.loss_mask.sum(1).clamp(min=1)
    rewarded = samples.reward > 0
    assert gain[rewarded].mean() > gain[~rewarded].mean()
    assert 0.0 <= metrics["pg_clip_fraction"] <= 1.0


def _reference_log_probs(model: Path, samples: Samples) -> torch.Tensor:
    """Log-probs of each response token under the model as loaded (the reference), computed apart."""
    reference = AutoModelForCausalLM.from_pretrained(model).float().eval()
    out = torch.zeros(len(samples), samples.max_response)
    for i, tokens in enumerate(samples.tokens):
        r = int(samples.response_lengths[i])
        p = tokens.numel() - r
        with torch.no_grad():
            logp = torch.log_softmax(reference(tokens[None]).logits[0].float(), -1)
        out[i, :r] = torch.stack([logp[p + k - 1, tokens[p + k]] for k in range(r)])
    return out


def test_critic_targets_include_the_kl_penalty(tiny_model: Path, fields_factory: Callable) -> None:
    """Reward-level KL: the critic shapes the rewards from the rollout's and the reference's log-probs,
    its returns (the value targets) carry the penalty, and the actor trains on the same rewards."""
    samples = Samples.from_fields(fields_factory(8, seed=21))
    alg = AlgorithmConfig(lam=1.0, gamma=1.0, kl_coef=0.5, kl_estimator="k1", num_mini_batches=1)
    critic = trainer(tiny_model, role="critic", algorithm=alg, micro_batch_size=3)
    assert critic.reference is not None
    mask = samples.loss_mask  # rewards and their KL live on the generated tokens only
    kl = (samples.rollout_log_probs - _reference_log_probs(tiny_model, samples)) * mask
    last = mask.cumsum(1).eq(mask.sum(1, keepdim=True)) * mask  # each sample's last generated token
    expected = samples.reward[:, None] * last - 0.5 * kl
    rewards, reward_metrics = critic.token_rewards(samples)
    torch.testing.assert_close(rewards, expected, atol=1e-5, rtol=1e-5)
    assert reward_metrics["reward_kl"] != 0.0

    metrics, _, trained_on = critic.train_critic(samples)
    torch.testing.assert_close(trained_on, expected, atol=1e-5, rtol=1e-5)
    # gamma = lambda = 1: each target is the sum of the rewards from that token on.
    returns = expected.flip(1).cumsum(1).flip(1)
    plain = (samples.reward[:, None] * last).flip(1).cumsum(1).flip(1)
    target_mean = float((returns * samples.loss_mask).sum() / samples.loss_mask.sum())
    plain_mean = float((plain * samples.loss_mask).sum() / samples.loss_mask.sum())
    assert metrics["returns_mean"] == pytest.approx(target_mean, abs=1e-5)
    assert abs(target_mean - plain_mean) > 0.1  # the penalty moves the targets

    actor = trainer(tiny_model, algorithm=alg, micro_batch_size=4)
    assert actor.reference is None  # reward-level KL needs no reference on the actor
    values = torch.zeros(len(samples), samples.max_response)
    with pytest.raises(ValueError, match="the actor trains on the critic's KL-shaped token rewards"):
        actor.train_actor(samples, values)
    actor_metrics = actor.train_actor(samples, values, trained_on)
    assert actor_metrics["token_reward_sum_mean"] == pytest.approx(metrics["token_reward_sum_mean"], abs=1e-6)


def test_truncated_importance_sampling_weights(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=22))
    values = torch.zeros(len(samples), samples.max_response)
    plain = trainer(tiny_model, micro_batch_size=4)
    capped = trainer(
        tiny_model, micro_batch_size=4, algorithm=AlgorithmConfig(lam=1.0, num_mini_batches=1, tis_cap=2.0)
    )
    # Rollout log-probs equal to the trainer's: every weight is 1, the update is unchanged.
    on_policy = dataclasses.replace(samples, rollout_log_probs=plain.compute_log_probs(samples))
    m_plain = plain.train_actor(on_policy, values)
    m_capped = capped.train_actor(on_policy, values)
    assert m_capped["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m_capped["pg_loss"] == pytest.approx(m_plain["pg_loss"], rel=1e-5)
    # Rollout log-probs 2 nats below the trainer's: ratio e^2 > cap, every weight is the cap; 0.5 nats
    # above: ratio e^-0.5, under the cap, kept as it is.
    old = on_policy.rollout_log_probs
    for shift, weight, capped_fraction in ((-2.0, 2.0, 1.0), (0.5, math.exp(-0.5), 0.0)):
        fresh = trainer(
            tiny_model,
            micro_batch_size=4,
            algorithm=AlgorithmConfig(lam=1.0, num_mini_batches=1, tis_cap=2.0),
        )
        off = fresh.train_actor(
            dataclasses.replace(samples, rollout_log_probs=(old + shift) * samples.response_mask), values
        )
        assert off["tis_weight_mean"] == pytest.approx(weight, rel=1e-4)
        assert off["tis_capped_fraction"] == capped_fraction


def test_mini_batches_and_epochs_set_the_number_of_steps(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(5, seed=12))
    values = torch.zeros(len(samples), samples.max_response)
    t = trainer(tiny_model, algorithm=AlgorithmConfig(num_mini_batches=2, ppo_epochs=3), micro_batch_size=2)
    assert t.train_actor(samples, values)["optimizer_steps"] == 6.0
    t = trainer(tiny_model, algorithm=AlgorithmConfig(num_mini_batches=6), micro_batch_size=2)
    with pytest.raises(ValueError, match="fewer samples than num_mini_batches=6"):
        t.train_actor(samples, values)


def test_count_parameters_reads_only_the_config(tiny_model: Path, tmp_path: Path) -> None:
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert count_parameters(tiny_model) == sum(p.numel() for p in loaded.parameters())
    (tmp_path / "config.json").write_text((tiny_model / "config.json").read_text())  # no weights
    assert count_parameters(tmp_path) == count_parameters(tiny_model)


def test_fsdp2_with_a_sharded_reference_trains_like_replication(
    tiny_model: Path, fields_factory: Callable, one_rank_group: dist.ProcessGroup
) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=12, samples_per_prompt=4))
    alg = AlgorithmConfig(
        estimator="grpo", use_kl_loss=True, kl_loss_coef=0.1, ppo_epochs=2, num_mini_batches=1
    )
    config = TrainerConfig(role="actor", model_path=str(tiny_model), algorithm=alg, actor_lr=1e-3)
    plain = TorchTrainer(config)
    sharded = TorchTrainer(config, DataParallel(shard_group=lambda: one_rank_group))
    assert (plain.sharded, sharded.sharded) == (False, True)
    assert sharded.architecture == "LlamaForCausalLM"
    for _ in range(2):
        m_plain = plain.train_actor(samples, None)
        m_sharded = sharded.train_actor(samples, None)
        for key in ("pg_loss", "kl_loss", "ref_kl", "grad_norm", "entropy"):
            assert m_sharded[key] == pytest.approx(m_plain[key], rel=1e-5, abs=1e-7), key
    plain_weights = dict(plain.named_weights())
    for name, tensor in sharded.named_weights():
        assert not isinstance(tensor, DTensor)
        torch.testing.assert_close(tensor, plain_weights[name], atol=1e-6, rtol=1e-5)
    # The memory backend gets plain local tensors: model, reference and AdamW state.
    tracked = sharded.weight_tensors() + sharded.optimizer_tensors()
    assert tracked
    assert not any(isinstance(t, DTensor) for t in tracked)
    assert len(sharded.optimizer_tensors()) == len(plain.optimizer_tensors())


def test_fsdp2_critic_trains_saves_and_loads_a_policy_checkpoint(
    tiny_model: Path, fields_factory: Callable, one_rank_group: dist.ProcessGroup, tmp_path: Path
) -> None:
    from ppo_trainer.checkpoint import torch_io

    samples = Samples.from_fields(fields_factory(8, seed=13))
    config = TrainerConfig(role="critic", model_path=str(tiny_model), critic_lr=1e-3)
    shard = DataParallel(shard_group=lambda: one_rank_group)
    plain, sharded = TorchTrainer(config), TorchTrainer(config, shard)
    for _ in range(2):
        m_plain, v_plain, _ = plain.train_critic(samples)
        m_sharded, v_sharded, _ = sharded.train_critic(samples)
        assert m_sharded["value_loss"] == pytest.approx(m_plain["value_loss"], rel=1e-5)
        torch.testing.assert_close(v_sharded, v_plain, atol=1e-6, rtol=1e-5)

    torch_io.save_shard(sharded, tmp_path / "critic", step=2)
    fresh = TorchTrainer(config, shard)
    assert torch_io.load_shard(fresh, tmp_path / "critic") == 2
    for (name, a), (_, b) in zip(fresh.named_weights(), sharded.named_weights(), strict=True):
        assert torch.equal(a, b), name
    restored, saved = fresh.optimizer.state_dict()["state"], sharded.optimizer.state_dict()["state"]
    assert restored.keys() == saved.keys()
    for index, moments in saved.items():
        for key, value in moments.items():
            got = restored[index][key]
            assert isinstance(got, DTensor) == isinstance(value, DTensor), key
            torch.testing.assert_close(sharding.full_tensor(got), sharding.full_tensor(value), atol=0, rtol=0)

    # A policy checkpoint loads into the sharded critic's backbone; the value head stays as it was.
    policy = TorchTrainer(TrainerConfig(role="actor", model_path=str(tiny_model), actor_lr=1e-3))
    policy.train_actor(samples, torch.zeros(len(samples), samples.max_response))
    torch_io.save_shard(policy, tmp_path / "actor", step=1)
    head = dict(fresh.named_weights())["value_head.weight"].clone()
    assert torch_io.load_shard(fresh, tmp_path / "actor") is None
    loaded = dict(fresh.named_weights())
    policy_weights = dict(policy.named_weights())
    torch.testing.assert_close(
        loaded["backbone.embed_tokens.weight"], policy_weights["model.embed_tokens.weight"], atol=0, rtol=0
    )
    assert torch.equal(loaded["value_head.weight"], head)


def test_tied_weights_checkpoints_load_across_kinds(
    tmp_path: Path, fields_factory: Callable, one_rank_group: dist.ProcessGroup
) -> None:
    from conftest import save_tiny_llama

    from ppo_trainer.checkpoint import torch_io

    model = save_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    samples = Samples.from_fields(fields_factory(8, seed=14))
    values = torch.zeros(len(samples), samples.max_response)
    config = TrainerConfig(role="actor", model_path=str(model), actor_lr=1e-3)
    shard = DataParallel(shard_group=lambda: one_rank_group)
    plain, sharded = TorchTrainer(config), TorchTrainer(config, shard)
    plain.train_actor(samples, values)
    sharded.train_actor(samples, values)
    torch_io.save_shard(plain, tmp_path / "plain", step=1)
    torch_io.save_shard(sharded, tmp_path / "sharded", step=1)
    # One tensor for the tied pair, under the same name whichever kind wrote it.
    assert (
        load_file(str(tmp_path / "plain" / "model.safetensors")).keys()
        == load_file(str(tmp_path / "sharded" / "model.safetensors")).keys()
    )

    into_plain, into_sharded = TorchTrainer(config), TorchTrainer(config, shard)
    torch_io.load_shard(into_plain, tmp_path / "sharded")
    torch_io.load_shard(into_sharded, tmp_path / "plain")
    for a, b, c in zip(
        sharded.named_weights(), into_plain.named_weights(), into_sharded.named_weights(), strict=True
    ):
        torch.testing.assert_close(b[1], a[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c[1], dict(plain.named_weights())[c[0]], atol=0, rtol=0)
    head = dict(into_sharded.named_weights())
    assert torch.equal(head["lm_head.weight"], head["model.embed_tokens.weight"])  # still tied
    # The tie's source name is the one kept, so a critic finds its backbone's embedding.
    assert "model.embed_tokens.weight" in load_file(str(tmp_path / "sharded" / "model.safetensors"))
    critic_config = TrainerConfig(role="critic", model_path=str(model), critic_lr=1e-3)
    for critic, folder in (
        (TorchTrainer(critic_config), "sharded"),
        (TorchTrainer(critic_config, shard), "plain"),
    ):
        assert torch_io.load_shard(critic, tmp_path / folder) is None  # a policy checkpoint: step unknown
        embedding = dict(critic.named_weights())["backbone.embed_tokens.weight"]
        torch.testing.assert_close(embedding, head["model.embed_tokens.weight"], atol=0, rtol=0)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_optimizer_state_made_at_setup_trains_bit_identically_to_lazy(
    tiny_model: Path, fields_factory: Callable, role: str
) -> None:
    samples = Samples.from_fields(fields_factory(6, seed=7))
    values = torch.randn(len(samples), samples.max_response) * samples.response_mask
    runs = []
    for eager in (True, False):
        t = trainer(tiny_model, role, algorithm=AlgorithmConfig(lam=1.0, num_mini_batches=2))
        state = t.optimizer.state
        assert len(state) == len(t.params)  # made by the constructor
        assert all(float(s["step"]) == 0.0 and not s["exp_avg"].any() for s in state.values())
        if not eager:
            state.clear()  # AdamW's own lazy creation in the first step, as before
        for _ in range(3):
            t.train_critic(samples) if role == "critic" else t.train_actor(samples, values)
        runs.append(
            (
                [p.detach().clone() for p in t.params],
                [(k, v.clone()) for s in t.optimizer.state.values() for k, v in s.items()],
            )
        )
    (params_a, state_a), (params_b, state_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert [k for k, _ in state_a] == [k for k, _ in state_b]
    for (_, a), (_, b) in zip(state_a, state_b, strict=True):
        assert a.dtype == b.dtype
        assert a.device == b.device
        assert torch.equal(a, b)
    assert float(state_a[0][1]) == 6.0  # 3 steps x 2 mini-batches


def test_the_step_sets_the_scheduled_rate(tiny_model: Path, fields_factory: Callable) -> None:
    samples = Samples.from_fields(fields_factory(8, seed=6))
    t = trainer(tiny_model, role="critic", lr=1e-3, total_steps=3, min_lr_ratio=0.0)
    assert t.set_step(1) == pytest.approx(1e-3)
    assert t.set_step(2) == pytest.approx(0.5e-3)
    assert [g["lr"] for g in t.optimizer.param_groups] == [pytest.approx(0.5e-3)]
    # At the last step the cosine reaches its floor, 0 here: the step leaves the weights as they were.
    assert t.set_step(3) == 0.0
    before = [p.detach().clone() for p in t.params]
    t.train_critic(samples)
    assert all(torch.equal(a, b) for a, b in zip(before, t.params, strict=True))
