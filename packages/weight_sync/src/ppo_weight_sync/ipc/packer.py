"""Sender side of a colocated update: two reusable GPU bucket buffers, packed in turn, shared once.

The pipelines (:func:`send_buckets`, one message per bucket; :func:`send_stream`, one per update with the
buckets announced through shared counters): bucket *k* is packed into buffer ``k % 2``; once its copies are
done the engine is told (one message per bucket) and bucket *k+1* is packed into the other buffer while
the engine copies *k* out. A buffer is packed again only after the engine answered for the bucket it
held, and the engine answers only once its copies finished, so no byte is overwritten while read.

Buffers stay allocated between updates (allocating 2 x 512 MiB per update would cost more than the
copy) and are freed by :meth:`BucketPacker.free`, which the trainer calls before it sleeps.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ppo_weight_sync.ipc.handles import IpcHandle, export_buffer
from ppo_weight_sync.ipc.layout import BucketLayout, plan_layouts
from ppo_weight_sync.ipc.segments import ordinary_segments
from ppo_weight_sync.ipc.signals import BucketSignals
from ppo_weight_sync.waiting import wait_until

__all__ = [
    "BucketPacker",
    "PipelineStats",
    "auto_bucket_bytes",
    "pack_first",
    "send_buckets",
    "split_tensors",
]

_POLL_S = 0.00002

MIN_AUTO_BUCKET = 64 << 20
MAX_AUTO_BUCKET = 1 << 30


def auto_bucket_bytes(total_bytes: int) -> int:
    """The colocated bucket size for an update of ``total_bytes``: an eighth of it, rounded to the nearest
    power of two, within [64 MiB, 1 GiB].

    Each bucket costs one message round trip (about 0.5 ms over HTTP), more than copying 512 MiB on an
    H200, so fewer buckets are faster; the two buffers cost memory, so they stay near a quarter of the
    model (at most about a third, after rounding): 1 GB -> 128 MiB, 4 GB -> 512 MiB, 16 GB -> 1 GiB.
    """
    if total_bytes <= 0:
        return MIN_AUTO_BUCKET
    eighth = max(total_bytes / 8, 1.0)
    nearest = 1 << round(math.log2(eighth))
    return int(min(max(nearest, MIN_AUTO_BUCKET), MAX_AUTO_BUCKET))


class BucketPacker:
    """Two GPU buffers of ``bucket_bytes`` (or the biggest single tensor), their IPC exports per consumer."""

    def __init__(self, device: torch.device, bucket_bytes: int, timeout_s: float) -> None:
        if device.type != "cuda":
            raise ValueError(f"BucketPacker: device must be a CUDA device, got {device}")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.device = device
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._buffers: list[torch.Tensor] = []
        self._pool: torch.cuda.MemPool | None = None  # the buffers' own pool under expandable segments
        self._events: list[torch.cuda.Event | None] = [None, None]
        # Exports per consumer: one export is one consumer's one mapping (see handles.py).
        self._exports: dict[str, dict[int, IpcHandle]] = {}
        self.generation = 0  # bumped whenever the buffers are replaced (consumers must map anew)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers)

    def plan(
        self, items: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int | None = None
    ) -> list[BucketLayout]:
        """``items`` in buckets of at most ``bucket_bytes`` (default: this packer's)."""
        metas = [(n, t.dtype, tuple(t.shape)) for n, t in items]
        return plan_layouts(metas, bucket_bytes or self.bucket_bytes)

    def reserve(self, layouts: Sequence[BucketLayout]) -> bool:
        """Make sure both buffers hold the biggest bucket; True when they were (re)allocated."""
        need = max((layout.nbytes for layout in layouts), default=0)
        if self._buffers and self._buffers[0].numel() >= need:
            return False
        self.free()
        with torch.cuda.device(self.device), ordinary_segments(self.device) as pool:
            self._buffers = [torch.empty(need, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._pool = pool
        self.generation += 1
        return True

    def buffer(self, slot: int) -> torch.Tensor:
        """Buffer ``slot`` (0 or 1) itself, e.g. for a fresh per-call export (SGLang's payload)."""
        if not self._buffers:
            raise RuntimeError("BucketPacker.buffer: no buffers; call reserve() first")
        return self._buffers[slot]

    def handle(self, consumer: str, slot: int) -> IpcHandle:
        """Buffer ``slot`` exported for ``consumer``: once per consumer and allocation, on first use, so
        every export is sent, and a receiver maps every handle it is sent (see handles.py's counts)."""
        if not self._buffers:
            raise RuntimeError("BucketPacker.handle: no buffers; call reserve() first")
        exports = self._exports.setdefault(consumer, {})
        cached = exports.get(slot)
        if cached is None:
            with torch.cuda.device(self.device):
                cached = export_buffer(self._buffers[slot])
            exports[slot] = cached
        return cached

    def pack(self, slot: int, layout: BucketLayout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the copies of ``tensors`` (in ``layout``'s order) into buffer ``slot`` on this stream."""
        buffer = self._buffers[slot]
        with torch.cuda.device(self.device):
            for tensor, offset, size in zip(tensors, layout.offsets, layout.sizes(), strict=True):
                src = tensor.detach()
                if src.device != self.device:
                    src = src.to(self.device, non_blocking=True)
                flat = src.contiguous().reshape(-1).view(torch.uint8)
                buffer[offset : offset + size].copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._events[slot] = event

    def wait_packed(self, slot: int, check: Callable[[], None] | None = None) -> None:
        """Host wait (bounded) until buffer ``slot``'s copies are done: the engine reads it right after."""
        event = self._events[slot]
        if event is None:
            return
        wait_until(
            event.query,
            self.timeout_s,
            lambda: f"packing a weight bucket on {self.device} did not finish in {self.timeout_s:g} s",
            poll_s=_POLL_S,
            check=check,
        )
        self._events[slot] = None

    def forget(self, consumer: str, *, released: bool) -> None:
        """``consumer``'s exports are spent. ``released``: it unmapped them itself (its counts dropped);
        otherwise (it died, or never answered) drop its counts on its behalf, or the buffers' memory would
        stay held by torch after :meth:`free` until this process exits."""
        exports = self._exports.pop(consumer, {})
        if not released:
            for export in exports.values():
                torch.UntypedStorage._release_ipc_counter_cuda(
                    export.ref_counter_handle, export.ref_counter_offset
                )

    def free(self) -> None:
        """Drop both buffers and every export; the memory returns once the consumers released their
        mappings (``torch.cuda.ipc_collect`` frees blocks whose consumers are done)."""
        self._buffers = []
        self._pool = None  # with the buffers gone, its segments are released like any cached block
        self._events = [None, None]
        self._exports = {}
        if torch.cuda.is_initialized():
            torch.cuda.ipc_collect()


@dataclass(frozen=True)
class PipelineStats:
    nbytes: int
    buckets: int
    seconds: float
    wait_pack_s: float  # host time waiting for packing to finish
    wait_reply_s: float  # host time waiting for the engines' answers


PostBucket = Callable[[int, BucketLayout, bool], Sequence[Callable[[float], None]]]


def split_tensors(
    items: Sequence[tuple[str, torch.Tensor]], layouts: Sequence[BucketLayout]
) -> list[list[torch.Tensor]]:
    """``items``' tensors, bucket by bucket as ``layouts`` hold them."""
    tensors = [t for _, t in items]
    index = 0
    per_bucket: list[list[torch.Tensor]] = []
    for layout in layouts:
        per_bucket.append(tensors[index : index + len(layout.names)])
        index += len(layout.names)
    if index != len(tensors):
        raise ValueError(f"layouts cover {index} tensors, items hold {len(tensors)}")
    return per_bucket


def pack_first(
    packer: BucketPacker, items: Sequence[tuple[str, torch.Tensor]], layouts: Sequence[BucketLayout]
) -> None:
    """Reserve the buffers and queue bucket 0's copies (asynchronous on the GPU), ahead of
    :func:`send_buckets` with ``first_packed=True``: the sender does it while the engines pause."""
    packer.reserve(layouts)
    if layouts:
        packer.pack(0, layouts[0], split_tensors(items, layouts)[0])


def send_buckets(
    packer: BucketPacker,
    items: Sequence[tuple[str, torch.Tensor]],
    layouts: Sequence[BucketLayout],
    post: PostBucket,
    timeout_s: float,
    *,
    first_packed: bool = False,
) -> PipelineStats:
    """Pack and post every bucket, double-buffered. ``post(slot, layout, last)`` sends one bucket's
    message to each engine on this GPU and returns one waiter per engine; a waiter blocks at most the
    time given and raises when the engine failed or did not answer. ``first_packed``: bucket 0 is
    already queued into buffer 0 (:func:`pack_first`)."""
    start = time.perf_counter()
    packer.reserve(layouts)
    per_bucket = split_tensors(items, layouts)
    waiting: list[Sequence[Callable[[float], None]] | None] = [None, None]
    wait_pack = wait_reply = 0.0
    try:
        if layouts and not first_packed:
            packer.pack(0, layouts[0], per_bucket[0])
        for k, layout in enumerate(layouts):
            slot = k % 2
            t0 = time.perf_counter()
            packer.wait_packed(slot)
            wait_pack += time.perf_counter() - t0
            waiting[slot] = post(slot, layout, k == len(layouts) - 1)
            if k + 1 < len(layouts):
                other = 1 - slot
                t0 = time.perf_counter()
                pending, waiting[other] = waiting[other], None
                for waiter in pending or ():
                    waiter(timeout_s)  # the bucket that buffer held is loaded: the buffer is free
                wait_reply += time.perf_counter() - t0
                packer.pack(other, layouts[k + 1], per_bucket[k + 1])
        t0 = time.perf_counter()
        for k in range(max(0, len(layouts) - 2), len(layouts)):
            pending, waiting[k % 2] = waiting[k % 2], None
            for waiter in pending or ():
                waiter(timeout_s)
        wait_reply += time.perf_counter() - t0
    except BaseException:
        # An engine may still be copying the other bucket: let every posted message finish (or fail)
        # before the caller may pack into these buffers again.
        for pending in waiting:
            for waiter in pending or ():
                with contextlib.suppress(Exception):
                    waiter(timeout_s)
        raise
    return PipelineStats(
        nbytes=sum(sum(layout.sizes()) for layout in layouts),
        buckets=len(layouts),
        seconds=time.perf_counter() - start,
        wait_pack_s=wait_pack,
        wait_reply_s=wait_reply,
    )


def send_stream(
    packer: BucketPacker,
    items: Sequence[tuple[str, torch.Tensor]],
    layouts: Sequence[BucketLayout],
    signals: Sequence[BucketSignals],
    post: Callable[[], Sequence[Callable[[float], None]]],
    check: Callable[[], None],
    timeout_s: float,
    *,
    first_packed: bool = False,
) -> PipelineStats:
    """One request per update (``ppo_ipc_stream``): ``post()`` sends it and returns a waiter per engine;
    then bucket *k* is packed into buffer ``k % 2``, announced through every engine's ``signals``
    (``packed``), and buffer ``k % 2`` is packed again only once each engine's ``loaded`` says it copied
    bucket *k-2* out.
    ``check()`` raises when an engine's request already answered (a failure, or a refusal that stops
    the update); it runs between polls. On any failure the engine is told to stop (``abort``) and its
    answer awaited (bounded) before this returns, so the buffers are no longer read."""
    start = time.perf_counter()
    packer.reserve(layouts)
    per_bucket = split_tensors(items, layouts)
    n = len(layouts)
    wait_pack = wait_reply = 0.0
    for signal in signals:
        signal.start()
    waiters = list(post())
    try:
        if n and not first_packed:
            packer.pack(0, layouts[0], per_bucket[0])
        for k in range(n):
            slot = k % 2
            t0 = time.perf_counter()
            packer.wait_packed(slot, check)
            wait_pack += time.perf_counter() - t0
            for signal in signals:
                signal.set("packed", k + 1)
            if k + 1 < n:
                t0 = time.perf_counter()
                # Buffer 1 - slot held bucket k - 1: it must be copied out before it is packed again.
                for signal in signals:
                    signal.wait_at_least("loaded", k, timeout_s, f"copying weight bucket {k - 1} out", check)
                wait_reply += time.perf_counter() - t0
                packer.pack(1 - slot, layouts[k + 1], per_bucket[k + 1])
        t0 = time.perf_counter()
        for waiter in waiters:
            waiter(timeout_s)
        wait_reply += time.perf_counter() - t0
    except BaseException:
        for signal in signals:
            signal.set("abort", 1)
        for waiter in waiters:
            with contextlib.suppress(Exception):
                waiter(timeout_s)
        raise
    return PipelineStats(
        nbytes=sum(sum(layout.sizes()) for layout in layouts),
        buckets=n,
        seconds=time.perf_counter() - start,
        wait_pack_s=wait_pack,
        wait_reply_s=wait_reply,
    )
