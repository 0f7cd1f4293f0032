"""Memory backends: where a sleeping worker's device state goes."""

from __future__ import annotations

import torch

from ppo_lifecycle.memory.allocator import (
    enable_expandable_segments,
    expandable_segments_enabled,
    set_expandable_segments,
)
from ppo_lifecycle.memory.host import HostMemoryBackend
from ppo_lifecycle.memory.pinned import PinnedHostBackend
from ppo_lifecycle.memory.protocol import HostCopies, MemoryBackend, TensorSource
from ppo_lifecycle.memory.tms import TorchMemorySaverBackend


def default_backend(device: torch.device | str) -> MemoryBackend:
    """``HostMemoryBackend`` for CPU, ``PinnedHostBackend`` for CUDA.

    torch_memory_saver is never picked implicitly: it only releases memory allocated inside its
    regions, which the caller has to set up, so it is chosen explicitly.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return HostMemoryBackend()
    if dev.type == "cuda":
        return PinnedHostBackend(dev if dev.index is not None else None)
    raise ValueError(f"no memory backend for device type {dev.type!r}; expected 'cpu' or 'cuda'")


__all__ = [
    "HostCopies",
    "HostMemoryBackend",
    "MemoryBackend",
    "PinnedHostBackend",
    "TensorSource",
    "TorchMemorySaverBackend",
    "default_backend",
    "enable_expandable_segments",
    "expandable_segments_enabled",
    "set_expandable_segments",
]
