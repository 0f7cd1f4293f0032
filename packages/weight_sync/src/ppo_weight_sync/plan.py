"""Which trainer rank sends the weights to which engine, and how: one plan for data-parallel actors.

Every rank of a data-parallel actor holds the full weights at update time (replicated, or gathered from
FSDP shards on every rank), so each rank can serve the engines on its own GPU over CUDA IPC, as slime does
when it gathers handles per engine. The rules (:func:`plan_senders`):

- an engine of one GPU that is some rank's GPU gets the weights from that rank over CUDA IPC;
- every other engine (on a GPU no rank trains on, or of several GPUs) gets them from rank 0 over the
  weight group (NCCL between GPUs, gloo on CPU);
- a rank with neither sends nothing (it still gathers, when sharded: the gather is collective).

Devices are opaque hashable identities (a placement bundle, or a ``(node, GPU id)`` pair): equal means
the same GPU. Pure Python: the driver plans from its placement, and a test can plan from the GPU ids Ray
hands real actors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["RankSends", "SenderPlan", "plan_senders"]


@dataclass(frozen=True)
class RankSends:
    """What one trainer rank sends: engine indices over CUDA IPC (on its GPU) and over the group."""

    rank: int
    ipc: tuple[int, ...]
    group: tuple[int, ...]

    @property
    def sends(self) -> bool:
        return bool(self.ipc or self.group)


@dataclass(frozen=True)
class SenderPlan:
    """One :class:`RankSends` per trainer rank; every engine appears exactly once."""

    ranks: tuple[RankSends, ...]

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("SenderPlan: ranks is empty; a plan covers at least rank 0")
        for r, sends in enumerate(self.ranks):
            if sends.rank != r:
                raise ValueError(f"SenderPlan: ranks[{r}] is rank {sends.rank}; list the ranks in order")
            if r != 0 and sends.group:
                raise ValueError(
                    f"SenderPlan: rank {r} has group engines {list(sends.group)}; only rank 0 owns the group"
                )
        seen: dict[int, int] = {}
        for sends in self.ranks:
            for engine in (*sends.ipc, *sends.group):
                if engine in seen:
                    raise ValueError(
                        f"SenderPlan: engine {engine} is sent by rank {seen[engine]} and rank {sends.rank}; "
                        "each engine has one sender"
                    )
                seen[engine] = sends.rank

    @classmethod
    def from_ipc(cls, ipc_by_rank: Sequence[Sequence[int]], num_engines: int, world_size: int) -> SenderPlan:
        """The plan of ``ipc_by_rank`` (rank r's CUDA IPC engines, by index; missing ranks: none); every
        engine no rank serves over IPC goes to rank 0's group. ValueError naming a bad index."""
        if len(ipc_by_rank) > world_size:
            raise ValueError(
                f"ipc_by_rank lists {len(ipc_by_rank)} ranks for a world of {world_size}; one entry per rank"
            )
        for r, engines in enumerate(ipc_by_rank):
            wrong = [i for i in engines if not 0 <= i < num_engines]
            if wrong:
                raise ValueError(
                    f"ipc_by_rank[{r}] names engine(s) {wrong}, but there are {num_engines} engines "
                    f"(indices 0..{num_engines - 1})"
                )
        on_ipc = {i for engines in ipc_by_rank for i in engines}
        group = tuple(i for i in range(num_engines) if i not in on_ipc)
        ranks = tuple(
            RankSends(
                rank=r,
                ipc=tuple(ipc_by_rank[r]) if r < len(ipc_by_rank) else (),
                group=group if r == 0 else (),
            )
            for r in range(world_size)
        )
        return cls(ranks)

    def for_rank(self, rank: int) -> RankSends:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} is not in the plan's {len(self.ranks)} ranks")
        return self.ranks[rank]

    @property
    def ipc_by_rank(self) -> tuple[tuple[int, ...], ...]:
        """Rank r's CUDA IPC engines at index r, trailing ranks without any left out."""
        out = [s.ipc for s in self.ranks]
        while out and not out[-1]:
            out.pop()
        return tuple(out)

    def describe(self, group_backend: str = "the group") -> list[str]:
        """One line per rank that sends, e.g. ``rank 1: engine 1 over CUDA IPC``."""
        lines = []
        for s in self.ranks:
            parts = [f"engine {i} over CUDA IPC" for i in s.ipc]
            parts += [f"engine {i} over {group_backend}" for i in s.group]
            if parts:
                lines.append(f"rank {s.rank}: " + ", ".join(parts))
        return lines


def plan_senders(
    rank_devices: Sequence[Hashable],
    engine_devices: Sequence[Sequence[Hashable]],
    *,
    ipc: bool = True,
) -> SenderPlan:
    """Which rank sends to which engine. ``rank_devices[r]``: trainer rank r's GPU; ``engine_devices[i]``:
    engine i's GPUs (one per TP rank). ``ipc=False`` (CPU, or no CUDA IPC wanted): every engine goes to
    rank 0's group. Two ranks on one device is a ValueError (each rank has its own GPU)."""
    if not rank_devices:
        raise ValueError("rank_devices is empty: pass one device per trainer rank")
    owner: dict[Hashable, int] = {}
    for r, device in enumerate(rank_devices):
        if device in owner:
            raise ValueError(
                f"trainer ranks {owner[device]} and {r} are both on device {device!r}; "
                "each rank needs its own GPU"
            )
        owner[device] = r
    ipc_by_rank: list[list[int]] = [[] for _ in rank_devices]
    for i, devices in enumerate(engine_devices):
        if not devices:
            raise ValueError(f"engine_devices[{i}] is empty: an engine runs on at least one device")
        if ipc and len(devices) == 1 and devices[0] in owner:
            ipc_by_rank[owner[devices[0]]].append(i)
    return SenderPlan.from_ipc(ipc_by_rank, len(engine_devices), len(rank_devices))
