"""Pinned host backup for CUDA tensors: no allocator hook, works with any model code."""

from __future__ import annotations

import torch

from ppo_lifecycle.memory._pinned_copy import PinnedPool, copy_storages_in, copy_storages_out, cuda_device
from ppo_lifecycle.memory._tracking import Released, TrackingBackend
from ppo_lifecycle.memory.protocol import TensorSource


class PinnedHostBackend(TrackingBackend):
    """Copies tracked CUDA storages into pinned host buffers, frees them, and copies them back.

    * Buffers are allocated once per storage and reused every cycle. ``track()`` allocates them
      for the tensors that exist at that moment (``allocate_at_track=True``), which takes them off
      the critical path of the first sleep; tensors that appear later (optimizer state after the
      first step) get theirs at the first release that sees them, or at ``prepare()``.
    * Copies are chunked (``chunk_bytes``) and asynchronous on a side stream, synchronized before
      device memory is freed; after freeing, ``torch.cuda.empty_cache()`` hands the cached blocks
      back to the device so ``torch.cuda.mem_get_info`` sees them free. On wake, allocating each
      storage again overlaps with the copy of the previous one.
    * Host cost: pinned memory equal to the tracked bytes, held until ``close()``.
    * CPU tensors among the tracked ones (Adam's ``step`` counters) are left in place.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        chunk_bytes: int = 256 << 20,
        allocate_at_track: bool = True,
    ) -> None:
        super().__init__()
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._device = cuda_device(device)
        if self._device.type != "cuda":
            raise ValueError(f"PinnedHostBackend needs a CUDA device, got {self._device}")
        self._chunk_bytes = chunk_bytes
        self._allocate_at_track = allocate_at_track
        self._pool = PinnedPool()
        self._stream: torch.cuda.Stream | None = None

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned by this backend so far."""
        return self._pool.pinned_bytes

    def track(self, tag: str, tensors: TensorSource) -> None:
        super().track(tag, tensors)
        if self._allocate_at_track:
            self.prepare([tag])

    def prepare(self, tags: list[str] | None = None) -> int:
        """Allocate pinned buffers now for every tracked tensor that exists; returns pinned bytes."""
        with self._lock:
            for tag in self._resolve(tags):
                state = self._tags[tag]
                if not state.asleep:
                    self._pool.buffers_for(self._live_storages(tag, state))
            return self._pool.pinned_bytes

    def close(self) -> None:
        """Unpin every buffer. Refused while a tag is released (its bytes live there)."""
        with self._lock:
            asleep = [t for t, s in self._tags.items() if s.asleep]
            if asleep:
                raise RuntimeError(f"close(): tags {asleep} are released; restore them first")
            self._pool.close()

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    def _accepts(self, storage: torch.UntypedStorage) -> bool:
        return storage.device.type == "cuda"

    def _copy_out(self, tag: str, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        return copy_storages_out(self._pool, storages, self._side_stream(), self._chunk_bytes)

    def _copy_in(self, tag: str, items: list[Released]) -> None:
        copy_storages_in([(i.storage, i.backup) for i in items], self._side_stream(), self._chunk_bytes)

    def _after_free(self) -> None:
        torch.cuda.empty_cache()
