"""The converters' seam: ``ModelConverter`` and the named tensors its ``export`` passes on.

Its own module, below the package's ``__init__`` (which orders the converters) and the converters
(``attention``, ``lora``, ``compile``, ``sharding``), which import only this: the imports run one way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

NamedTensors = Iterator[tuple[str, torch.Tensor]]

__all__ = ["ModelConverter", "NamedTensors"]


class ModelConverter(Protocol):
    """One model transform: ``convert`` once after loading, ``export`` on every read of the weights."""

    @property
    def name(self) -> str:
        """What the converter is called (``train`` settings' word for it)."""
        ...

    def convert(self, model: nn.Module) -> nn.Module:
        """The converted model (in place where the transform allows; the result is what is used)."""
        ...

    def export(self, weights: NamedTensors, dtype: torch.dtype | None) -> NamedTensors:
        """``weights`` (the model's state dict as the converters after this one export it) as a
        Hugging Face checkpoint of the unconverted model names them. ``dtype``: what the caller casts
        to afterwards; a converter may cast earlier (before a gather, to move fewer bytes)."""
        ...
