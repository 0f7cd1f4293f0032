"""The run config, handed to the other packages: their own settings plus what the placement decides.

The packages declare their settings (``AlgorithmConfig``, ``TrainSettings``, ``RolloutSettings``) and
the run config holds them as they are; here only the values derived from several sections are added
(role, model folder, device, engines, weight update backend and dtype). Each function builds a new
object; nothing edits the user's ``RunConfig``. The critic's trainer config is a copy of the actor's
with its role; with reward-level KL (``kl_coef > 0``) the critic holds the reference model and
computes the KL-shaped rewards both roles train on.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ppo_driver.config import RunConfig
from ppo_lifecycle.plan import OffloadPlan
from ppo_placement import PlacementSpec, plan_layout
from ppo_rollout.config import AdapterUpdates, RolloutConfig, RolloutSettings
from ppo_trainer.config import AlgorithmConfig, TrainerConfig, TrainSettings

if TYPE_CHECKING:  # ppo_weight_sync imports torch: `ppo-driver validate` must not (preflight.py)
    from ppo_weight_sync import SenderPlan


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
        node_resources=tuple(sorted(p.node_resources.items())),
    )


def lora_update(config: RunConfig) -> Literal["merged", "adapters"] | None:
    """What the actor's weight update sends under ``train.lora`` (None: no LoRA actor):
    ``train.lora.update``, unset meaning the adapters alone to the built-in engine (which merges them onto
    the base it keeps) and merged weights to SGLang (``adapters`` there launches the servers with LoRA on
    and loads each update as an SGLang LoRA adapter: ``ppo_weight_sync.sglang_lora``)."""
    lora = config.train.lora
    if lora is None or "actor" not in lora.roles:
        return None
    if lora.update is not None:
        return lora.update
    return "adapters" if config.rollout.engine == "builtin" else "merged"


def engine_lora(config: RunConfig) -> AdapterUpdates | None:
    """The adapters the engines take in an update (None: they are sent merged weights)."""
    lora = config.train.lora
    if lora is None or lora_update(config) != "adapters":
        return None
    return AdapterUpdates(rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules)


def shares_base(config: RunConfig) -> bool:
    """Whether the critic maps the actor's frozen base (``train.lora.share_base``): both roles train
    with LoRA on the same devices (``placement.critic='shared'``, rank r of each on bundle r), and the
    critic starts from the model (not ``train.critic_init_from``)."""
    lora = config.train.lora
    if lora is None or lora.share_base is False or config.train.critic_init_from is not None:
        return False  # train.critic_init_from: the critic's backbone is its own (share_base=true refused)
    # share_base=true where this is false is refused by RunConfig's checks and LoraSettings'.
    return config.placement.critic == "shared" and {"actor", "critic"} <= set(lora.roles)


def actor_trainer_config(config: RunConfig, model_path: Path | str) -> TrainerConfig:
    settings = _settings(config.train, TrainSettings)
    if settings["lora"] is not None:
        settings["lora"] = dataclasses.replace(settings["lora"], update=lora_update(config))
    return TrainerConfig(
        **settings,
        role="actor",
        model_path=str(model_path),
        algorithm=trainer_algorithm(config),
        dtype=config.model.dtype,
        seed=config.train.seed,
        device=config.placement.device,
        total_steps=config.train.steps,
        memory_backend=config.offload.backend,
        weight_sync_backend=weight_sync_backend(config),
        weight_sync_colocated=weight_sync_colocated(config),
        weight_sync_colocated_tp=weight_sync_plan(config).tp_wire,
        # The engines hold the weights in the rollout dtype and reject any other.
        weight_sync_dtype=_rollout_dtype(config),
        critic_health=config.logging.critic_health,
    )


def trainer_algorithm(config: RunConfig) -> AlgorithmConfig:
    """The ``algorithm`` section with what it leaves to the run filled in: Dr. GRPO's constant
    (``loss_scale_factor``) defaults to the longest response the rollout may give."""
    a = config.algorithm
    if a.loss_aggregation == "seq_mean_token_sum_norm" and a.loss_scale_factor is None:
        return dataclasses.replace(a, loss_scale_factor=config.rollout.train_response_limit)
    return a


def critic_trainer_config(actor: TrainerConfig, config: RunConfig) -> TrainerConfig:
    """A copy of the actor's config for the critic (whose ``lr`` is ``critic_lr``), with the same
    ``kl_coef``: the critic shapes the rewards both roles train on."""
    return dataclasses.replace(actor, role="critic")


def rollout_config(config: RunConfig, model_path: Path | str) -> RolloutConfig:
    p = config.placement
    settings = _settings(config.rollout, RolloutSettings)
    if config.train.num_critic_only_steps and settings["sglang"].weights_cpu_backup is None:
        # critic-only steps release the servers and send no weights after: keep a host copy
        settings["sglang"] = dataclasses.replace(settings["sglang"], weights_cpu_backup=True)
    return RolloutConfig(
        **settings,
        model_path=str(model_path),
        num_engines=p.num_engines,
        gpus_per_engine=p.gpus_per_engine if p.device == "cuda" else 0,
        device=p.device,
        dtype=_rollout_dtype(config),
        seed=config.train.seed,
        timeout_s=config.ray.timeout_s,
        lora=engine_lora(config),
    )


def offload_plan(config: RunConfig) -> OffloadPlan:
    return config.offload_plan


def weight_sync_backend(config: RunConfig) -> Literal["nccl", "gloo"]:
    """NCCL between the actor's GPU and engines on other GPUs; gloo on CPU.

    Engines on an actor rank's own GPU get CUDA IPC from that rank (:func:`weight_sync_plan`), not the
    group: NCCL refuses two ranks of one communicator on one device ("Duplicate GPU detected"). A
    colocated engine of several GPUs gets CUDA IPC too, from the ranks on its GPUs; gloo (through host
    memory) stays for the colocated ones the plan leaves on the group (partly on GPUs no actor rank
    trains on, see ``ppo_weight_sync.plan_senders``).
    """
    p = config.placement
    if p.device != "cuda" or (p.colocate and p.gpus_per_engine > 1):
        return "gloo"
    return "nccl"


def weight_sync_plan(config: RunConfig) -> SenderPlan:
    """Which actor rank sends to which engine (:func:`ppo_weight_sync.plan_senders`), from the placement.

    Actor rank ``r`` sits on bundle ``actor.offset + r``; engine ``i`` on bundles
    ``[rollout.offset + i*g, rollout.offset + (i+1)*g)``. A bundle is one GPU, shared by every role placed
    on it, so equal bundles mean the same GPU. An engine of one GPU on actor rank r's bundle gets CUDA IPC
    from rank r (colocated: engine r on rank r's GPU); an engine of several GPUs, all actor ranks' bundles,
    gets it from those ranks (the one on its first bundle posts, the others feed their TP ranks); every
    other engine gets the group from rank 0.
    """
    from ppo_weight_sync import SenderPlan, plan_senders

    p = config.placement
    layout = plan_layout(placement_spec(config))
    actor, rollout = layout.roles.get("actor"), layout.roles.get("rollout")
    ranks = list(actor.positions) if actor is not None else [0]
    if rollout is None:
        return SenderPlan.from_ipc((), layout.engine_count, len(ranks))
    g = max(p.gpus_per_engine, 1) if p.device == "cuda" else 1
    engines = [[rollout.offset + i * g + j for j in range(g)] for i in range(layout.engine_count)]
    return plan_senders(ranks, engines, ipc=p.device == "cuda")


def weight_sync_colocated(config: RunConfig) -> tuple[tuple[int, ...], ...]:
    """Per actor rank, the engines (by index) on its own GPU: that rank sends to them over CUDA IPC
    (:func:`weight_sync_plan`); rank 0 sends to the rest over the group."""
    return weight_sync_plan(config).ipc_by_rank


def _rollout_dtype(config: RunConfig) -> Literal["float32", "bfloat16"]:
    if config.model.dtype == "auto":
        return "bfloat16" if config.placement.device == "cuda" else "float32"
    return config.model.dtype


def _settings(section: Any, settings: type[Any]) -> dict[str, Any]:
    """The fields of the package class ``settings`` that ``section`` (the driver's extension) holds."""
    return {name: getattr(section, name) for name in settings.__dataclass_fields__}
