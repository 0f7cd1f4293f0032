"""Errors raised by the sender; each names the engine and the operation it was waiting for.

The class says what the sender does next, and it is chosen from structured data, never from message
text: :func:`check_reply` raises :class:`EngineUnavailableError` for a reply whose ``group_lost`` is set
(the engine's side of the group is gone: the sender disconnects) and :class:`EngineRejectedError` for any
other failure (the group stays usable). Every class pickles with its fields, so an error raised in a Ray
actor or another process reaches the caller as itself.
"""

from __future__ import annotations

from typing import Any

from ppo_weight_sync.ops import EngineReply

__all__ = [
    "EngineRejectedError",
    "EngineTimeoutError",
    "EngineUnavailableError",
    "NonFiniteTensorsError",
    "WeightSyncError",
    "check_reply",
]


class WeightSyncError(RuntimeError):
    """Base class for weight-sync failures."""


class EngineUnavailableError(WeightSyncError):
    """The engine died, is unreachable, or its side of the group failed; the sender is left disconnected."""

    def __init__(self, engine: str, op: str, detail: str) -> None:
        self.engine, self.op, self.detail = engine, op, detail
        super().__init__(f"engine {engine!r}: {op} failed: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # The default rebuilds from self.args (the formatted message), which does not fit __init__.
        return (type(self), (self.engine, self.op, self.detail), {"args": self.args})


class EngineTimeoutError(EngineUnavailableError):
    """The engine did not answer ``op`` within the timeout."""

    def __init__(self, engine: str, op: str, timeout_s: float) -> None:
        super().__init__(engine, op, f"no answer within {timeout_s:g} s")
        self.timeout_s = timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.engine, self.op, self.timeout_s), {"args": self.args})


class EngineRejectedError(WeightSyncError):
    """The engine answered ``success: false`` (e.g. a tensor it does not hold); the group stays usable."""

    def __init__(self, engine: str, op: str, message: str) -> None:
        self.engine, self.op, self.message = engine, op, message
        super().__init__(f"engine {engine!r} rejected {op}: {message}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.engine, self.op, self.message), {"args": self.args})


class NonFiniteTensorsError(WeightSyncError):
    """Tensors handed to ``update`` hold NaN or infinite values; nothing was sent to any engine."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        shown = ", ".join(self.names[:5]) + (
            f" and {len(self.names) - 5} more" if len(self.names) > 5 else ""
        )
        super().__init__(
            f"{len(self.names)} tensor(s) hold NaN or infinite values ({shown}); nothing was sent to the "
            "engines, which keep their previous weights"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.names,), {"args": self.args})


def check_reply(engine: str, op: str, reply: EngineReply) -> EngineReply:
    """``reply`` when it succeeded; else the error its structured fields call for, naming ``engine``."""
    if reply.success:
        return reply
    if reply.group_lost:
        # The engine dropped its side of the group (the data did not arrive): not a refusal that leaves
        # the group usable, so the update fails as unavailable and the sender disconnects.
        raise EngineUnavailableError(engine, op, reply.message)
    raise EngineRejectedError(engine, op, reply.message)
