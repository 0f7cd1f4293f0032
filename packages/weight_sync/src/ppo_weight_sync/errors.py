"""Errors raised by the sender; each names the engine and the operation it was waiting for."""

from __future__ import annotations

__all__ = [
    "RECEIVE_FAILED",
    "EngineRejectedError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "WeightSyncError",
]

# How a WeightReceiver's failure reply starts when the data did not arrive (a peer died, a broadcast
# timed out): unlike a rejection, its side of the group is gone, so the sender must disconnect too.
RECEIVE_FAILED = "Failed to receive weights over"


class WeightSyncError(RuntimeError):
    """Base class for weight-sync failures."""


class EngineUnavailableError(WeightSyncError):
    """The engine died, is unreachable, or its side of the group failed; the sender is left disconnected."""

    def __init__(self, engine: str, op: str, detail: str) -> None:
        self.engine, self.op = engine, op
        super().__init__(f"engine {engine!r}: {op} failed: {detail}")


class EngineTimeoutError(EngineUnavailableError):
    """The engine did not answer ``op`` within the timeout."""

    def __init__(self, engine: str, op: str, timeout_s: float) -> None:
        super().__init__(engine, op, f"no answer within {timeout_s:g} s")
        self.timeout_s = timeout_s


class EngineRejectedError(WeightSyncError):
    """The engine answered ``success: false`` (e.g. a tensor it does not hold); the group stays usable."""

    def __init__(self, engine: str, op: str, message: str) -> None:
        self.engine, self.op, self.message = engine, op, message
        super().__init__(f"engine {engine!r} rejected {op}: {message}")
