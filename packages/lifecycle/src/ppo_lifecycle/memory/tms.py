"""torch_memory_saver backend: allocations in ``region(tag)`` are unmapped by pause, remapped by resume."""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch

from ppo_lifecycle.memory._pinned_copy import PinnedPool, copy_storages_in, copy_storages_out, cuda_device
from ppo_lifecycle.memory._tracking import own_storage, storage_key, view_backup_as
from ppo_lifecycle.memory.allocator import expandable_segments_enabled
from ppo_lifecycle.memory.protocol import TensorSource
from ppo_lifecycle.stats import TransferStats

log = logging.getLogger(__name__)

Backup = Literal["pinned", "retain", "tms_default"]
_BACKUPS: tuple[str, ...] = ("pinned", "retain", "tms_default")
_TagPhase = Literal["resident", "paused", "mapped"]


def _import_tms() -> Any:
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError as exc:
        raise ImportError(
            "TorchMemorySaverBackend needs the torch_memory_saver package (CUDA, Linux): "
            "`pip install 'ppo-lifecycle[memory-saver]'`, or use PinnedHostBackend"
        ) from exc
    return torch_memory_saver


_exit_hook_registered = False


def _let_region_memory_go_at_exit(tms: Any) -> None:
    """torch_memory_saver 0.0.10 (hook mode "torch") ends the process with exit code 1 ("only support
    interesting region") when its free hook runs outside a region. torch calls that hook when a
    region's pool gives its segments back: at interpreter exit, when the pools are destroyed, outside
    any region, so every process that used a region exited with 1 after its work succeeded (seen on an
    H200, 2026-12-01). From exit on, this process's thread counts as inside one: the hook then frees
    through torch_memory_saver as it would inside a region. Hook mode "torch" only: that hook sees
    region memory alone, while the "preload" mode's ``cudaFree`` hook would then hand every pointer of
    the process to torch_memory_saver. Newer versions drop that check for XPU only; private names, so
    nothing is done where they differ."""
    impl = getattr(tms, "_impl", None)
    if getattr(impl, "_hook_mode", None) != "torch":
        return
    library = getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)
    set_region = getattr(library, "tms_set_interesting_region", None)
    if set_region is not None:
        set_region(True)


class TorchMemorySaverBackend:
    """Releases whole torch_memory_saver regions (weights, optimizer, kv_cache, ... by tag).

    Only memory allocated inside ``region(tag)`` is released: build the model, run the optimizer
    step that creates its state, and allocate caches inside the matching region.

    ``backup`` says where the bytes go while paused:

    * ``"pinned"`` (default): regions are made *without* torch_memory_saver's CPU backup; the
      tensors given to ``track(tag, ...)`` are copied into pinned buffers owned by this backend
      (allocated once, at ``track`` time for the tensors that exist then) with chunked async copies,
      then the region is paused. Every cycle runs at pinned-copy speed, the first one included.
      Host cost: pinned memory equal to the tracked bytes, for the life of the backend.
      **Contents of untracked allocations in a region are discarded** (right for a KV cache and
      allocator slack; wrong for weights you forgot to track: a warning names such tags).
    * ``"retain"``: torch_memory_saver's own CPU backup with ``retain_cpu_backup = True``. Fast
      from the second cycle; the first pause allocates the host backup (slow). Host cost: pinned
      memory equal to the whole region, kept for the life of the process.
    * ``"tms_default"``: torch_memory_saver's CPU backup as shipped (allocated and freed every
      cycle, blocking copies); slow, kept as the baseline.

    ``retain_cpu_backup`` is a process-wide switch of torch_memory_saver: this backend sets it to
    its own choice right before each pause and resume.
    """

    def __init__(
        self,
        *,
        backup: Backup = "pinned",
        hook_mode: Literal["torch", "preload"] = "torch",
        chunk_bytes: int = 256 << 20,
        device: torch.device | str | int | None = None,
    ) -> None:
        if backup not in _BACKUPS:
            raise ValueError(f"backup must be one of {_BACKUPS}, got {backup!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if expandable_segments_enabled():
            # torch_memory_saver 0.0.10 aborts in its free hook ("only support interesting region")
            # when torch's allocator makes expandable segments (seen on an H200, 2026-12-01).
            raise ValueError(
                "TorchMemorySaverBackend: torch's allocator uses expandable segments "
                "(PYTORCH_CUDA_ALLOC_CONF or enable_expandable_segments()), which torch_memory_saver's "
                "regions cannot hold; set expandable_segments:False, or use PinnedHostBackend"
            )
        self._tms = _import_tms()
        global _exit_hook_registered
        if not _exit_hook_registered:
            atexit.register(_let_region_memory_go_at_exit, self._tms)
            _exit_hook_registered = True
        try:
            self._tms.hook_mode = hook_mode
        except (AssertionError, AttributeError):
            # Already initialised by earlier use in this process: its hook mode is fixed.
            log.info("torch_memory_saver already initialised; keeping its hook mode")
        self._backup = backup
        self._chunk_bytes = chunk_bytes
        self._device = cuda_device(device)
        self._pool = PinnedPool()
        self._stream: torch.cuda.Stream | None = None
        self._sources: dict[str, list[TensorSource]] = {}
        self._region_tags: list[str] = []
        self._phase: dict[str, _TagPhase] = {}
        self._lock = threading.RLock()
        self._warned: set[str] = set()

    @property
    def backup(self) -> Backup:
        return self._backup

    @property
    def pinned_bytes(self) -> int:
        """Host memory pinned by this backend (the ``"pinned"`` mode's buffers)."""
        return self._pool.pinned_bytes

    def region(self, tag: str) -> AbstractContextManager[None]:
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"memory tag must be a non-empty string, got {tag!r}")
        with self._lock:
            if self._phase.get(tag, "resident") != "resident":
                raise RuntimeError(f"region({tag!r}): the tag is released; restore it before allocating")
            if tag not in self._region_tags:
                self._region_tags.append(tag)
                self._phase[tag] = "resident"
        cm: AbstractContextManager[None] = self._tms.region(
            tag=tag, enable_cpu_backup=self._backup != "pinned"
        )
        return cm

    def track(self, tag: str, tensors: TensorSource) -> None:
        if not callable(tensors):
            raise ValueError(f"track({tag!r}, tensors): tensors must be a callable returning the tensors")
        with self._lock:
            self._sources.setdefault(tag, []).append(tensors)
            self._phase.setdefault(tag, "resident")
            if self._backup == "pinned":
                self._pool.buffers_for(self._storages(tag))

    def is_released(self, tag: str) -> bool:
        return self._phase.get(tag, "resident") != "resident"

    def release(self, tags: Sequence[str] | None = None) -> TransferStats:
        with self._lock:
            total = TransferStats()
            for tag in self._resolve(tags):
                total = total + self._release_one(tag)
            return total

    def restore(self, tags: Sequence[str] | None = None) -> TransferStats:
        with self._lock:
            total = TransferStats()
            for tag in self._resolve(tags):
                total = total + self._restore_one(tag)
            return total

    @property
    def keeps_host_copies(self) -> bool:
        """Only the ``"pinned"`` mode holds host copies this backend can hand out (``host_copies``)."""
        return self._backup == "pinned"

    def host_copies(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The bytes the last release saved for each tensor, as host tensors of its shape (no copy).

        ``"pinned"`` mode only; each CUDA tensor must belong to a paused tag, CPU tensors are cloned.
        The views stay valid until the next release of their tag writes the buffers again.
        """
        with self._lock:
            if self._backup != "pinned":
                raise ValueError(
                    f"host_copies: backup={self._backup!r} keeps its host copies inside torch_memory_saver; "
                    "use backup='pinned'"
                )
            # Keys first, and a borrowed storage only for the buffers asked for (one per buffer: tied
            # weights share it), so a call costs little more than the tensors it names.
            paused = {
                storage_key(s): s
                for tag, phase in self._phase.items()
                if phase == "paused"
                for s in self._storages(tag)
            }
            borrowed: dict[int, torch.Tensor] = {}
            out = []
            for tensor in tensors:
                key = storage_key(tensor.untyped_storage())
                if tensor.device.type == "cpu":
                    out.append(tensor.detach().clone())
                elif key in paused:
                    if key not in borrowed:
                        borrowed[key] = own_storage(self._pool.buffer_of(paused[key]))
                    out.append(view_backup_as(borrowed[key], tensor))
                else:
                    raise ValueError(
                        f"host_copies: a tensor of shape {tuple(tensor.shape)} on {tensor.device} has no "
                        "host copy: it is not tracked, or its tag is resident; release its tag first"
                    )
            return out

    def close(self) -> None:
        with self._lock:
            if any(p != "resident" for p in self._phase.values()):
                raise RuntimeError("close(): some tags are released; restore them first")
            self._pool.close()

    # -- one tag ---------------------------------------------------------------------------
    def _release_one(self, tag: str) -> TransferStats:
        phase = self._phase[tag]
        if phase == "paused":
            return TransferStats()
        start = time.perf_counter()
        copied, count = 0, 0
        # In "mapped" (resumed, bytes not yet copied back by a failed restore) the device holds
        # garbage and the pinned buffers hold the truth: pause again without copying out.
        if self._backup == "pinned" and phase == "resident":
            storages = self._storages(tag)
            if storages:
                copy_storages_out(self._pool, storages, self._side_stream(), self._chunk_bytes)
                copied, count = sum(s.nbytes() for s in storages), len(storages)
            elif tag in self._region_tags and tag not in self._warned:
                self._warned.add(tag)
                log.warning("tag %r has no tracked tensors: its region is discarded on release", tag)
        torch.cuda.synchronize(self._device)
        free_before = torch.cuda.mem_get_info(self._device)[0]
        if tag in self._region_tags:
            self._set_retain()
            self._tms.pause(tag)
        self._phase[tag] = "paused"
        freed = torch.cuda.mem_get_info(self._device)[0] - free_before
        moved = copied if self._backup == "pinned" else max(freed, 0)
        return TransferStats(moved, time.perf_counter() - start, count)

    def _restore_one(self, tag: str) -> TransferStats:
        phase = self._phase[tag]
        if phase == "resident":
            return TransferStats()
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self._device)[0]
        if phase == "paused":
            if tag in self._region_tags:
                self._set_retain()
                self._tms.resume(tag)
            self._phase[tag] = "mapped"
        taken = max(free_before - torch.cuda.mem_get_info(self._device)[0], 0)
        copied, count = 0, 0
        if self._backup == "pinned":
            storages = self._storages(tag)
            pairs = [(s, self._pool.buffer_of(s)) for s in storages]
            copy_storages_in(pairs, self._side_stream(), self._chunk_bytes)
            copied, count = sum(s.nbytes() for s in storages), len(storages)
        torch.cuda.synchronize(self._device)
        self._phase[tag] = "resident"
        moved = copied if self._backup == "pinned" else taken
        return TransferStats(moved, time.perf_counter() - start, count)

    # -- helpers ---------------------------------------------------------------------------
    def _set_retain(self) -> None:
        if self._backup != "pinned":
            self._tms.retain_cpu_backup = self._backup == "retain"

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        return self._stream

    def _storages(self, tag: str) -> list[torch.UntypedStorage]:
        seen: set[int] = set()
        out: list[torch.UntypedStorage] = []
        for source in self._sources.get(tag, []):
            for tensor in source():
                if tensor is None or tensor.device.type != "cuda":
                    continue
                storage = tensor.untyped_storage()
                key = storage_key(storage)
                if key not in seen and storage.nbytes() > 0:
                    seen.add(key)
                    out.append(storage)
        return out

    def _resolve(self, tags: Sequence[str] | None) -> list[str]:
        known = list(self._phase)
        if tags is None:
            return known
        if isinstance(tags, str):
            raise ValueError(f"tags must be a sequence of tag names, not the string {tags!r}; use [{tags!r}]")
        for tag in tags:
            if tag not in self._phase:
                raise ValueError(f"unknown memory tag {tag!r}; known: {known}. Use region() or track() first")
        return list(dict.fromkeys(tags))
