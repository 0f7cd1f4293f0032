"""What the worker needs of a training backend, and how it picks one (``train.backend``).

``TorchTrainer`` (``backend.py``, transformers models, replicated or FSDP2) and ``MegatronTrainer``
(``megatron_backend.py``, megatron-core GPTModel with tensor and data parallelism) both satisfy
``TrainerBackend``; ``make_trainer`` builds the one the config names. Everything the worker, the
checkpoint code and the weight update see is in Hugging Face names and whole tensors, whatever the
backend holds inside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ppo_trainer.batch import Samples
from ppo_trainer.config import TrainerConfig

if TYPE_CHECKING:
    from ppo_lifecycle.process_groups import ReloadableProcessGroups
    from ppo_trainer.backend import DataParallel

Region = Callable[[str], AbstractContextManager[None]]


class TrainerBackend(Protocol):
    """One rank of the actor or the critic, as the worker drives it."""

    WEIGHTS_TAG: str  # the memory backend's tags of the weights and of the optimizer state
    OPTIMIZER_TAG: str
    config: TrainerConfig
    # True when every rank must take part in ``named_weights`` and ``hf_state_dict`` (each tensor is
    # gathered by a collective: FSDP2 shards, tensor-parallel slices).
    sharded: bool

    @property
    def layout(self) -> str:
        """How the role is parallelised, for logs: ``replicate``, ``fsdp2`` or ``megatron tp=T dp=D``."""
        ...

    def set_step(self, step: int) -> float:
        """Set the optimizer's learning rate for training step ``step`` (``lr_schedule``); returns it."""
        ...

    # The PPO steps (ppo_math, as in the torch backend).
    def compute_log_probs(self, samples: Samples) -> torch.Tensor: ...

    def compute_values(self, samples: Samples) -> torch.Tensor: ...

    def token_rewards(self, samples: Samples) -> tuple[torch.Tensor, dict[str, float]]: ...

    def train_critic(self, samples: Samples) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]: ...

    def train_actor(
        self, samples: Samples, values: torch.Tensor | None, rewards: torch.Tensor | None = None
    ) -> dict[str, float]: ...

    # Weights in Hugging Face names (whole tensors; collective when ``sharded``).
    def named_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...

    # What the memory backend moves, and the lifecycle hooks.
    def weight_tensors(self) -> list[torch.Tensor]: ...

    def optimizer_tensors(self) -> list[torch.Tensor]: ...

    def optimizer_state_entries(self) -> int:
        """Parameters with optimizer state now (all of them from setup: it is created eagerly)."""
        ...

    def release_gathered(self) -> None:
        """Before sleeping: drop whatever is held outside the tracked tensors."""
        ...

    def after_groups_rebuilt(self) -> None:
        """After waking: point the backend at the rebuilt process groups."""
        ...

    # Checkpoints: the model's state in Hugging Face names, whole tensors (collective when sharded;
    # megatron: on every rank, the float32 main weights gathered over its data-parallel shards).
    def hf_state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...

    # The optimizer in ``optimizer.pt``'s format (``optimizer_format``): AdamW's state dict keyed by
    # Hugging Face name, whole tensors. Every rank calls both (collectives on sharded layouts); rank 0
    # gets the whole dict from ``hf_optimizer_state``, every rank passes it to the load.
    def hf_optimizer_state(self) -> dict[str, Any]: ...

    def load_hf_optimizer_state(self, state: Mapping[str, Any]) -> None: ...


class CheckpointIO(Protocol):
    """How the worker saves and loads a role's checkpoint folder: ``ppo_trainer.checkpoint`` (the torch
    backend) and ``ppo_trainer.megatron_checkpoint`` (the megatron backend; same files)."""

    def save_shard(self, trainer: TrainerBackend, folder: Path, step: int | None) -> None:
        """Write this rank's part into ``folder`` (the staging ``<role>.tmp``); every rank calls it."""
        ...

    def load_shard(self, trainer: TrainerBackend, folder: Path) -> int | None:
        """Restore the model, the optimizer and this rank's RNG from a ``<role>/`` folder; the step."""
        ...


def make_trainer(
    config: TrainerConfig,
    dp: DataParallel,
    region: Region,
    groups: ReloadableProcessGroups | None = None,
) -> TrainerBackend:
    """The backend ``config.backend`` names. ``groups``: the worker's reloadable process groups
    (megatron creates its model-parallel groups through them; required for ``megatron``)."""
    if config.backend == "megatron":
        if groups is None:
            raise ValueError("train.backend='megatron' needs the worker's ReloadableProcessGroups")
        from ppo_trainer.megatron_backend import MegatronTrainer  # imports megatron-core

        return MegatronTrainer(config, groups, region=region)
    from ppo_trainer.backend import TorchTrainer

    return TorchTrainer(config, dp, region=region)
