"""One payload per rank: routing, dispatch to a group of Ray actors, and the missing-values check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError

from ppo_value_transport._box import Box
from ppo_value_transport._errors import MissingValuesError
from ppo_value_transport._pairing import Pieces

T = TypeVar("T")
V = TypeVar("V")


def route(payloads: Sequence[T], world_size: int) -> list[T]:
    """One payload per rank: ``len(payloads) == world_size`` as given, or one payload for every rank.

    Any other count is a ``ValueError`` that gives both numbers.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"route: world_size must be a positive int, got {world_size!r}")
    if isinstance(payloads, str | bytes) or not isinstance(payloads, Sequence):
        raise ValueError(
            "route: payloads must be a sequence (one per rank, or one for all), "
            f"got {type(payloads).__name__}"
        )
    if len(payloads) == 1:
        return [payloads[0]] * world_size
    if len(payloads) != world_size:
        raise ValueError(
            f"route: got {len(payloads)} payloads for world_size {world_size}; "
            f"pass exactly {world_size} (one per rank) or 1 (the same for every rank)"
        )
    return list(payloads)


def dispatch(
    actors: Sequence[ActorHandle], method: str, payloads: Sequence[Any], *args: Any, **kwargs: Any
) -> list[ObjectRef]:
    """Call ``actors[i].<method>.remote(payload_i, *args, **kwargs)`` for every rank ``i``.

    ``payloads`` is routed with :func:`route` (one per actor, or one for all). The payload is the
    first, top-level argument, so Ray resolves it when it is an ``ObjectRef`` (the actor receives
    the value) and passes a :class:`Box` through untouched (the actor fetches it with ``unpack``
    when, and only if, it needs it). Returns one ``ObjectRef`` per actor, in rank order.
    """
    if isinstance(actors, ActorHandle) or not isinstance(actors, Sequence) or not actors:
        raise ValueError("dispatch: actors must be a non-empty sequence of Ray actor handles, one per rank")
    routed = route(payloads, len(actors))
    refs: list[ObjectRef] = []
    for rank, (actor, payload) in enumerate(zip(actors, routed, strict=True)):
        try:
            remote_method = getattr(actor, method)
        except AttributeError as exc:
            raise ValueError(
                f"dispatch: actor of rank {rank} has no method {method!r}; check the method name"
            ) from exc
        refs.append(remote_method.remote(payload, *args, **kwargs))
    return refs


def gather(refs: Sequence[ObjectRef], timeout_s: float, what: str) -> list[Any]:
    """``ray.get(refs)`` with a timeout whose message names ``what`` and the ranks still pending."""
    refs = list(refs)
    unique = list(dict.fromkeys(refs))  # ray.wait refuses duplicates
    _ready, pending = ray.wait(unique, num_returns=len(unique), timeout=timeout_s)
    if pending:
        pending_set = set(pending)
        ranks = [rank for rank, ref in enumerate(refs) if ref in pending_set]
        raise TimeoutError(f"{what}: ranks {ranks} did not finish within {timeout_s:g} s")
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError as exc:  # pragma: no cover - ray.wait above already saw them ready
        raise TimeoutError(f"{what}: results not available within {timeout_s:g} s") from exc


def require_values(rank: int, values: V | None, role: str = "actor") -> V:
    """The values of ``rank``, or a :class:`MissingValuesError` that names the rank and role.

    A consumer that needs critic values and received none must fail loudly: training the actor
    without its values (or with another rank's) would be silently wrong.
    """
    if values is None:
        raise MissingValuesError(
            f"{role} rank {rank} needs critic values but received none; the critic must return a "
            "values Box for each of its ranks, and ppo_value_transport.pair_values maps them to the "
            "actor's ranks"
        )
    # Pieces: the values of this rank's samples from the critic ranks (pair_values); a Box: one payload.
    if not isinstance(values, Box | Pieces):
        raise MissingValuesError(
            f"{role} rank {rank} received {type(values).__name__} where a values Box or Pieces was expected"
        )
    return values
