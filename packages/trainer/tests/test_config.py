"""Config validation: bad input is a ValueError naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_trainer.config import AlgorithmConfig, TrainerConfig


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"estimator": "a2c"}, "estimator"),
        ({"gamma": 1.5}, "gamma"),
        ({"lam": -0.1}, "lam"),
        ({"eps_clip": 0.0}, "eps_clip"),
        ({"eps_clip_high": -1.0}, "eps_clip_high"),
        ({"eps_clip_c": 1.0}, "eps_clip_c"),
        ({"value_clip": 0.0}, "value_clip"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"use_kl_loss": True}, "kl_loss_coef"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"loss_aggregation": "sum"}, "loss_aggregation"),
        ({"estimator": "grpo", "kl_coef": 0.1}, "kl_coef"),
        ({"estimator": "grpo", "normalize_advantages": True}, "normalize_advantages=true with .*'grpo'"),
        ({"norm_adv_by_std_in_grpo": False}, "norm_adv_by_std_in_grpo=false has no effect"),
        ({"loss_scale_factor": 4}, "loss_scale_factor=4 only applies"),
        ({"loss_aggregation": "seq_mean_token_sum_norm", "loss_scale_factor": 0}, "loss_scale_factor"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"num_mini_batches": 0}, "num_mini_batches"),
    ],
)
def test_algorithm_config_rejects(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AlgorithmConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "reward"}, "role"),
        ({"model_path": ""}, "model_path"),
        ({"actor_lr": 0.0}, "actor_lr"),
        ({"critic_lr": -1.0}, "critic_lr"),
        ({"lr": 1e-3}, "Unexpected keyword argument"),  # lr is actor_lr or critic_lr, by role
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"device": "tpu"}, "device"),
        ({"memory_backend": "pinned"}, "memory_backend"),
        ({"weight_sync_backend": "nccl"}, "weight_sync_backend"),
        ({"weight_sync_dtype": "int8"}, "weight_sync_dtype"),
        ({"weight_sync_colocated": ((0,),)}, "weight_sync_colocated needs device='cuda'"),
        (
            {"device": "cuda", "weight_sync_colocated": ((0,), (0,))},
            r"weight_sync_colocated=\(\(0,\), \(0,\)\) names an engine twice",
        ),
        ({"device": "cuda", "weight_sync_colocated": ((-1,),)}, "weight_sync_colocated"),
        ({"device": "cuda", "weight_sync_colocated": (0,)}, "weight_sync_colocated"),
        ({"weight_sync_colocated_tp": ((0, 0, 1),)}, "weight_sync_colocated_tp needs device='cuda'"),
        (
            {"device": "cuda", "weight_sync_colocated_tp": ((0, 1, 1),)},
            r"weight_sync_colocated_tp entry \(0, 1, 1\): .* at least two distinct ranks",
        ),
        ({"device": "cuda", "weight_sync_colocated_tp": ((0, 1),)}, "at least two distinct ranks"),
        ({"data_parallel": "ddp"}, "data_parallel"),
        ({"role": "critic", "algorithm": AlgorithmConfig(estimator="grpo")}, "grpo"),
        (
            {"algorithm": AlgorithmConfig(loss_aggregation="seq_mean_token_sum_norm")},
            "seq_mean_token_sum_norm' needs algorithm.loss_scale_factor",
        ),
    ],
)
def test_trainer_config_rejects(kwargs: dict, field: str) -> None:
    base = {"role": "actor", "model_path": "/m"} | kwargs
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**base)


@pytest.mark.parametrize(
    ("estimator", "normalize", "whiten"),
    [
        ("ppo", None, True),
        ("ppo", False, False),
        ("ppo", True, True),
        ("grpo", None, False),
        ("grpo", False, False),
    ],
)
def test_normalize_advantages_null_whitens_gae_only(
    estimator: str, normalize: bool | None, whiten: bool
) -> None:
    alg = AlgorithmConfig(estimator=estimator, normalize_advantages=normalize)  # type: ignore[arg-type]
    assert alg.whiten_advantages is whiten
    assert alg.normalize_advantages is whiten  # resolved at construction: a dump says what runs
    assert AlgorithmConfig(estimator=estimator, normalize_advantages=whiten) == alg  # type: ignore[arg-type]


def test_new_modes_are_accepted() -> None:
    alg = AlgorithmConfig(
        estimator="grpo",
        norm_adv_by_std_in_grpo=False,
        loss_aggregation="seq_mean_token_sum_norm",
        loss_scale_factor=512,
        use_kl_loss=True,
        kl_loss_coef=0.01,
        kl_estimator="abs",
    )
    config = TrainerConfig(role="actor", model_path="/m", algorithm=alg)
    assert config.algorithm.loss_scale_factor == 512


def test_configs_are_frozen_and_derived_by_replace() -> None:
    actor = TrainerConfig(role="actor", model_path="/m", algorithm=AlgorithmConfig(kl_coef=0.05))
    with pytest.raises(dataclasses.FrozenInstanceError):
        actor.lr = 1.0  # type: ignore[misc]
    critic = dataclasses.replace(
        actor, role="critic", algorithm=dataclasses.replace(actor.algorithm, kl_coef=0.0)
    )
    assert actor.algorithm.kl_coef == 0.05
    assert critic.algorithm.kl_coef == 0.0
    assert actor.compute_dtype == "float32"
    assert (actor.lr, critic.lr) == (actor.actor_lr, actor.critic_lr)
    two = TrainerConfig(role="critic", model_path="/m", actor_lr=1e-3, critic_lr=2e-3)
    assert two.lr == 2e-3
    assert dataclasses.replace(two, role="actor").lr == 1e-3
    assert TrainerConfig(role="actor", model_path="/m", device="cuda").compute_dtype == "bfloat16"
    assert AlgorithmConfig(eps_clip=0.2).clip_high == 0.2


def test_reward_kl_puts_the_reference_on_the_critic() -> None:
    reward_kl = AlgorithmConfig(kl_coef=0.1)
    assert (reward_kl.reference_for("critic"), reward_kl.reference_for("actor")) == (True, False)
    kl_loss = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)
    assert (kl_loss.reference_for("critic"), kl_loss.reference_for("actor")) == (False, True)
    # the critic accepts reward-level KL (it computes the KL-shaped rewards)
    assert TrainerConfig(role="critic", model_path="/m", algorithm=reward_kl).algorithm.kl_coef == 0.1
    with pytest.raises(ValueError, match=r"tis_cap\n  Input should be greater than or equal to 1"):
        AlgorithmConfig(tis_cap=0.5)
    assert AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1).needs_reference


@pytest.mark.parametrize(
    ("kwargs", "world_size", "state_share", "shards"),
    [
        ({"device": "cuda"}, 2, 0.26, True),  # auto: more than a quarter of a GPU replicated
        ({"device": "cuda"}, 2, 0.25, False),
        ({"device": "cuda"}, 1, 0.9, False),  # one rank has nothing to shard over
        ({"device": "cpu"}, 2, 0.9, False),  # auto never shards on CPU
        ({"data_parallel": "fsdp2"}, 2, 0.0, True),  # explicit choices ignore the share
        ({"data_parallel": "fsdp2"}, 1, 0.0, True),
        ({"device": "cuda", "data_parallel": "replicate"}, 2, 0.9, False),
    ],
)
def test_data_parallel_choice(kwargs: dict, world_size: int, state_share: float, shards: bool) -> None:
    config = TrainerConfig(role="actor", model_path="/m", **kwargs)
    assert config.shards(world_size, state_share) is shards


def test_the_ranks_weight_sync_metrics_merge_bytes_add_times_take_the_slowest() -> None:
    from ppo_trainer.group import merge_sync_metrics

    rank0 = {
        "weight_sync/bytes": 4e9,
        "weight_sync/seconds": 0.010,
        "weight_sync/gb_per_s": 400.0,
        "weight_sync/ipc_buckets": 9.0,
        "weight_sync/updates": 1.0,
        "reconnected": 0.0,
    }
    rank1 = {**rank0, "weight_sync/seconds": 0.020, "reconnected": 1.0}
    merged = merge_sync_metrics([rank0, rank1, {}])  # a rank that sends nothing returns {}
    assert merged == {
        "weight_sync/bytes": 8e9,
        "weight_sync/seconds": 0.020,
        "weight_sync/gb_per_s": 400.0,  # 8 GB moved in the slowest rank's 20 ms
        "weight_sync/ipc_buckets": 18.0,
        "weight_sync/updates": 1.0,
        "reconnected": 1.0,
    }
    assert merge_sync_metrics([{}, {}]) == {}


def test_backend_settings() -> None:
    from ppo_trainer.config import TrainSettings

    assert TrainSettings().backend == "torch"
    assert TrainSettings().tensor_parallel == 1
    with pytest.raises(ValueError, match=r"tensor_parallel=4 needs train.backend='megatron'"):
        TrainSettings(tensor_parallel=4)
    with pytest.raises(ValueError, match="tensor_parallel"):
        TrainSettings(backend="megatron", tensor_parallel=0)
    with pytest.raises(ValueError, match="backend"):
        TrainSettings(backend="jax")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"backend='megatron' needs device='cuda'; use backend='torch' on CPU"
    ):
        TrainerConfig(role="actor", model_path="m", backend="megatron")
    settings = TrainSettings(backend="megatron", tensor_parallel=2)
    problems = settings.backend_problems("cuda", {"placement.actor_gpus": 4, "placement.critic_gpus": 3})
    assert (
        "train.tensor_parallel=2 must divide placement.critic_gpus=3 (each model is split over"
        in problems[-1]
    )
    assert not [p for p in problems if "actor_gpus" in p]
    heads = settings.megatron_heads_problems(
        {
            "model_type": "qwen2",
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
        }
    )
    assert heads == []
    heads = settings.megatron_heads_problems({"model_type": "gpt2", "num_attention_heads": 12})
    assert heads[0].startswith(
        "train.backend='megatron': the megatron backend converts Llama and Qwen2 models; this config has "
        "model_type='gpt2'"
    )
    heads = settings.megatron_heads_problems({"model_type": "gemma3_text", "num_attention_heads": 4})
    assert heads == [
        "train.backend='megatron': model_type 'gemma3_text' (Gemma 3) is not supported by the megatron "
        "backend: use train.backend: torch"
    ]
    assert TrainSettings().backend_problems("cpu", {"placement.actor_gpus": 3}) == []


def test_settings_import_without_torch() -> None:
    """``ppo-driver validate`` reads the settings without paying for torch, transformers and Ray."""
    import subprocess
    import sys

    code = (
        "import sys, ppo_trainer, ppo_trainer.config, ppo_trainer.lr_schedule; "
        "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]; "
        "assert not heavy, f'imported {heavy}'; "
        "assert ppo_trainer.TrainerConfig is ppo_trainer.config.TrainerConfig"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
