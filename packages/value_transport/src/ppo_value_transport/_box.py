"""The Box: an object reference that Ray passes along without fetching it."""

from __future__ import annotations

from dataclasses import dataclass

from ray import ObjectRef


@dataclass(frozen=True, slots=True)
class Box:
    """An ``ObjectRef`` in a wrapper, so that whoever receives it chooses when to fetch the payload.

    Why a wrapper: Ray resolves an ``ObjectRef`` passed as a *top-level* argument of a remote call
    (the callee receives the value, fetched before the call starts) but leaves refs *nested* inside
    other objects alone (the callee receives the ref). Relying on that difference by accident is
    fragile: a payload meant for a later consumer (critic values travelling through the driver or
    a trainer group to the actor ranks) would be fetched, copied and held by every intermediate
    actor it passes through as a top-level argument. A ``Box`` is always nested, so it is never
    resolved on the way; only :func:`ppo_value_transport.unpack` (or ``ray.get(box.ref)``) fetches it.

    ``nbytes`` is the size of the packed buffer, for logs and metrics (``-1`` when unknown).
    """

    ref: ObjectRef
    nbytes: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.ref, ObjectRef):
            raise ValueError(
                f"Box.ref must be a ray.ObjectRef, got {type(self.ref).__name__}; "
                "build a Box with ppo_value_transport.pack(...) or Box(ray.put(payload))"
            )
