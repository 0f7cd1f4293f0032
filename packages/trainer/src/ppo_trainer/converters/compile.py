"""``train.compile_layers`` as a converter: each decoder layer through ``torch.compile``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ppo_trainer.compiled import compile_decoder_layers
from ppo_trainer.converters.protocol import NamedTensors


@dataclass(frozen=True)
class CompileConverter:
    """``compiled.compile_decoder_layers``: the modules and their parameters stay, so names do too."""

    name: ClassVar[str] = "compile"

    def convert(self, model: nn.Module) -> nn.Module:
        compile_decoder_layers(model)
        return model

    def export(self, weights: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
        return weights
