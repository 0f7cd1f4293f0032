"""The interface every memory backend implements."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch

from ppo_lifecycle.stats import TransferStats

# The callable returns the tensors to move *now*; it is evaluated again at every release because
# some of them (optimizer state, gradients) appear or are replaced after tracking starts.
TensorSource = Callable[[], Iterable[torch.Tensor | None]]


@runtime_checkable
class MemoryBackend(Protocol):
    """Moves a worker's device state out of the way and back, under tags.

    Contract shared by every implementation:

    * ``release(tags)`` frees the memory of each tag; a tag already released is skipped
      (idempotent per tag, and per storage inside a tag, so a failed call can be retried).
    * ``restore(tags)`` brings it back bit for bit, into the *same* storage objects: every
      tensor, view, ``Parameter`` and optimizer reference stays valid.
    * ``tags=None`` means every tag the backend knows. An unknown tag is a ``ValueError``.
    """

    def region(self, tag: str) -> AbstractContextManager[None]:
        """Allocations made inside belong to ``tag`` (torch_memory_saver); a no-op elsewhere."""
        ...

    def track(self, tag: str, tensors: TensorSource) -> None:
        """Register the tensors to move under ``tag``; may be called several times per tag."""
        ...

    def release(self, tags: Sequence[str] | None = None) -> TransferStats: ...

    def restore(self, tags: Sequence[str] | None = None) -> TransferStats: ...


@runtime_checkable
class HostCopies(Protocol):
    """A backend whose release leaves host copies a reader may use while the tag sleeps.

    ``host_copies(tensors)`` returns, without copying, each tracked tensor's bytes as the last
    release saved them (same shape, dtype and strides, on the host); valid until the next release
    of the tag. A checkpoint of a sleeping worker is written from them, while the loop goes on.
    ``keeps_host_copies`` is false where an instance of such a backend cannot serve them.
    """

    @property
    def keeps_host_copies(self) -> bool: ...

    def host_copies(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...
