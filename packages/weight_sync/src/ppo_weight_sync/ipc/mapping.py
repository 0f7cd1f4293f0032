"""Engine side of a colocated update: map the sender's buffers once, copy buckets out, release.

:class:`IpcMappings` keeps one mapping per exported buffer (keyed by :attr:`IpcHandle.key`) per
session, so a bucket message that names a buffer already mapped costs no ``cudaIpcOpenMemHandle``.
:meth:`IpcMappings.release` drops a session's mappings; the sender's memory can only return after that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.ipc.handles import IpcHandle, open_handle
from ppo_weight_sync.ipc.layout import BucketLayout

__all__ = ["IpcMappings", "load_bucket"]

# A bucket's copies take 0.1-0.5 ms on an H200: poll at 20 us, or the wait itself is most of a bucket's time.
IPC_POLL_S = 0.00002

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class IpcMappings:
    """Mapped sender buffers, per session (one session per sender connection)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[str, dict[tuple[bytes, int], torch.Tensor]] = {}

    def buffer(self, session: str, handle: IpcHandle) -> torch.Tensor:
        with self._lock:
            mapped = self._maps.setdefault(session, {}).get(handle.key)
        if mapped is None:
            mapped = open_handle(handle)
            with self._lock:
                self._maps.setdefault(session, {})[handle.key] = mapped
        return mapped

    def count(self, session: str | None = None) -> int:
        with self._lock:
            if session is not None:
                return len(self._maps.get(session, {}))
            return sum(len(m) for m in self._maps.values())

    def release(self, session: str) -> int:
        """Unmap ``session``'s buffers; returns how many. The caller has waited for its copies."""
        with self._lock:
            maps = self._maps.pop(session, {})
        n = len(maps)
        maps.clear()  # the last references: the storages die, the sender's counts drop
        return n

    def release_all(self) -> int:
        with self._lock:
            sessions = list(self._maps)
        return sum(self.release(s) for s in sessions)


def load_bucket(
    mappings: IpcMappings,
    session: str,
    handle: IpcHandle,
    layout: BucketLayout,
    load_weights: LoadWeights,
    device: torch.device,
    timeout_s: float,
) -> None:
    """Copy one bucket out of the sender's buffer through ``load_weights`` and wait (bounded) for the
    copies: when this returns, the buffer may be overwritten and the weights are in place."""
    with on_device(device):
        buffer = mappings.buffer(session, handle)
        if buffer.numel() < layout.nbytes:
            raise ValueError(
                f"bucket of {layout.nbytes} bytes does not fit the mapped buffer of {buffer.numel()} bytes"
            )
        load_weights(layout.views(buffer))
        wait_stream(
            device, timeout_s, "copying a weight bucket out of the sender's buffer", poll_s=IPC_POLL_S
        )
