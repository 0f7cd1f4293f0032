"""Bucket planning and the flattened-bucket byte layout, shared by sender and receiver.

The flattened layout is SGLang's ``FlattenedTensorBucket``: each tensor's bytes, in order, back to back,
in one ``uint8`` buffer. Both sides derive bucket boundaries from the same metadata with
:func:`plan_buckets`, so a whole update can be described by one metadata message.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "STREAM_FORMAT_PREFIX",
    "TensorMeta",
    "checksum",
    "dtype_from_name",
    "dtype_name",
    "pack_into",
    "plan_aligned_buckets",
    "plan_buckets",
    "stream_format",
    "unpack",
]

# load_format values. "flattened_bucket" is SGLang's own name (one flat buffer for the call's tensors);
# the stream format is ours: one call describes the whole update, sent as flat buffers of at most
# ``bucket_bytes`` each, so no request/reply round trip sits between buckets.
FLATTENED_BUCKET = "flattened_bucket"
STREAM_FORMAT_PREFIX = "ppo_flat_stream:"


def stream_format(bucket_bytes: int) -> str:
    return f"{STREAM_FORMAT_PREFIX}{int(bucket_bytes)}"


def parse_stream_format(load_format: str) -> int:
    try:
        value = int(load_format[len(STREAM_FORMAT_PREFIX) :])
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"load_format {load_format!r}: expected '{STREAM_FORMAT_PREFIX}<bucket bytes > 0>'")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in JSON: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def metas_from_request(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
) -> list[TensorMeta]:
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, {len(dtypes)}, "
            f"{len(shapes)}"
        )
    return [
        TensorMeta(n, dtype_from_name(d), tuple(int(s) for s in shape))
        for n, d, shape in zip(names, dtypes, shapes, strict=True)
    ]


def plan_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """Split tensors (by byte size, in order) into ``[start, end)`` runs of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own; tensors are never split.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[tuple[int, int]] = []
    start, filled = 0, 0
    for i, size in enumerate(sizes):
        if i > start and filled + size > bucket_bytes:
            buckets.append((start, i))
            start, filled = i, 0
        filled += size
    if start < len(sizes):
        buckets.append((start, len(sizes)))
    return buckets


def plan_aligned_buckets(
    sizes: Sequence[int], itemsizes: Sequence[int], bucket_bytes: int
) -> list[tuple[int, int]]:
    """:func:`plan_buckets`, plus a new bucket wherever a tensor would start at a byte offset its dtype
    cannot view. SGLang's ``FlattenedTensorBucket`` (the ``flattened_bucket`` load format) has no padding
    and views each tensor in place: 0.5.23 refuses an unaligned one ("Unaligned received tensor",
    ``sglang/srt/weight_sync/tensor_bucket.py``) and 0.5.15.post1 fails its ``view(dtype)``."""
    buckets: list[tuple[int, int]] = []
    for start, end in plan_buckets(sizes, bucket_bytes):
        offset, first = 0, start
        for i in range(start, end):
            if i > first and offset % itemsizes[i]:
                buckets.append((first, i))
                first, offset = i, 0
            offset += sizes[i]
        buckets.append((first, end))
    return buckets


def pack_into(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors``' bytes back to back into the front of ``buffer`` (uint8); returns the used part."""
    offset = 0
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
        offset += flat.numel()
    return buffer[:offset]


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into a flattened ``uint8`` buffer, one per tensor (no copy)."""
    out: list[tuple[str, torch.Tensor]] = []
    offset = 0
    for meta in metas:
        chunk = buffer[offset : offset + meta.nbytes]
        if (chunk.storage_offset() % meta.dtype.itemsize) != 0:
            # Mixed dtypes can leave a tensor at an offset its dtype cannot view: copy to fresh memory.
            chunk = chunk.clone()
        out.append((meta.name, chunk.view(meta.dtype).reshape(meta.shape)))
        offset += meta.nbytes
    return out


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes, without numpy (not a dependency).

    ``bytes(untyped_storage)`` builds the result one Python int at a time (about 5 us per byte: minutes
    for a real model), and ``.numpy()`` would mark the storage non-resizable, which breaks the memory
    backends that free storage in place; a ctypes array over the data pointer has neither problem.
    The caller keeps ``t`` alive while the view is in use.
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order; the same on every side and device."""
    h = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda item: item[0]):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()
