"""Pinned host backup for CUDA tensors: no allocator hook, works with any model code."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ppo_lifecycle.memory._pinned_copy import PinnedPool, copy_out_in_groups, copy_storages_in, cuda_device
from ppo_lifecycle.memory._tracking import Released, TrackingBackend, byte_view
from ppo_lifecycle.memory.allocator import expandable_segments_enabled
from ppo_lifecycle.memory.protocol import TensorSource


class PinnedHostBackend(TrackingBackend):
    """Copies tracked CUDA storages into pinned host buffers, frees them, and copies them back.

    * Buffers are allocated once per storage and reused every cycle. ``track()`` allocates them
      for the tensors that exist at that moment (``allocate_at_track=True``), which takes them off
      the critical path of the first sleep; tensors that appear later (optimizer state after the
      first step) get theirs at the first release that sees them, or at ``prepare()``.
    * Copies are chunked (``chunk_bytes``) and asynchronous on a side stream; a storage is freed
      once its copy landed, and ``torch.cuda.empty_cache()`` hands the cached blocks back to the
      device so ``torch.cuda.mem_get_info`` sees them free. On wake, allocating each storage again
      overlaps with the copy of the previous one.
    * ``free_while_copying``: hand freed blocks back every ``free_group_bytes`` while later copies
      still run, instead of once at the end. Only worth it with expandable segments (their frees
      wait for the allocating stream alone; an ordinary ``cudaFree`` waits for the whole device,
      copies included), so ``None`` (default) means "when ``expandable_segments_enabled()``".
    * Host cost: pinned memory equal to the tracked bytes, held until ``close()``.
    * CPU tensors among the tracked ones (Adam's ``step`` counters) are left in place.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        chunk_bytes: int = 256 << 20,
        allocate_at_track: bool = True,
        free_while_copying: bool | None = None,
        free_group_bytes: int = 256 << 20,
    ) -> None:
        super().__init__()
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if free_group_bytes <= 0:
            raise ValueError(f"free_group_bytes must be positive, got {free_group_bytes}")
        self._device = cuda_device(device)
        if self._device.type != "cuda":
            raise ValueError(f"PinnedHostBackend needs a CUDA device, got {self._device}")
        self._chunk_bytes = chunk_bytes
        self._allocate_at_track = allocate_at_track
        self._free_while_copying = free_while_copying
        self._free_group_bytes = free_group_bytes
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

    @property
    def frees_while_copying(self) -> bool:
        """Whether a release hands landed storages back while later ones copy (see the class doc)."""
        if self._free_while_copying is not None:
            return self._free_while_copying
        return expandable_segments_enabled()

    def _copy_out(
        self, tag: str, storages: list[torch.UntypedStorage]
    ) -> Iterator[tuple[torch.UntypedStorage, torch.Tensor]]:
        buffers = self._pool.buffers_for(storages)
        pairs = [(buf, byte_view(s)) for buf, s in zip(buffers, storages, strict=True)]
        early = self.frees_while_copying
        group_bytes = self._free_group_bytes if early else sum(s.nbytes() for s in storages)
        for indices in copy_out_in_groups(pairs, self._side_stream(), self._chunk_bytes, group_bytes):
            for i in indices:
                yield storages[i], buffers[i]  # the caller frees it before the next is asked for
            if early:
                torch.cuda.empty_cache()  # unmaps this group while the next groups copy

    def _copy_in(self, tag: str, items: list[Released]) -> None:
        copy_storages_in([(i.storage, i.backup) for i in items], self._side_stream(), self._chunk_bytes)

    def _after_free(self) -> None:
        torch.cuda.empty_cache()
