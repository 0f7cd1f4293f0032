"""A sharded (FSDP2) role's checkpoint written from the host copies of its sleep, without waking it.

While the role sleeps every rank holds host copies of its own shards: the local tensors of FSDP2's
``DTensor`` parameters and AdamW state (dim-0 chunks, ``torch.chunk`` sizes: uneven, possibly empty on
the last ranks) and whole copies of what is not sharded (Adam's ``step``). ``capture_shards`` notes
them in the main thread (no collective, no copy); the worker's writer thread then ``assemble``s rank 0's
whole tensors over the save group and writes the usual files (``torch_io.write_shard``).

Why rank 0 assembles, rather than every rank writing its shard files for the COMPLETE step to join:
the files stay those of every other save (``model.safetensors`` and ``optimizer.pt`` of whole tensors
in Hugging Face names), read by the same ``load_shard`` at any world size and either data parallelism,
and completing a checkpoint stays a rename in the driver; joining at COMPLETE would read and write the
whole state again on the loop's path (or need a second format that resume learns). The cost: rank 0
holds the role's whole state in host memory until written (as the foreground gather's ``cpu_offload``
does) and every shard crosses the network once, all of it in the writer threads. Not
``torch.distributed.checkpoint.async_save``: it writes a format of its own (per-rank ``.distcp`` files
and a metadata file), which resume would have to learn and a replicated role could not read as it
reads these, and it plans the save with collectives over the role's groups, which the sleep destroyed.

Why a gloo group of its own (``SaveGroup``): the role's groups are destroyed by every sleep, which is
exactly when these writers run, and the next step's collectives use them meanwhile. The save group is
built once at setup over the role's rendezvous store (which outlives its groups), under a prefix of its
own; it is not in ``torch.distributed``'s registry, so ``destroy_process_group`` leaves it alone; each of
its waits has its own timeout. One save at a time per worker uses it (the worker waits for the previous
writer before starting one), in the same order on every rank. A failed gather leaves the group's
message order unknown: the group refuses later saves (the run stops on the failed save anyway).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ppo_lifecycle.memory import HostCopies
from ppo_trainer.checkpoint import format as fmt
from ppo_trainer.checkpoint.protocol import TorchCheckpointable
from ppo_trainer.checkpoint.torch_io import ShardState, whole_state
from ppo_trainer.checkpoint.torch_optimizer import state_by_name
from ppo_weight_sync.net import local_address_toward

STORE_PREFIX = "ppo_trainer/sharded_save/"


class SaveGroup:
    """A gloo group over the role's ranks for the writer threads, bound to the address peers reach."""

    def __init__(self, store: dist.Store, rank: int, world_size: int, master: str, timeout_s: float) -> None:
        """Collective: every rank of the role builds it at setup (gloo connects its full mesh here).
        ``master``: the host rank 0's store listens on (its device binds there; the others' to the
        interface that reaches it)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        address = master if rank == 0 else local_address_toward(master)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        keys = dist.PrefixStore(STORE_PREFIX, store)
        # Any: torch's stubs lack the Backend collectives (allgather, gather) ProcessGroupGloo has.
        self._pg: Any = dist.ProcessGroupGloo(keys, rank, world_size, options)
        self._lock = threading.Lock()  # one save's collectives at a time (the worker's rule too)
        self._broken: str | None = None

    @contextmanager
    def session(self, what: str) -> Iterator[None]:
        """One save's collectives, alone on the group. Refused once a save failed midway: the ranks'
        messages may then be out of step, and a later save must not read a failed one's."""
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(
                    f"{what}: the save group of rank {self.rank} is unusable since an earlier save "
                    f"({self._broken}); restart the run"
                )
            yield

    def all_gather_rows(self, rows: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's int64 ``rows`` vector (same length on every rank), in rank order."""
        out = [torch.empty_like(rows) for _ in range(self.world_size)]
        self._wait(self._pg.allgather([out], [rows]), what)
        return out

    def send(self, tensor: torch.Tensor, what: str) -> None:
        """Send the contiguous ``tensor`` to rank 0 (which receives it with ``receive``)."""
        self._wait(self._pg.send([tensor], 0, 0), what)

    def receive(self, into: Sequence[tuple[int, torch.Tensor]], what: str) -> None:
        """Rank 0: each ``(rank, tensor)`` filled with what that rank sends, all in flight at once."""
        works = [self._pg.recv([tensor], rank, 0) for rank, tensor in into]
        for work in works:
            self._wait(work, what)

    def _wait(self, work: Any, what: str) -> None:
        try:
            if work.wait(self.timeout) is False:  # gloo raises on a timeout; a False would mean the same
                raise TimeoutError(f"not done after {self.timeout.total_seconds():.0f} s")
        except Exception as exc:
            self._broken = f"{what} failed: {exc}"
            raise RuntimeError(
                f"save group rank {self.rank}: {what} did not complete within "
                f"{self.timeout.total_seconds():.0f} s (a rank's writer failed or its process died): {exc}"
            ) from exc


@dataclass
class _Piece:
    """One tensor of the checkpoint as this rank holds it: its rows of a dim-0 sharded tensor of
    ``shape``, or the whole tensor."""

    local: torch.Tensor
    shape: tuple[int, ...]
    sharded: bool


@dataclass
class ShardedCapture:
    """One rank's host copies of a sharded role's checkpoint (``capture_shards``); ``assemble`` in
    the writer thread turns them into the usual ``ShardState`` (whole tensors on rank 0)."""

    trainer: TorchCheckpointable
    step: int | None
    group: SaveGroup
    rng: tuple[dict[str, torch.Tensor], dict[str, str]]
    model: dict[str, _Piece]  # state_dict order; a tied alias shares its source's piece
    optimizer: dict[str, Any]  # torch_optimizer.state_by_name layout, with _Piece for each tensor
    pieces: list[_Piece] = field(default_factory=list)  # each piece once, in the same order on every rank

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's model and optimizer tensors."""
        return sum(p.local.numel() * p.local.element_size() for p in self.pieces)

    def private_copy(self) -> ShardedCapture:
        """This capture, every local tensor now copied into memory of its own (in place: the pieces
        are this capture's alone), as the pinned backends reuse their host buffers at the next sleep."""
        for piece in self.pieces:
            piece.local = piece.local.detach().clone()
        return self

    def assemble(self) -> ShardState:
        """Collective over the save group: rank 0 gets the whole tensors and the ``ShardState`` that
        ``capture`` would give a resident role; the other ranks their RNG state only."""
        with self.group.session(f"{self.trainer.config.role} checkpoint"):
            whole = self._gather_all()
        rank = self.trainer.dp.rank
        if rank != 0:
            return ShardState(rank=rank, rng=self.rng)
        seen: set[int] = set()

        def whole_of(piece: _Piece) -> torch.Tensor:
            # A tied alias gets a copy of its own, as torch.distributed.checkpoint gathers each name
            # separately: hf/ is then written exactly as the foreground save writes it.
            tensor = whole[id(piece)]
            if id(piece) in seen:
                return tensor.clone()
            seen.add(id(piece))
            return tensor

        model_state = {name: whole_of(piece) for name, piece in self.model.items()}
        optimizer_state = {
            **self.optimizer,
            "state": {
                name: {k: whole_of(v) if isinstance(v, _Piece) else v for k, v in values.items()}
                for name, values in self.optimizer["state"].items()
            },
        }
        return whole_state(self.trainer, self.step, self.rng, model_state, optimizer_state, given=True)

    def _gather_all(self) -> dict[int, torch.Tensor]:
        """Whole tensors by ``id`` of their piece (rank 0; empty elsewhere)."""
        group, role = self.group, self.trainer.config.role
        sharded = [p for p in self.pieces if p.sharded]
        mine = torch.tensor([p.local.shape[0] for p in sharded], dtype=torch.int64)
        rows = torch.stack(group.all_gather_rows(mine, f"{role}: the shards' row counts"))  # [world, n]
        whole: dict[int, torch.Tensor] = {}
        for i, piece in enumerate(sharded):
            counts = [int(c) for c in rows[:, i]]
            if sum(counts) != piece.shape[0]:
                raise RuntimeError(
                    f"{role}: the ranks hold {counts} rows of a tensor of shape {piece.shape}; "
                    "FSDP2 shards dim 0 in rank order, so they must add up to its first dimension"
                )
            what = f"{role}: a tensor of shape {piece.shape}"
            if group.rank != 0:
                if counts[group.rank]:
                    group.send(piece.local.contiguous(), what)
                continue
            if counts[0] == piece.shape[0]:
                # Rank 0 holds every row (one rank, or the others' shards are empty): the whole tensor
                # already, in the writer's own copy (or the host backend's fresh buffer, which a
                # replicated role writes from too). No copy, unless its storage holds more than its
                # bytes (torch.save writes whole storages).
                local = piece.local
                compact = local.untyped_storage().nbytes() == local.numel() * local.element_size()
                exact = compact and local.is_contiguous()
                whole[id(piece)] = local if exact else local.clone(memory_format=torch.contiguous_format)
                continue
            # Each rank's rows land in place (dim-0 slices of a contiguous tensor are contiguous):
            # no padding, no gather buffers, no concatenation; rank 0 copies its own rows once.
            out = torch.empty(piece.shape, dtype=piece.local.dtype)
            starts = [sum(counts[:r]) for r in range(group.world_size)]
            out[: counts[0]].copy_(piece.local)
            group.receive(
                [
                    (r, out[starts[r] : starts[r] + counts[r]])
                    for r in range(1, group.world_size)
                    if counts[r]
                ],
                what,
            )
            whole[id(piece)] = out
        if group.rank == 0:
            for piece in self.pieces:
                if not piece.sharded:
                    whole[id(piece)] = piece.local
        return whole


def capture_shards(
    trainer: TorchCheckpointable, step: int | None, host: HostCopies, group: SaveGroup
) -> ShardedCapture:
    """This rank's part of an asleep sharded role's checkpoint: host copies, no collective, no copy.

    Valid until the role's next sleep writes the host buffers again (the writer copies or sends them
    first; the worker's sleep waits for that)."""
    if not trainer.sharded:
        raise ValueError("capture_shards: the trainer is replicated; use torch_io.capture(host=...)")
    memo: dict[int, _Piece] = {}
    pieces: list[_Piece] = []

    def piece_of(tensor: torch.Tensor) -> _Piece:
        # By identity: a tied weight is one Parameter under two names, one piece.
        if id(tensor) in memo:
            return memo[id(tensor)]
        if isinstance(tensor, DTensor):
            if tuple(tensor.placements) != (Shard(0),) or tensor.device_mesh.size() != group.world_size:
                raise ValueError(
                    f"capture_shards: a tensor of shape {tuple(tensor.shape)} is placed "
                    f"{tensor.placements} over {tensor.device_mesh.size()} ranks; only FSDP2's Shard(0) "
                    f"over the role's {group.world_size} ranks is supported"
                )
            local = tensor.to_local()
            sharded = True
        else:
            local, sharded = tensor, False
        made = _Piece(local.detach(), tuple(tensor.shape), sharded)  # the host copy replaces it below
        memo[id(tensor)] = made
        pieces.append(made)
        return made

    # keep_vars: the Parameters themselves, so tied names resolve to one piece.
    model = {name: piece_of(t) for name, t in trainer.model.state_dict(keep_vars=True).items()}
    by_name = state_by_name(trainer.model, trainer.optimizer.state_dict())
    state: Mapping[str, Mapping[str, Any]] = by_name["state"]
    optimizer = {
        **by_name,
        "state": {
            name: {k: piece_of(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
            for name, values in state.items()
        },
    }
    # One lookup for all pieces: the backend indexes every host copy it holds on each call, so a
    # call per tensor grows with the square of the tensor count (hundreds of them per role).
    # An empty shard (fewer rows than ranks) has no bytes, so the memory backend never moved it.
    filled = [p for p in pieces if p.local.numel() > 0]
    for piece, copy in zip(filled, host.host_copies([p.local for p in filled]), strict=True):
        piece.local = copy
    for piece in pieces:
        if piece.local.numel() == 0:
            piece.local = torch.empty(piece.local.shape, dtype=piece.local.dtype)
    return ShardedCapture(trainer, step, group, fmt.rng_state(), model, optimizer, pieces)
