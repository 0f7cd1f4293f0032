"""Shared bookkeeping of the backends that move tracked tensors' storages (host and pinned).

A storage is released by copying its bytes to a backup and then ``resize_(0)``: every tensor
viewing it (parameters, ``.grad``, optimizer state, views) keeps its identity and metadata and
simply has no bytes until ``resize_(nbytes)`` and a copy back. Storages shared by several
tensors are moved once.

Retry safety: a storage enters the released list only once it is freed, and leaves it only once
its bytes are back; a storage with 0 bytes is never released again. A failure midway therefore
leaves a state from which the same call continues where it stopped.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from ppo_lifecycle.memory.protocol import TensorSource
from ppo_lifecycle.stats import TransferStats

log = logging.getLogger(__name__)


def storage_key(storage: torch.UntypedStorage) -> int:
    """Identity of the underlying StorageImpl: stable while it lives, shared by every view.

    ``_cdata`` is private but is the only identity that survives ``resize_(0)`` (the data pointer
    becomes 0 for every released storage) and new Python wrappers of the same storage.
    """
    return int(storage._cdata)


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (no copy)."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


def view_backup_as(backup: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``like``'s elements inside ``backup`` (the uint8 copy of ``like``'s whole storage), no copy.

    Same shape, dtype, strides and offset into the storage as ``like``; the buffers of the backends
    start on a page boundary, so every dtype's alignment holds.
    """
    typed = backup.view(like.dtype)
    return typed.as_strided(like.size(), like.stride(), typed.storage_offset() + like.storage_offset())


def own_storage(buf: torch.Tensor) -> torch.Tensor:
    """A flat host uint8 tensor as one whose storage is exactly its bytes (no copy).

    The pinned backends slice one slab into many buffers; writers that go by storage (``torch.save``
    writes a tensor's whole storage, ``save_pretrained`` takes tensors sharing one for tied weights)
    must see one storage per buffer. The result borrows the slab's memory: the slab must outlive it.
    """
    if buf.storage_offset() == 0 and buf.untyped_storage().nbytes() == buf.numel():
        return buf
    if buf.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    raw = (ctypes.c_uint8 * buf.numel()).from_address(buf.data_ptr())
    return torch.frombuffer(raw, dtype=torch.uint8)


@dataclass
class Released:
    storage: torch.UntypedStorage
    backup: torch.Tensor  # uint8, nbytes long, on the host
    nbytes: int


@dataclass
class TagState:
    sources: list[TensorSource] = field(default_factory=list)
    released: list[Released] = field(default_factory=list)
    asleep: bool = False


class TrackingBackend:
    """Base of the host and pinned backends: tags, storage discovery, retry-safe release/restore.

    Subclasses say how bytes travel: ``_copy_out`` yields each storage with its host backup once
    the backup is complete (the storage is freed right then), and ``_copy_in`` writes them back
    (complete when it returns).
    """

    def __init__(self) -> None:
        self._tags: dict[str, TagState] = {}
        self._lock = threading.RLock()

    # -- interface -------------------------------------------------------------------------
    def region(self, tag: str) -> AbstractContextManager[None]:
        _check_tag(tag)
        return nullcontext()

    def track(self, tag: str, tensors: TensorSource) -> None:
        _check_tag(tag)
        if not callable(tensors):
            raise ValueError(
                f"track({tag!r}, tensors): tensors must be a callable returning the tensors "
                "(e.g. `lambda: model.parameters()`), evaluated again at each release"
            )
        with self._lock:
            self._tags.setdefault(tag, TagState()).sources.append(tensors)

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._tags)

    def is_released(self, tag: str) -> bool:
        return self._state(tag).asleep

    def release(self, tags: Sequence[str] | None = None) -> TransferStats:
        with self._lock:
            start, moved, count = time.perf_counter(), 0, 0
            for tag in self._resolve(tags):
                state = self._tags[tag]
                if state.asleep:
                    log.debug("release(%r): already released, skipped", tag)
                    continue
                storages = self._live_storages(tag, state)
                if storages:
                    # Each storage is freed as soon as its backup is complete, before the next is
                    # asked for: a backend that copies in groups frees early ones while later copy.
                    for storage, backup in self._copy_out(tag, storages):
                        nbytes = storage.nbytes()
                        storage.resize_(0)
                        state.released.append(Released(storage, backup, nbytes))
                        moved += nbytes
                        count += 1
                    self._after_free()
                state.asleep = True
            return TransferStats(moved, time.perf_counter() - start, count)

    def host_copies(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The bytes the last release saved for each tensor, as host tensors of its shape (no copy).

        For writing a checkpoint of a sleeping worker from the copies its sleep made. Each tensor must
        belong to a released tag; a CPU tensor that this backend leaves in place (the pinned backend's
        Adam ``step`` counters) is cloned, since training changes it in place. The views stay valid
        until the next ``release`` of their tag writes the backups again (the pinned backend reuses
        its buffers), so a reader finishes before that.
        """
        with self._lock:
            # Keys first, and a borrowed storage only for the buffers asked for (one per buffer: tied
            # weights share it), so a call costs little more than the tensors it names.
            released = {
                storage_key(i.storage): i
                for state in self._tags.values()
                if state.asleep
                for i in state.released
            }
            borrowed: dict[int, torch.Tensor] = {}
            out = []
            for tensor in tensors:
                key = storage_key(tensor.untyped_storage())
                item = released.get(key)
                if item is not None:
                    if key not in borrowed:
                        borrowed[key] = own_storage(item.backup)
                    out.append(view_backup_as(borrowed[key], tensor))
                elif tensor.device.type == "cpu" and not self._accepts(tensor.untyped_storage()):
                    out.append(tensor.detach().clone())
                else:
                    raise ValueError(
                        f"host_copies: a tensor of shape {tuple(tensor.shape)} on {tensor.device} has no "
                        "host copy: it is not tracked, or its tag is resident; release its tag first"
                    )
            return out

    @property
    def keeps_host_copies(self) -> bool:
        """Whether ``host_copies`` can serve released tags (true for the host and pinned backends)."""
        return True

    def restore(self, tags: Sequence[str] | None = None) -> TransferStats:
        with self._lock:
            start, moved, count = time.perf_counter(), 0, 0
            for tag in self._resolve(tags):
                state = self._tags[tag]
                if not state.asleep:
                    log.debug("restore(%r): resident, skipped", tag)
                    continue
                if state.released:
                    # _copy_in re-allocates each storage that still has 0 bytes; a retried restore
                    # finds some already allocated and keeps them.
                    self._copy_in(tag, state.released)
                    moved += sum(item.nbytes for item in state.released)
                    count += len(state.released)
                    self._after_restore(state.released)
                    state.released = []
                state.asleep = False
            return TransferStats(moved, time.perf_counter() - start, count)

    # -- subclass hooks ----------------------------------------------------------------------
    def _accepts(self, storage: torch.UntypedStorage) -> bool:
        return True

    def _copy_out(
        self, tag: str, storages: list[torch.UntypedStorage]
    ) -> Iterator[tuple[torch.UntypedStorage, torch.Tensor]]:
        """Yield each storage with its host backup, in order, once the backup is complete.

        The caller frees each yielded storage before asking for the next one.
        """
        raise NotImplementedError

    def _copy_in(self, tag: str, items: list[Released]) -> None:
        """Re-allocate (``resize_(nbytes)``) each storage that has 0 bytes and copy its backup in."""
        raise NotImplementedError

    def _after_free(self) -> None:
        """Called after storages were freed (the pinned backend returns cached blocks to the device)."""

    def _after_restore(self, items: list[Released]) -> None:
        """Called once restored bytes are in place (the host backend drops its backups)."""

    # -- helpers -----------------------------------------------------------------------------
    def _state(self, tag: str) -> TagState:
        try:
            return self._tags[tag]
        except KeyError:
            known = ", ".join(repr(t) for t in self._tags) or "none"
            raise ValueError(
                f"unknown memory tag {tag!r}; tracked tags: {known}. Call track({tag!r}, ...) first"
            ) from None

    def _resolve(self, tags: Sequence[str] | None) -> list[str]:
        if tags is None:
            return list(self._tags)
        if isinstance(tags, str):
            raise ValueError(f"tags must be a sequence of tag names, not the string {tags!r}; use [{tags!r}]")
        for tag in tags:
            self._state(tag)
        return list(dict.fromkeys(tags))

    def _live_storages(self, tag: str, state: TagState) -> list[torch.UntypedStorage]:
        """Unique storages of the tag that still hold bytes, in a stable order."""
        seen: set[int] = set()
        out: list[torch.UntypedStorage] = []
        for source in state.sources:
            for tensor in source():
                if tensor is None:  # gradients before the first backward
                    continue
                if not isinstance(tensor, torch.Tensor):
                    kind = type(tensor).__name__
                    raise ValueError(f"tag {tag!r}: the tracked source yielded {kind}, not a tensor")
                storage = tensor.untyped_storage()
                key = storage_key(storage)
                if key in seen or storage.nbytes() == 0 or not self._accepts(storage):
                    continue
                if not storage.resizable():
                    raise ValueError(
                        f"tag {tag!r}: a tracked tensor of shape {tuple(tensor.shape)} has a storage that "
                        "cannot be resized (made from numpy or a memory-mapped file); clone it into a "
                        "regular tensor before tracking"
                    )
                seen.add(key)
                out.append(storage)
        return out


def _check_tag(tag: str) -> None:
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"memory tag must be a non-empty string, got {tag!r}")
