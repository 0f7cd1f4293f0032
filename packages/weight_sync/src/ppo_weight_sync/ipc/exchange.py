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

import torch
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
        try:
            return _gather_texts(text, group)
        except Exception as exc:  # gloo raises RuntimeError subclasses (DistBackendError) on a lost peer
            ranks = dist.get_process_group_ranks(group)
            raise ExchangeError(
                f"waiting for {what} from trainer ranks {ranks} (timeout {self.timeout_s:g} s) failed: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None


def _gather_texts(text: str, group: dist.ProcessGroup) -> list[str]:
    """Every rank's UTF-8 ``text``, as two tensor all-gathers (lengths, then padded bytes).

    Not ``all_gather_object``: it pickles through numpy in recent torch builds, and this package does not
    depend on numpy (an environment without it fails there with "Numpy is not available")."""
    data = text.encode()
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [bytes(t[: int(n.item())].tolist()).decode() for t, n in zip(gathered, lengths, strict=True)]
