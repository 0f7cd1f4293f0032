"""Which rows of which producer rank's payload (critic) each consumer rank (actor) receives.

The two roles may split one step's samples differently: another data-parallel size, another
balance. Each side says which samples it holds, as global sample ids in the order its rank holds
them; :func:`pair_values` turns the producer's per-rank payloads into, for every consumer rank, the
rows to take from each payload in the consumer's own order. Nothing is fetched on the driver: the
consumer rank gathers its rows with :func:`unpack_pieces`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ppo_value_transport._box import Box
from ppo_value_transport._codec import DEFAULT_TIMEOUT_S, unpack_fields
from ppo_value_transport._errors import MissingValuesError

SampleIds = Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True)
class Rows:
    """Rows ``rows`` (in this order) of the payload in ``box``, made by producer rank ``producer``."""

    box: Box
    rows: tuple[int, ...]
    producer: int = 0


@dataclass(frozen=True, slots=True)
class Pieces:
    """What one consumer rank receives: rows of producer payloads, concatenated in this order."""

    parts: tuple[Rows, ...]

    @property
    def num_samples(self) -> int:
        return sum(len(p.rows) for p in self.parts)


def _index(samples: SampleIds, side: str) -> dict[int, tuple[int, int]]:
    """Sample id -> (rank, row); every id once."""
    where: dict[int, tuple[int, int]] = {}
    for rank, ids in enumerate(samples):
        for row, sample in enumerate(ids):
            if sample in where:
                raise ValueError(
                    f"pair_values: sample {sample} is held twice by the {side} (ranks {where[sample][0]} "
                    f"and {rank}); each sample must sit on exactly one rank"
                )
            where[int(sample)] = (rank, row)
    return where


def pair_values(
    producer_values: Sequence[Box | None], producer_samples: SampleIds, consumer_samples: SampleIds
) -> list[Pieces]:
    """For every consumer rank, the rows of the producers' payloads that hold its samples, in order.

    ``producer_values[i]`` is producer rank ``i``'s payload, one row per sample in the order of
    ``producer_samples[i]`` (the sample ids that rank held). ``consumer_samples[j]`` lists the ids
    consumer rank ``j`` holds, in its order. Both sides must hold the same set of samples. A producer
    rank without a payload is a :class:`MissingValuesError` naming it and the consumer ranks that
    needed it. Consecutive rows of one payload form one :class:`Rows`.
    """
    if len(producer_values) != len(producer_samples):
        raise ValueError(
            f"pair_values: got {len(producer_values)} producer payloads for {len(producer_samples)} "
            "producer ranks; pass one payload per producer rank"
        )
    held = _index(producer_samples, "producer")
    wanted = _index(consumer_samples, "consumer")
    if held.keys() != wanted.keys():
        only_p = sorted(held.keys() - wanted.keys())[:5]
        only_c = sorted(wanted.keys() - held.keys())[:5]
        raise ValueError(
            f"pair_values: producer and consumer hold different samples (producer only: {only_p}, "
            f"consumer only: {only_c}); split the same batch for both roles"
        )
    out: list[Pieces] = []
    for consumer_rank, ids in enumerate(consumer_samples):
        parts: list[Rows] = []
        run_rank, run_rows = -1, list[int]()
        for sample in ids:
            rank, row = held[int(sample)]
            if rank != run_rank and run_rows:
                parts.append(_rows(producer_values, run_rank, run_rows, consumer_rank))
                run_rows = []
            run_rank = rank
            run_rows.append(row)
        if run_rows:
            parts.append(_rows(producer_values, run_rank, run_rows, consumer_rank))
        out.append(Pieces(tuple(parts)))
    return out


def _rows(values: Sequence[Box | None], rank: int, rows: list[int], consumer: int) -> Rows:
    box = values[rank]
    if not isinstance(box, Box):
        got = "none" if box is None else type(box).__name__
        raise MissingValuesError(
            f"critic rank {rank} returned {got} instead of a values Box; actor rank {consumer} needs its "
            "values"
        )
    return Rows(box, tuple(rows), rank)


def unpack_pieces(pieces: Pieces, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, list[torch.Tensor]]:
    """Fetch the payloads (``pack_fields`` made) and return each field's tensors in consumer order.

    The tensors are copies (``clone``): a consumer keeps only its rows, not the whole buffers.
    """
    out: dict[str, list[torch.Tensor]] = {}
    for part in pieces.parts:
        fields = unpack_fields(part.box, timeout_s=timeout_s)
        for name, tensors in fields.items():
            rows = out.setdefault(name, [])
            for row in part.rows:
                if not 0 <= row < len(tensors):
                    raise ValueError(
                        f"unpack_pieces: row {row} of critic rank {part.producer}'s payload, which holds "
                        f"{len(tensors)} samples in field {name!r}"
                    )
                rows.append(tensors[row].clone())
    counts = {name: len(v) for name, v in out.items()}
    if any(n != pieces.num_samples for n in counts.values()):
        raise ValueError(f"unpack_pieces: fields hold {counts} samples, expected {pieces.num_samples} each")
    return out
