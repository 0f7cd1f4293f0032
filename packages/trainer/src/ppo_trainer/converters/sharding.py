"""FSDP2 as a converter: ``sharding.shard_model`` on convert, whole tensors gathered on export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ppo_trainer import sharding
from ppo_trainer.converters.protocol import NamedTensors


@dataclass(frozen=True)
class ShardingConverter:
    """Shards each decoder block and then the model over ``group`` (``param_dtype``: FSDP2's compute
    dtype). Export is a collective: every rank must iterate the weights in step."""

    group: dist.ProcessGroup
    device_type: str
    param_dtype: torch.dtype | None
    name: ClassVar[str] = "sharding"

    def convert(self, model: nn.Module) -> nn.Module:
        sharding.shard_model(model, self.group, self.device_type, self.param_dtype)
        return model

    def export(self, weights: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
        # Cast before gathering (fewer bytes over the group); a tied weight arrives as the same
        # tensor under each name and is gathered once.
        gathered: dict[int, torch.Tensor] = {}
        for name, tensor in weights:
            key = id(tensor)
            if key not in gathered:
                gathered[key] = sharding.full_tensor(tensor.detach(), dtype)
            yield name, gathered[key]
