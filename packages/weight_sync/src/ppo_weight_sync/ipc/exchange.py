"""The small CPU channel between the trainer ranks of one colocated TP engine: an all-gather of short texts.

A colocated engine of TP *T* is fed by *T* trainer ranks (one per GPU of it, see
:mod:`ppo_weight_sync.plan`). They exchange what each needs once per connection (the lead's session and
wire format; each other rank's :class:`~ppo_weight_sync.ipc.tp.PeerBoard` path) over a gloo group of
just those ranks: a few hundred bytes, on the CPU, never per bucket (the buckets' handles then pass
through the boards in shared memory). :class:`GlooExchange` wraps any gloo ``ProcessGroup`` (the
trainer's is a subgroup of its role's group, rebuilt when the role wakes): pass the group, or a callable
that returns the live one. The wait is bounded by the group's own timeout; a failure says what was
waited for and from which ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch.distributed as dist

from ppo_weight_sync.errors import WeightSyncError

__all__ = ["ExchangeError", "GlooExchange", "RankExchange"]


class ExchangeError(WeightSyncError):
    """The trainer ranks of a colocated TP engine did not all answer an exchange (a rank died, never
    connected, or timed out)."""


class RankExchange(Protocol):
    """An all-gather of one text per rank among the trainer ranks of one colocated TP engine."""

    @property
    def size(self) -> int: ...

    def all_gather(self, text: str, what: str) -> list[str]:
        """Every rank's ``text`` (in group-rank order, which need not be TP order); raises
        :class:`ExchangeError` saying ``what`` was waited for when a rank does not take part in time."""
        ...


class GlooExchange:
    """:class:`RankExchange` over a gloo process group (``group``: the group, or a callable returning the
    live one); ``timeout_s``: the group's timeout, named in errors."""

    def __init__(self, group: dist.ProcessGroup | Callable[[], dist.ProcessGroup], timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._group = group
        self.timeout_s = timeout_s

    def _live(self) -> dist.ProcessGroup:
        group = self._group
        return group if isinstance(group, dist.ProcessGroup) else group()

    @property
    def size(self) -> int:
        return dist.get_world_size(self._live())

    def all_gather(self, text: str, what: str) -> list[str]:
        group = self._live()
        if dist.get_backend(group) != "gloo":
            raise ValueError(
                f"GlooExchange needs a gloo group (a small CPU channel), got {dist.get_backend(group)!r}"
            )
        out: list[object] = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(out, text, group=group)
        except Exception as exc:  # gloo raises RuntimeError subclasses (DistBackendError) on a lost peer
            ranks = dist.get_process_group_ranks(group)
            raise ExchangeError(
                f"waiting for {what} from trainer ranks {ranks} (timeout {self.timeout_s:g} s) failed: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        return [str(t) for t in out]
