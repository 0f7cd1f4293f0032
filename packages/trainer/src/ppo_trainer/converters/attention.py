"""``train.packed_attention`` as a converter: which attention kernel transformers calls (packed rows)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ppo_trainer import packing
from ppo_trainer.config import PackedAttention
from ppo_trainer.converters.protocol import NamedTensors


@dataclass(frozen=True)
class PackedAttentionConverter:
    """Sets every transformers model inside to ``kind`` (``packing.use_attention``); no weight changes."""

    kind: PackedAttention
    name: ClassVar[str] = "attention"

    def convert(self, model: nn.Module) -> nn.Module:
        packing.use_attention(model, self.kind)
        return model

    def export(self, weights: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
        return weights
