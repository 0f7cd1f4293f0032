"""Pinned host buffers and chunked asynchronous copies, shared by the CUDA backends.

Buffers: one slab of page-locked host memory per allocation round, sliced into one exact-size
buffer per storage. The slab is ordinary host memory pinned with ``cudaHostRegister`` rather than
``torch.empty(pin_memory=True)``, because torch's pinned caching allocator rounds every request
up to a power of two (a 10 GiB state would pin 16 GiB). If registration is unavailable the slab
falls back to torch's pinned allocator.

Copies: enqueued in chunks of ``chunk_bytes`` on a side stream that first waits for the current
stream (so pending kernels that write the tensors finish first), then synchronized before the
caller frees device memory or hands the tensors back. Copies out can also be waited for in groups
(``copy_out_in_groups``), so the first storages are freed while the later ones still copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from ppo_lifecycle.memory._tracking import byte_view, storage_key

log = logging.getLogger(__name__)

_ALIGN = 4096  # page alignment for cudaHostRegister and for each buffer inside a slab


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class PinnedPool:
    """Exact-size pinned host buffers keyed by storage identity, allocated once and reused."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}
        self._slabs: list[tuple[torch.Tensor, int | None]] = []  # (tensor, registered pointer)
        self.pinned_bytes = 0

    def buffers_for(self, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        """The buffer of each storage, allocating one slab for all those that have none yet."""
        missing = [
            s
            for s in storages
            if (buf := self._buffers.get(storage_key(s))) is None or buf.numel() != s.nbytes()
        ]
        if missing:
            total = sum(_round_up(s.nbytes(), _ALIGN) for s in missing)
            slab = self._allocate(total)
            offset = 0
            for s in missing:
                self._buffers[storage_key(s)] = slab[offset : offset + s.nbytes()]
                offset += _round_up(s.nbytes(), _ALIGN)
        return [self._buffers[storage_key(s)] for s in storages]

    def buffer_of(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return self._buffers[storage_key(storage)]

    def _allocate(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
        offset = (-raw.data_ptr()) % _ALIGN
        slab = raw[offset : offset + nbytes]
        try:
            cudart = torch.cuda.cudart()
            # flag 1 = cudaHostRegisterPortable, as torch's own pin_memory utility does
            code = int(cudart.cudaHostRegister(slab.data_ptr(), nbytes, 1))
            if code != 0:
                raise RuntimeError(f"cudaHostRegister returned cudaError {code}")
            if not slab.is_pinned():
                cudart.cudaHostUnregister(slab.data_ptr())
                raise RuntimeError("registered host memory is not reported as pinned")
            self._slabs.append((raw, slab.data_ptr()))
        except Exception as exc:  # no cudart binding, or registration refused: torch's allocator
            log.warning("cudaHostRegister(%d bytes) failed (%s); using torch pin_memory", nbytes, exc)
            del raw, slab
            slab = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._slabs.append((slab, None))
        self.pinned_bytes += nbytes
        return slab

    def close(self) -> None:
        """Unpin and drop every buffer (the backend must not be asleep)."""
        self._buffers.clear()
        for _tensor, ptr in self._slabs:
            if ptr is not None:
                code = int(torch.cuda.cudart().cudaHostUnregister(ptr))
                if code != 0:
                    log.warning("cudaHostUnregister returned cudaError %d", code)
        self._slabs.clear()
        self.pinned_bytes = 0


def _copy_chunks(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> None:
    """Enqueue ``dst <- src`` (flat uint8) in chunks of ``chunk_bytes`` on the current stream."""
    n = src.numel()
    for start in range(0, n, chunk_bytes):
        end = min(start + chunk_bytes, n)
        dst[start:end].copy_(src[start:end], non_blocking=True)


def chunked_copy(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    stream: torch.cuda.Stream,
    chunk_bytes: int,
) -> None:
    """Copy each ``(dst, src)`` uint8 pair in chunks on ``stream``; returns once all are done."""
    whole = sum(src.numel() for _, src in pairs)
    for _ in copy_out_in_groups(pairs, stream, chunk_bytes, group_bytes=whole):
        pass  # one group: returns once its event says every copy landed


def copy_out_in_groups(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    stream: torch.cuda.Stream,
    chunk_bytes: int,
    group_bytes: int,
) -> Iterator[range]:
    """Enqueue every ``(dst, src)`` copy on ``stream`` now; yield each group's indices once it landed.

    A group is consecutive pairs of about ``group_bytes`` (at least one pair); an event recorded
    after its last copy tells when its sources may be freed. Everything is enqueued before the
    first wait, so the copy engine never idles while the caller frees a landed group.
    """
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    groups: list[tuple[range, torch.cuda.Event]] = []
    with torch.cuda.stream(stream):
        first, pending = 0, 0
        for index, (dst, src) in enumerate(pairs):
            _copy_chunks(dst, src, chunk_bytes)
            pending += src.numel()
            if pending >= group_bytes or index == len(pairs) - 1:
                landed = torch.cuda.Event()
                landed.record(stream)
                groups.append((range(first, index + 1), landed))
                first, pending = index + 1, 0
    for indices, landed in groups:
        landed.synchronize()
        yield indices


def copy_storages_out(
    pool: PinnedPool, storages: list[torch.UntypedStorage], stream: torch.cuda.Stream, chunk_bytes: int
) -> list[torch.Tensor]:
    buffers = pool.buffers_for(storages)
    chunked_copy([(buf, byte_view(s)) for buf, s in zip(buffers, storages, strict=True)], stream, chunk_bytes)
    return buffers


def copy_storages_in(
    pairs: list[tuple[torch.UntypedStorage, torch.Tensor]], stream: torch.cuda.Stream, chunk_bytes: int
) -> None:
    """Copy each host buffer back into its storage, re-allocating storages freed by ``resize_(0)``.

    Allocation and copies are pipelined: storage i+1 is allocated (host-side work in the caching
    allocator) while the copy of storage i runs, so the wake does not pay for all allocations first.
    """
    current = torch.cuda.current_stream(stream.device)
    for storage, buf in pairs:
        if storage.nbytes() == 0:
            storage.resize_(buf.numel())  # allocated on the current stream
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            _copy_chunks(byte_view(storage), buf, chunk_bytes)
    stream.synchronize()


def cuda_device(device: torch.device | str | int | None) -> torch.device:
    """``device`` as a torch.device; None: the current CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)
