"""What the torch backend's checkpoint code reads of a trainer: ``TorchCheckpointable``.

``torch_io``, ``sharded`` and ``saves`` depend on this Protocol, not on ``backend.TorchTrainer``
(which satisfies it: ``ppo_trainer.backends`` has mypy check it): the checkpoint package sits below
the backend. The megatron backend's files go through ``backend_protocol.TrainerBackend`` alone
(``megatron_io``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ppo_trainer.backend_protocol import DataParallel, Region
from ppo_trainer.config import TrainerConfig
from ppo_trainer.converters.lora import LoRAConverter


class SharedTensors(Protocol):
    """A frozen base shared with another process (``shared_base.SharedBase``)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view into the shared buffer."""
        ...


@runtime_checkable
class TorchCheckpointable(Protocol):
    """One rank of a torch-backend role, as its checkpoints read and restore it: the model and AdamW
    in the model's own names, where the rank sits, and how its weights export to Hugging Face names."""

    @property
    def WEIGHTS_TAG(self) -> str:
        """The memory backend's tag of the weights (a load allocates under it)."""
        ...

    @property
    def config(self) -> TrainerConfig: ...

    @property
    def dp(self) -> DataParallel: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def sharded(self) -> bool:
        """FSDP2: each rank holds a shard and the whole tensors are gathered by collectives."""
        ...

    @property
    def model(self) -> nn.Module:
        """The trained model (converted: adapters, FSDP2), whose names the files keep."""
        ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def architecture(self) -> str:
        """The class transformers writes into ``config.json`` (FSDP renames the class it wraps)."""
        ...

    @property
    def region(self) -> Region: ...

    @property
    def shared_base(self) -> SharedTensors | None:
        """The frozen base shared with the other role (``train.lora.share_base``), if any."""
        ...

    @property
    def lora(self) -> LoRAConverter | None:
        """The LoRA converter of the trained model (None: every weight trains)."""
        ...

    def export_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors in the model's names as Hugging Face names (adapters merged)."""
        ...

    def maps_shared(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is in a base another process owns (this role must not write it)."""
        ...

    def load_hf_optimizer_state(self, state: Mapping[str, Any]) -> None:
        """An ``optimizer.pt`` dict into the optimizer, in the tensors it holds."""
        ...


__all__ = ["SharedTensors", "TorchCheckpointable"]
