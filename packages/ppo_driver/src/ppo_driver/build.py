"""The validated run config, translated into the other packages' frozen configs.

Each function builds a new object; nothing here (or anywhere) edits the user's ``RunConfig``. The
critic's trainer config is a copy of the actor's algorithm with ``kl_coef=0``: reward-level KL is the
actor's business, and the critic never sees the actor's log-probs.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Literal

from ppo_driver.config import RunConfig
from ppo_lifecycle import OffloadPlan, ResidentSharedCriticWarning
from ppo_placement import PlacementSpec
from ppo_rollout import RolloutConfig
from ppo_rollout import SamplingConfig as RolloutSampling
from ppo_trainer import AlgorithmConfig, TrainerConfig


def placement_spec(config: RunConfig) -> PlacementSpec:
    p = config.placement
    return PlacementSpec(
        actor_gpus=p.actor_gpus,
        rollout_gpus=p.resolved_rollout_gpus,
        gpus_per_engine=p.gpus_per_engine,
        colocate=p.colocate,
        critic=p.critic,
        critic_gpus=p.critic_gpus,
        use_gpus=p.device == "cuda",
        cpus_per_bundle=p.cpus_per_bundle,
    )


def algorithm_config(config: RunConfig) -> AlgorithmConfig:
    a = config.algorithm
    return AlgorithmConfig(
        estimator=a.estimator,
        gamma=a.gamma,
        lam=a.lam,
        eps_clip=a.eps_clip,
        eps_clip_high=a.eps_clip_high,
        eps_clip_c=a.eps_clip_c,
        value_clip=a.value_clip,
        kl_coef=a.kl_coef,
        use_kl_loss=a.use_kl_loss,
        kl_loss_coef=a.kl_loss_coef,
        kl_estimator=a.kl_estimator,
        entropy_coef=a.entropy_coef,
        normalize_advantages=a.normalize_advantages,
        loss_aggregation=a.loss_aggregation,
        ppo_epochs=a.ppo_epochs,
        num_mini_batches=a.num_mini_batches,
    )


def actor_trainer_config(config: RunConfig, model_path: Path | str) -> TrainerConfig:
    t, p = config.train, config.placement
    return TrainerConfig(
        role="actor",
        model_path=str(model_path),
        algorithm=algorithm_config(config),
        dtype=config.model.dtype,
        lr=t.actor_lr,
        weight_decay=t.weight_decay,
        micro_batch_size=t.micro_batch_size,
        grad_clip=t.grad_clip,
        seed=t.seed,
        data_parallel=t.data_parallel,
        device=p.device,
        memory_backend=config.offload.backend,
        weight_sync_backend=weight_sync_backend(config),
        # The engines hold the weights in the rollout dtype and reject any other.
        weight_sync_dtype=_rollout_dtype(config),
    )


def weight_sync_backend(config: RunConfig) -> Literal["nccl", "gloo"]:
    """NCCL between the actor's GPU and engines on other GPUs; gloo on CPU and when colocated.

    Colocated, engine 0 shares the actor rank 0's GPU, and NCCL refuses two ranks of one communicator
    on one device ("Duplicate GPU detected"). Gloo broadcasts CUDA tensors through host memory: slower,
    but a colocated update moves weights between processes on the same GPUs, which NCCL cannot.
    """
    if config.placement.device != "cuda" or config.placement.colocate:
        return "gloo"
    return "nccl"


def critic_trainer_config(actor: TrainerConfig, config: RunConfig) -> TrainerConfig:
    """A copy of the actor's config for the critic: its own lr, and ``kl_coef=0``."""
    return dataclasses.replace(
        actor,
        role="critic",
        lr=config.train.critic_lr,
        algorithm=dataclasses.replace(actor.algorithm, kl_coef=0.0),
    )


def rollout_config(config: RunConfig, model_path: Path | str) -> RolloutConfig:
    r, p = config.rollout, config.placement
    s = r.sampling
    return RolloutConfig(
        engine=r.engine,
        num_engines=p.num_engines,
        gpus_per_engine=p.gpus_per_engine if p.device == "cuda" else 0,
        model_path=str(model_path),
        task=r.task,
        dataset=r.dataset,
        prompt_field=r.prompt_field,
        reward=r.reward,
        prompts_per_step=r.prompts_per_step,
        sampling=RolloutSampling(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            n_samples_per_prompt=s.n_samples_per_prompt,
            stop_token_ids=tuple(s.stop_token_ids),
            seed=config.train.seed,
        ),
        eval_prompts=r.eval_prompts,
        max_prompt_length=r.max_prompt_length,
        device=p.device,
        dtype=_rollout_dtype(config),
        seed=config.train.seed,
        timeout_s=config.ray.timeout_s,
    )


def offload_plan(config: RunConfig) -> OffloadPlan:
    with warnings.catch_warnings():
        # The config already warned about a resident shared critic when it was loaded.
        warnings.simplefilter("ignore", ResidentSharedCriticWarning)
        return OffloadPlan.build(
            colocate=config.placement.colocate,
            critic=config.placement.critic,
            offload=config.offload.enabled,
            allow_resident_shared_critic=config.offload.allow_resident_shared_critic,
        )


def _rollout_dtype(config: RunConfig) -> Literal["float32", "bfloat16"]:
    if config.model.dtype == "auto":
        return "bfloat16" if config.placement.device == "cuda" else "float32"
    return config.model.dtype
