"""Host backend: moves tracked storages into host memory and back (CPU runs and CI)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ppo_lifecycle.memory._tracking import Released, TrackingBackend, byte_view


class HostMemoryBackend(TrackingBackend):
    """Copies each tracked storage to a fresh host buffer, frees the storage, and copies it back.

    Works for tensors on any device (plain blocking copies; on CUDA use ``PinnedHostBackend``,
    which is an order of magnitude faster). Backups are dropped after restore, so on CPU the
    resident process holds one copy of the state at any time.
    """

    def _copy_out(
        self, tag: str, storages: list[torch.UntypedStorage]
    ) -> Iterator[tuple[torch.UntypedStorage, torch.Tensor]]:
        for storage in storages:
            backup = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu")
            backup.copy_(byte_view(storage))
            yield storage, backup

    def _copy_in(self, tag: str, items: list[Released]) -> None:
        for item in items:
            if item.storage.nbytes() == 0:
                item.storage.resize_(item.nbytes)
            byte_view(item.storage).copy_(item.backup)

    def _after_restore(self, items: list[Released]) -> None:
        for item in items:
            item.backup = torch.empty(0, dtype=torch.uint8)
