"""The transport protocol: how one update's bytes reach a set of engines.

A connection gives every engine one transport. The group-based transports (one module per wire format:
:mod:`.stream`, :mod:`.flattened`, :mod:`.per_tensor`) broadcast over the connection's
:class:`~ppo_weight_sync.group.WeightGroup`; a colocated transport (CUDA IPC, for engines on the sending
rank's GPU) slots in beside them through a :class:`TransportFactory` given to the sender, which claims
the engines it serves before the rest join the group. The sender drives every transport the same way,
inside one pause / flush / continue sequence, under one lock, version and timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ppo_weight_sync.endpoints import EngineEndpoint

__all__ = ["Sent", "Transport", "TransportFactory"]


@dataclass(frozen=True)
class Sent:
    """What one ``send`` moved: bytes and buckets (for the sender's metrics)."""

    nbytes: int
    buckets: int


class Transport(Protocol):
    """Moves one update to ``engines`` and returns once every engine answered that it loaded it.

    ``send`` raises :class:`~ppo_weight_sync.errors.EngineRejectedError` for a refusal that leaves the
    transport usable, and any other exception when it is broken (the sender then resets the whole
    connection). ``version`` must be reported by an engine only once all of the update is loaded.
    ``close`` frees what the transport keeps between updates (staging buffers, mapped handles); it is
    idempotent and never raises, and a closed transport may be reused (it reallocates).
    ``prepare(items)`` is called before the engines are paused, with the very ``items`` the next
    ``send`` gets: it may start work that involves no engine (packing the first bucket on the GPU), so
    that work overlaps the pause and flush round trips; ``send`` does it itself when not prepared.
    """

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]: ...

    @property
    def load_format(self) -> str | None: ...

    def prepare(self, items: Sequence[tuple[str, torch.Tensor]]) -> None: ...

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent: ...

    def close(self) -> None: ...


class TransportFactory(Protocol):
    """Claims engines for a transport of its own (e.g. CUDA IPC for engines on this rank's GPU).

    ``serves(engine)`` is asked at every connect; the engines it claims do not join the weight group.
    ``open(engines, timeout_s)`` makes the transport for them (and may call the engines to set it up);
    it raises :class:`~ppo_weight_sync.errors.WeightSyncError` naming an engine that cannot be served.
    """

    def serves(self, engine: EngineEndpoint) -> bool: ...

    def open(self, engines: Sequence[EngineEndpoint], timeout_s: float) -> Transport: ...
