"""Frozen, validated configuration of the PPO algorithm and of one training role.

Both dataclasses validate themselves once, in ``__post_init__``, and raise ``ValueError`` naming the
field and the fix. Nothing mutates them afterwards: derive a variant with ``dataclasses.replace``
(the driver makes the critic's config that way, with ``kl_coef=0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Estimator = Literal["ppo", "grpo"]
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean"]
Role = Literal["actor", "critic"]
Device = Literal["cpu", "cuda"]
DType = Literal["auto", "float32", "bfloat16"]
MemoryBackendName = Literal["auto", "host", "pinned", "torch_memory_saver"]
DataParallelKind = Literal["auto", "replicate", "fsdp2"]

_ESTIMATORS = ("ppo", "grpo")
_KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
_ROLES = ("actor", "critic")
_DEVICES = ("cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16")
_MEMORY_BACKENDS = ("auto", "host", "pinned", "torch_memory_saver")
_WEIGHT_SYNC_BACKENDS = ("gloo", "nccl")
_DATA_PARALLEL = ("auto", "replicate", "fsdp2")
# ``data_parallel="auto"`` shards when the replicated training state takes more than this share of a
# GPU: the other role and the engines share the device, and a model this large leaves them little.
AUTO_SHARD_FRACTION = 0.25


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, allowed))}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:  # also rejects NaN
        raise ValueError(f"{name}={value!r} must be >= 0")


@dataclass(frozen=True)
class AlgorithmConfig:
    """The PPO knobs, shared by actor and critic.

    - ``estimator``: ``"ppo"`` (GAE with the critic's values) or ``"grpo"`` (group-normalised
      outcome reward, no critic).
    - ``gamma``, ``lam``: GAE discount and trace decay.
    - ``eps_clip``, ``eps_clip_high``: the ratio is clipped to ``[1 - eps_clip, 1 + eps_clip_high]``
      (``eps_clip_high=None`` means ``eps_clip``).
    - ``eps_clip_c``: dual-clip constant (> 1) bounding the loss of negative-advantage tokens; None: off.
    - ``value_clip``: the critic's new value is kept within ``value_clip`` of its old value in the loss.
    - ``kl_coef``: per-token reward penalty ``-kl_coef * KL(policy || reference)`` (actor only).
    - ``use_kl_loss``, ``kl_loss_coef``: the KL to the reference as a loss term instead.
    - ``kl_estimator``: ``k1``, ``k2``, ``k3`` or ``low_var_kl`` (k3 clamped to [-10, 10]).
    - ``entropy_coef``: entropy bonus weight (the loss subtracts ``entropy_coef * entropy``).
    - ``normalize_advantages``: whiten advantages over the loss-masked tokens of all DP ranks.
    - ``loss_aggregation``: ``token_mean`` (sum over all loss tokens of the global batch divided by their
      count) or ``seq_mean_token_mean`` (mean over each sample's tokens, then mean over samples).
    - ``ppo_epochs``, ``num_mini_batches``: passes over the batch and optimizer steps per pass.
    """

    estimator: Estimator = "ppo"
    gamma: float = 1.0
    lam: float = 0.95
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    value_clip: float = 0.2
    kl_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    entropy_coef: float = 0.0
    normalize_advantages: bool = True
    loss_aggregation: LossAggregation = "token_mean"
    ppo_epochs: int = 1
    num_mini_batches: int = 1

    def __post_init__(self) -> None:
        _one_of("estimator", self.estimator, _ESTIMATORS)
        _one_of("kl_estimator", self.kl_estimator, _KL_ESTIMATORS)
        _one_of("loss_aggregation", self.loss_aggregation, _AGGREGATIONS)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma={self.gamma!r} must be in [0, 1]")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam={self.lam!r} must be in [0, 1]")
        if not 0.0 < self.eps_clip < 1.0:
            raise ValueError(f"eps_clip={self.eps_clip!r} must be in (0, 1)")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0.0:
            raise ValueError(f"eps_clip_high={self.eps_clip_high!r} must be > 0 (or None to reuse eps_clip)")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1.0:
            raise ValueError(
                f"eps_clip_c={self.eps_clip_c!r} must be > 1 (dual-clip lower bound); set None to turn it off"
            )
        if not self.value_clip > 0.0:
            raise ValueError(f"value_clip={self.value_clip!r} must be > 0")
        _non_negative("kl_coef", self.kl_coef)
        _non_negative("kl_loss_coef", self.kl_loss_coef)
        _non_negative("entropy_coef", self.entropy_coef)
        if self.use_kl_loss and self.kl_loss_coef == 0.0:
            raise ValueError("use_kl_loss=True needs kl_loss_coef > 0 (or set use_kl_loss=False)")
        if self.estimator == "grpo" and self.kl_coef > 0.0:
            raise ValueError(
                "kl_coef > 0 (a KL reward penalty) needs estimator='ppo'; with 'grpo' use use_kl_loss=True "
                "and kl_loss_coef instead"
            )
        if self.ppo_epochs < 1:
            raise ValueError(f"ppo_epochs={self.ppo_epochs!r} must be >= 1")
        if self.num_mini_batches < 1:
            raise ValueError(f"num_mini_batches={self.num_mini_batches!r} must be >= 1")

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_reference(self) -> bool:
        """Whether the actor needs a frozen reference model (a KL term is on)."""
        return self.kl_coef > 0.0 or self.use_kl_loss


@dataclass(frozen=True)
class TrainerConfig:
    """One role's training setup.

    - ``role``: ``"actor"`` or ``"critic"``.
    - ``model_path``: a local Hugging Face folder (``config.json`` plus weights; a folder with only a
      config initialises randomly from ``seed``). The critic loads the same causal-LM checkpoint into its
      backbone and adds a fresh scalar value head.
    - ``dtype``: compute dtype under autocast; ``auto`` is bfloat16 on CUDA and float32 on CPU.
      Parameters and optimizer state stay float32.
    - ``lr``, ``weight_decay``, ``betas``: AdamW.
    - ``micro_batch_size``: samples per forward/backward; gradients accumulate over micro-batches.
    - ``grad_clip``: max global gradient norm (0 turns clipping off).
    - ``memory_backend``: how ``sleep()`` frees memory (lifecycle backends); ``auto`` picks the default
      for the device.
    - ``weight_sync_backend``, ``bucket_bytes``, ``weight_sync_group``: the actor's weight update group;
      ``weight_sync_dtype``: the dtype weights are sent (and checksummed) in; match the engines' dtype.
    - ``cpu_threads``: torch intra-op threads of each worker process.
    - ``data_parallel``: ``replicate`` (every rank holds the whole model and its AdamW state; one
      gradient all-reduce per optimizer step), ``fsdp2`` (each rank holds ``1 / world_size`` of them,
      gathered layer by layer; ``torch.distributed.fsdp.fully_shard``), or ``auto``: ``fsdp2`` where it
      helps, on CUDA with more than one rank when the replicated training state would take more than
      ``AUTO_SHARD_FRACTION`` of a GPU, else ``replicate`` (faster while memory allows: on 2 H200s a
      551M-parameter step took 0.61 s replicated and 0.83 s sharded).
    """

    role: Role
    model_path: str
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    dtype: DType = "auto"
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    micro_batch_size: int = 4
    grad_clip: float = 1.0
    seed: int = 1234
    device: Device = "cpu"
    memory_backend: MemoryBackendName = "auto"
    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"
    bucket_bytes: int = 512 << 20
    weight_sync_group: str = "ppo_weights"
    weight_sync_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    cpu_threads: int = 1
    data_parallel: DataParallelKind = "auto"

    def __post_init__(self) -> None:
        _one_of("role", self.role, _ROLES)
        _one_of("dtype", self.dtype, _DTYPES)
        _one_of("device", self.device, _DEVICES)
        _one_of("memory_backend", self.memory_backend, _MEMORY_BACKENDS)
        _one_of("weight_sync_backend", self.weight_sync_backend, _WEIGHT_SYNC_BACKENDS)
        _one_of("weight_sync_dtype", self.weight_sync_dtype, ("float32", "bfloat16", "float16"))
        _one_of("data_parallel", self.data_parallel, _DATA_PARALLEL)
        if not self.weight_sync_group:
            raise ValueError("weight_sync_group is empty; give the weight update group a name")
        if not isinstance(self.algorithm, AlgorithmConfig):
            raise ValueError(f"algorithm must be an AlgorithmConfig, got {type(self.algorithm).__name__}")
        if not self.model_path:
            raise ValueError("model_path is empty; give a local Hugging Face model folder")
        if not self.lr > 0.0:
            raise ValueError(f"lr={self.lr!r} must be > 0")
        _non_negative("weight_decay", self.weight_decay)
        _non_negative("grad_clip", self.grad_clip)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas!r} must be two numbers in [0, 1)")
        if self.cpu_threads < 1:
            raise ValueError(f"cpu_threads={self.cpu_threads!r} must be >= 1 (torch threads per worker)")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size!r} must be >= 1")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={self.bucket_bytes!r} must be >= 1")
        if self.device == "cpu" and self.memory_backend in ("pinned", "torch_memory_saver"):
            raise ValueError(
                f"memory_backend={self.memory_backend!r} needs device='cuda'; use 'host' or 'auto' on CPU"
            )
        if self.device == "cpu" and self.weight_sync_backend == "nccl":
            raise ValueError("weight_sync_backend='nccl' needs device='cuda'; use 'gloo' on CPU")
        if self.role == "critic" and self.algorithm.estimator == "grpo":
            raise ValueError("a critic is not used with estimator='grpo'; drop the critic or use 'ppo'")
        if self.role == "critic" and self.algorithm.kl_coef > 0.0:
            raise ValueError(
                "the critic has no reference model, so its returns cannot carry the KL penalty; give the "
                "critic a copy of the config with algorithm.kl_coef=0"
            )

    def shards(self, world_size: int, state_share: float = 0.0) -> bool:
        """Whether a role of ``world_size`` ranks shards its models with FSDP2.

        ``state_share``: the replicated training state (float32 weights, gradients and two AdamW
        moments: 16 bytes a parameter) over one GPU's memory; only ``auto`` reads it.
        """
        if self.data_parallel == "auto":
            return self.device == "cuda" and world_size > 1 and state_share > AUTO_SHARD_FRACTION
        return self.data_parallel == "fsdp2"

    @property
    def compute_dtype(self) -> str:
        if self.dtype == "auto":
            return "bfloat16" if self.device == "cuda" else "float32"
        return self.dtype
