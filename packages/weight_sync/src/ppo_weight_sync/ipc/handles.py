"""CUDA IPC handles of GPU buffers: export on the sending process, map in a process on the same GPU.

An :class:`IpcHandle` is what torch's ``UntypedStorage._share_cuda_()`` returns (the allocation's
``cudaIpcMemHandle``, the buffer's offset in it, and torch's producer-side reference counter), with the
device named by its UUID: two processes on one GPU often number it differently (``CUDA_VISIBLE_DEVICES``
per Ray actor), as SGLang's ``patch_torch._device_to_uuid`` also handles (0.5.15.post1 and 0.5.23,
``srt/utils/patch_torch.py``).

Reference counting, which decides when the sender's memory really goes back: every ``_share_cuda_()``
adds one count in the sender's shared-memory counter file; the mapping process takes it over when it
opens the handle and drops it when its storage dies. So one export serves exactly one consumer's one
mapping: the sender exports each buffer once per consumer and the consumer keeps its mapping (and so
the count) until it is told to release; then the sender's ``torch.cuda.ipc_collect()`` frees the blocks.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["IpcHandle", "device_index", "device_uuid", "export_buffer", "open_handle"]


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; ValueError when it does not see that GPU."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ValueError(
        f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES={_visible()}): a colocated "
        "update needs the engine on the sending rank's GPU"
    )


def _visible() -> str:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(field: str, value: Any) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as exc:
        raise ValueError(f"IpcHandle.{field}: not base64 ({exc})") from exc


@dataclass(frozen=True)
class IpcHandle:
    """A GPU buffer shared with another process of the same GPU (see the module docstring)."""

    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @property
    def key(self) -> tuple[bytes, int]:
        """Identifies the mapped memory: the same buffer exported twice has the same key."""
        return (self.handle, self.storage_offset_bytes)

    def to_wire(self) -> dict[str, Any]:
        return {
            "device_uuid": self.device_uuid,
            "handle": _b64(self.handle),
            "storage_size_bytes": self.storage_size_bytes,
            "storage_offset_bytes": self.storage_offset_bytes,
            "ref_counter_handle": _b64(self.ref_counter_handle),
            "ref_counter_offset": self.ref_counter_offset,
            "event_handle": _b64(self.event_handle),
            "event_sync_required": self.event_sync_required,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> IpcHandle:
        fields = (
            "device_uuid",
            "handle",
            "storage_size_bytes",
            "storage_offset_bytes",
            "ref_counter_handle",
            "ref_counter_offset",
            "event_handle",
            "event_sync_required",
        )
        missing = [f for f in fields if f not in wire]
        if missing:
            raise ValueError(f"IpcHandle: missing field(s) {missing}")
        return cls(
            device_uuid=str(wire["device_uuid"]),
            handle=_unb64("handle", wire["handle"]),
            storage_size_bytes=int(wire["storage_size_bytes"]),
            storage_offset_bytes=int(wire["storage_offset_bytes"]),
            ref_counter_handle=_unb64("ref_counter_handle", wire["ref_counter_handle"]),
            ref_counter_offset=int(wire["ref_counter_offset"]),
            event_handle=_unb64("event_handle", wire["event_handle"]),
            event_sync_required=bool(wire["event_sync_required"]),
        )


def export_buffer(buffer: torch.Tensor) -> IpcHandle:
    """Export a whole CUDA buffer (its storage, from its first byte) for one consumer's one mapping."""
    if buffer.device.type != "cuda":
        raise ValueError(f"export_buffer: the buffer is on {buffer.device}; CUDA IPC shares GPU memory only")
    if buffer.storage_offset() != 0:
        raise ValueError("export_buffer: pass the buffer itself, not a view into it (storage_offset != 0)")
    (
        device,
        handle,
        size,
        offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = buffer.untyped_storage()._share_cuda_()
    return IpcHandle(
        device_uuid=device_uuid(int(device)),
        handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync_required),
    )


def open_handle(handle: IpcHandle) -> torch.Tensor:
    """Map ``handle`` in this process: a 1-D uint8 tensor over the sender's buffer. The mapping (and the
    sender's count) lives as long as the returned tensor and every view of it."""
    index = device_index(handle.device_uuid)
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        handle.handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)
