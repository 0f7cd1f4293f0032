"""Which trainer rank sends the weights to which engine, and how: one plan for data-parallel actors.

Every rank of a data-parallel actor holds the full weights at update time (replicated, or gathered from
FSDP shards on every rank), so each rank can serve the engines on its own GPU over CUDA IPC, as slime does
when it gathers handles per engine. The rules (:func:`plan_senders`):

- an engine of one GPU that is some rank's GPU gets the weights from that rank over CUDA IPC;
- an engine of several GPUs (tensor parallel, TP *T*) whose every GPU is a different rank's GPU gets them
  over CUDA IPC from all of those ranks at once: the rank on its TP-rank-*i* GPU packs its own copy into
  its own buffers and exports them for TP rank *i* (``exports``); the rank on its TP-rank-0 GPU (the
  *lead*) posts the engine's one request per bucket, with one entry per TP rank (SGLang's
  ``serialized_named_tensors[i]`` is TP rank *i*'s), after the other ranks' exports were handed to it
  (:mod:`ppo_weight_sync.ipc.tp`). A rank that exports for another rank's engine does nothing else (its
  update is that export), and rank 0 never exports for another rank (it may own the group); a TP engine
  that would need either goes to the group;
- every other engine (on a GPU no rank trains on, partly on trainer GPUs and partly elsewhere, or with
  two TP ranks on one GPU) gets them from rank 0 over the weight group (NCCL between GPUs, gloo on CPU
  and for an engine that shares a GPU with a trainer rank: NCCL refuses two ranks on one device);
- a rank with none of these sends nothing (it still gathers, when sharded: the gather is collective).

Devices are opaque hashable identities (a placement bundle, or a ``(node, GPU id)`` pair): equal means
the same GPU. Pure Python: the driver plans from its placement, and a test can plan from the GPU ids Ray
hands real actors.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

__all__ = ["RankSends", "SenderPlan", "TpIpc", "plan_senders"]


@dataclass(frozen=True)
class RankSends:
    """What one trainer rank sends, by engine index: ``ipc``, the engines whose requests it posts over
    CUDA IPC (on its GPU; for a TP engine, it is the lead); ``group``, the engines it sends over the
    weight group (rank 0 only); ``exports``, ``(engine, tp_rank)`` pairs: it packs the weights into its
    own buffers for that TP rank (above 0) of an engine another rank posts."""

    rank: int
    ipc: tuple[int, ...]
    group: tuple[int, ...]
    exports: tuple[tuple[int, int], ...] = ()

    @property
    def sends(self) -> bool:
        return bool(self.ipc or self.group or self.exports)


@dataclass(frozen=True)
class TpIpc:
    """A colocated engine of several GPUs served over CUDA IPC: ``ranks[i]`` is the trainer rank on its
    TP rank *i*'s GPU (``ranks[0]``, the lead, posts its requests)."""

    engine: int
    ranks: tuple[int, ...]

    @property
    def lead(self) -> int:
        return self.ranks[0]

    def to_wire(self) -> tuple[int, ...]:
        """``(engine, rank of TP rank 0, rank of TP rank 1, ...)``: how ``TrainerConfig`` carries it."""
        return (self.engine, *self.ranks)

    @classmethod
    def from_wire(cls, wire: Sequence[int]) -> TpIpc:
        if len(wire) < 3:
            raise ValueError(
                f"a colocated TP engine is (engine, rank of TP rank 0, rank of TP rank 1, ...), got "
                f"{tuple(wire)}: at least two TP ranks"
            )
        return cls(engine=int(wire[0]), ranks=tuple(int(r) for r in wire[1:]))


@dataclass(frozen=True)
class SenderPlan:
    """One :class:`RankSends` per trainer rank; every engine appears exactly once (in one rank's ``ipc``
    or in rank 0's ``group``); ``tp``: the colocated engines of several GPUs, by engine index."""

    ranks: tuple[RankSends, ...]
    tp: tuple[TpIpc, ...] = ()

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
        self._check_tp()

    def _check_tp(self) -> None:
        world = len(self.ranks)
        by_engine: dict[int, TpIpc] = {}
        for tp in self.tp:
            where = f"SenderPlan: TP engine {tp.engine} (ranks {list(tp.ranks)})"
            if tp.engine in by_engine:
                raise ValueError(f"{where} is listed twice")
            by_engine[tp.engine] = tp
            if len(tp.ranks) < 2 or len(set(tp.ranks)) != len(tp.ranks):
                raise ValueError(f"{where}: list one distinct trainer rank per TP rank, at least two")
            wrong = [r for r in tp.ranks if not 0 <= r < world]
            if wrong:
                raise ValueError(f"{where} names rank(s) {wrong}; the world has {world} ranks")
            if tp.engine not in self.ranks[tp.lead].ipc:
                raise ValueError(
                    f"{where}: its lead, rank {tp.lead} (TP rank 0's GPU), must post it (list it in that "
                    "rank's ipc)"
                )
            if 0 in tp.ranks[1:]:
                raise ValueError(
                    f"{where}: rank 0 never exports for another rank's engine (it owns the group)"
                )
            for i, r in enumerate(tp.ranks[1:], start=1):
                if (tp.engine, i) not in self.ranks[r].exports:
                    raise ValueError(
                        f"{where}: rank {r} must export for TP rank {i} (list it in its exports)"
                    )
        for sends in self.ranks:
            for engine, tp_rank in sends.exports:
                given = by_engine.get(engine)
                if given is None or not 1 <= tp_rank < len(given.ranks) or given.ranks[tp_rank] != sends.rank:
                    raise ValueError(
                        f"SenderPlan: rank {sends.rank} exports for engine {engine}'s TP rank {tp_rank}, "
                        "which no TP engine of the plan gives it"
                    )
            if sends.exports and (len(sends.exports) > 1 or sends.ipc or sends.group):
                raise ValueError(
                    f"SenderPlan: rank {sends.rank} exports for {list(sends.exports)} and also sends "
                    f"ipc={list(sends.ipc)} group={list(sends.group)}; a rank that exports for another "
                    "rank's engine does nothing else"
                )

    @classmethod
    def from_ipc(
        cls,
        ipc_by_rank: Sequence[Sequence[int]],
        num_engines: int,
        world_size: int,
        tp: Sequence[Sequence[int]] = (),
    ) -> SenderPlan:
        """The plan of ``ipc_by_rank`` (rank r's CUDA IPC engines, by index; missing ranks: none) and
        ``tp`` (each colocated TP engine as :meth:`TpIpc.to_wire`: ``(engine, rank of TP rank 0, ...)``);
        every engine no rank serves over IPC goes to rank 0's group. ValueError naming a bad index."""
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
        tps = tuple(sorted((TpIpc.from_wire(w) for w in tp), key=lambda t: t.engine))
        for t in tps:
            if not 0 <= t.engine < num_engines:
                raise ValueError(f"tp names engine {t.engine}, but there are {num_engines} engines")
        exports: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
        for t in tps:
            for i, r in enumerate(t.ranks[1:], start=1):
                if 0 <= r < world_size:
                    exports[r].append((t.engine, i))
        on_ipc = {i for engines in ipc_by_rank for i in engines}
        group = tuple(i for i in range(num_engines) if i not in on_ipc)
        ranks = tuple(
            RankSends(
                rank=r,
                ipc=tuple(ipc_by_rank[r]) if r < len(ipc_by_rank) else (),
                group=group if r == 0 else (),
                exports=tuple(exports[r]),
            )
            for r in range(world_size)
        )
        return cls(ranks, tps)

    def for_rank(self, rank: int) -> RankSends:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} is not in the plan's {len(self.ranks)} ranks")
        return self.ranks[rank]

    def tp_engine(self, engine: int) -> TpIpc | None:
        """Engine ``engine``'s TP ranks' trainer ranks, when it is a colocated TP engine."""
        return next((t for t in self.tp if t.engine == engine), None)

    @property
    def ipc_by_rank(self) -> tuple[tuple[int, ...], ...]:
        """Rank r's CUDA IPC engines at index r, trailing ranks without any left out."""
        out = [s.ipc for s in self.ranks]
        while out and not out[-1]:
            out.pop()
        return tuple(out)

    @property
    def tp_wire(self) -> tuple[tuple[int, ...], ...]:
        """:attr:`tp` as plain tuples (:meth:`TpIpc.to_wire`), e.g. for ``TrainerConfig``."""
        return tuple(t.to_wire() for t in self.tp)

    def describe(self, group_backend: str = "the group") -> list[str]:
        """One line per rank that sends, e.g. ``rank 1: engine 1 over CUDA IPC``,
        ``rank 0: engine 0 over CUDA IPC (posts TP ranks 0-1: ranks 0, 1)``,
        ``rank 1: exports for engine 0's TP rank 1 over CUDA IPC (rank 0 posts)``."""
        lines = []
        for s in self.ranks:
            parts = []
            for i in s.ipc:
                tp = self.tp_engine(i)
                if tp is None:
                    parts.append(f"engine {i} over CUDA IPC")
                else:
                    ranks = ", ".join(str(r) for r in tp.ranks)
                    parts.append(
                        f"engine {i} over CUDA IPC (posts TP ranks 0-{len(tp.ranks) - 1}: ranks {ranks})"
                    )
            parts += [f"engine {i} over {group_backend}" for i in s.group]
            for engine, tp_rank in s.exports:
                lead = self.tp_engine(engine)
                parts.append(
                    f"exports for engine {engine}'s TP rank {tp_rank} over CUDA IPC "
                    f"(rank {lead.lead if lead else '?'} posts)"
                )
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
    engine i's GPUs (entry ``j`` is TP rank ``j``'s). ``ipc=False`` (CPU, or no CUDA IPC wanted): every
    engine goes to rank 0's group. Two ranks on one device is a ValueError (each rank has its own GPU).

    Engines of one GPU are planned first; then each engine of several GPUs in index order goes over CUDA
    IPC when every GPU of it is a different rank's, its lead (TP rank 0's rank) exports for no one, and
    every other rank of it is not rank 0 and sends nothing yet; else it goes to the group."""
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
    for i, devices in enumerate(engine_devices):
        if not devices:
            raise ValueError(f"engine_devices[{i}] is empty: an engine runs on at least one device")
    ipc_by_rank: list[list[int]] = [[] for _ in rank_devices]
    tp: list[tuple[int, ...]] = []
    if ipc:
        for i, devices in enumerate(engine_devices):
            if len(devices) == 1 and devices[0] in owner:
                ipc_by_rank[owner[devices[0]]].append(i)
        exporting: set[int] = set()
        for i, devices in enumerate(engine_devices):
            if len(devices) < 2 or len(set(devices)) != len(devices):
                continue
            if not all(d in owner for d in devices):
                continue  # partly elsewhere: the group
            ranks = [owner[d] for d in devices]
            lead, others = ranks[0], ranks[1:]
            if lead in exporting or any(r == 0 or r in exporting or ipc_by_rank[r] for r in others):
                continue
            ipc_by_rank[lead].append(i)
            exporting.update(others)
            tp.append((i, *ranks))
    return SenderPlan.from_ipc(ipc_by_rank, len(engine_devices), len(rank_devices), tp)
