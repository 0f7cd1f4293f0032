"""Bucket layouts for colocated (CUDA IPC) updates: which tensors a bucket holds and at which byte offsets.

A bucket is one flat ``uint8`` GPU buffer holding several tensors back to back, each starting at a
multiple of :data:`ALIGN` bytes (so every dtype can be viewed in place and copies run on aligned rows).
The layout is all a receiver needs besides the mapped buffer; it travels as JSON (:meth:`to_wire`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppo_weight_sync.buckets import dtype_from_name, dtype_name

__all__ = ["ALIGN", "BucketLayout", "plan_layouts"]

# 256 bytes: the CUDA allocator's own alignment, and a multiple of every dtype's size.
ALIGN = 256


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: tensor ``i`` is ``names[i]`` of ``dtypes[i]`` and ``shapes[i]`` at byte ``offsets[i]``.

    ``nbytes`` is the used length of the buffer (the end of the last tensor).
    """

    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.names)
        if not n:
            raise ValueError("BucketLayout.names: a bucket holds at least one tensor")
        if not len(self.dtypes) == len(self.shapes) == len(self.offsets) == n:
            raise ValueError(
                "BucketLayout: names, dtypes, shapes and offsets need one entry per tensor, got "
                f"{n}, {len(self.dtypes)}, {len(self.shapes)}, {len(self.offsets)}"
            )
        end = 0
        for name, dtype, shape, offset in zip(
            self.names, self.dtypes, self.shapes, self.offsets, strict=True
        ):
            if any(d < 0 for d in shape):
                raise ValueError(f"BucketLayout.shapes[{name!r}]: negative dimension in {list(shape)}")
            if offset < end:
                raise ValueError(
                    f"BucketLayout.offsets[{name!r}]: {offset} overlaps the previous tensor (ends at {end})"
                )
            if offset % dtype.itemsize:
                raise ValueError(
                    f"BucketLayout.offsets[{name!r}]: {offset} is not a multiple of {dtype}'s size "
                    f"{dtype.itemsize}"
                )
            end = offset + math.prod(shape) * dtype.itemsize

    @property
    def nbytes(self) -> int:
        last = len(self.names) - 1
        return self.offsets[last] + math.prod(self.shapes[last]) * self.dtypes[last].itemsize

    def sizes(self) -> list[int]:
        return [math.prod(s) * d.itemsize for s, d in zip(self.shapes, self.dtypes, strict=True)]

    def views(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into ``buffer`` (uint8, at least ``nbytes`` long); no copy."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1:
            raise ValueError(
                f"buffer must be a 1-D uint8 tensor, got {buffer.dtype} of shape {list(buffer.shape)}"
            )
        if buffer.numel() < self.nbytes:
            raise ValueError(f"buffer holds {buffer.numel()} bytes, the bucket needs {self.nbytes}")
        out = []
        for name, dtype, shape, offset, size in zip(
            self.names, self.dtypes, self.shapes, self.offsets, self.sizes(), strict=True
        ):
            out.append((name, buffer[offset : offset + size].view(dtype).view(shape)))
        return out

    def to_wire(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "dtypes": [dtype_name(d) for d in self.dtypes],
            "shapes": [list(s) for s in self.shapes],
            "offsets": list(self.offsets),
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> BucketLayout:
        missing = [k for k in ("names", "dtypes", "shapes", "offsets") if k not in wire]
        if missing:
            raise ValueError(
                f"bucket layout: missing field(s) {missing}; expected names, dtypes, shapes, offsets"
            )
        try:
            return cls(
                names=tuple(str(n) for n in wire["names"]),
                dtypes=tuple(dtype_from_name(str(d)) for d in wire["dtypes"]),
                shapes=tuple(tuple(int(x) for x in s) for s in wire["shapes"]),
                offsets=tuple(int(o) for o in wire["offsets"]),
            )
        except TypeError as exc:
            raise ValueError(f"bucket layout: malformed field ({exc})") from exc


def plan_layouts(
    metas: Sequence[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int
) -> list[BucketLayout]:
    """Split tensors, in order, into buckets of at most ``bucket_bytes`` (aligned offsets included).

    A tensor bigger than ``bucket_bytes`` gets a bucket of its own (the buffers are sized to the biggest
    bucket, so such a tensor raises the buffer size; tensors are never split).
    """
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    layouts: list[BucketLayout] = []
    current: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
    end = 0
    for name, dtype, shape in metas:
        size = math.prod(shape) * dtype.itemsize
        offset = _align(end)
        if current and offset + size > bucket_bytes:
            layouts.append(_layout(current))
            current, offset = [], 0
        current.append((name, dtype, tuple(int(s) for s in shape), offset))
        end = offset + size
    if current:
        layouts.append(_layout(current))
    return layouts


def _layout(entries: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> BucketLayout:
    return BucketLayout(
        names=tuple(e[0] for e in entries),
        dtypes=tuple(e[1] for e in entries),
        shapes=tuple(e[2] for e in entries),
        offsets=tuple(e[3] for e in entries),
    )
