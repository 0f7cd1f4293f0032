"""Which producer rank (critic, last pipeline stage) feeds which consumer rank (actor)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppo_value_transport._box import Box
from ppo_value_transport._routing import MissingValuesError


@dataclass(frozen=True)
class Topology:
    """A model-parallel layout in Megatron's default rank order.

    Ranks vary fastest over tensor parallel, then context parallel, then data parallel, and
    slowest over pipeline stages: ``rank = tp + TP*(cp + CP*(dp + DP*pp))``.
    """

    tensor_parallel: int = 1
    context_parallel: int = 1
    data_parallel: int = 1
    pipeline_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel", "context_parallel", "data_parallel", "pipeline_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.data_parallel * self.pipeline_parallel

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage."""
        return self.tensor_parallel * self.context_parallel * self.data_parallel

    def pipeline_rank(self, rank: int) -> int:
        self._check(rank)
        return rank // self.stage_size

    def data_parallel_rank(self, rank: int) -> int:
        self._check(rank)
        return (rank // (self.tensor_parallel * self.context_parallel)) % self.data_parallel

    def last_stage_ranks(self) -> list[int]:
        """The ranks of the last pipeline stage: the ones that produce outputs such as values."""
        start = (self.pipeline_parallel - 1) * self.stage_size
        return list(range(start, start + self.stage_size))

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size} of {self}")


def pair_ranks(producer: Topology, consumer: Topology) -> list[int]:
    """For every consumer rank, the producer rank whose values it receives.

    Producer and consumer must share one topology (that is what makes the pairing exact): consumer
    rank ``r`` gets the values of the producer's last-stage rank with the same tensor, context and
    data parallel coordinates, i.e. the same micro-batches in the same order.
    """
    if producer != consumer:
        raise ValueError(
            f"pair_ranks: producer topology {producer} differs from consumer topology {consumer}; "
            "values are routed rank to rank, so the critic and the actor need the same parallel layout"
        )
    stage = consumer.stage_size
    last = (producer.pipeline_parallel - 1) * stage
    return [last + rank % stage for rank in range(consumer.world_size)]


def pair_values(producer_values: Sequence[Box | None], producer: Topology, consumer: Topology) -> list[Box]:
    """Consumer-rank-ordered values from the producer's per-rank results.

    ``producer_values[i]`` is what producer rank ``i`` returned (``None`` is expected from ranks
    that are not on the last pipeline stage). A last-stage rank without values is a
    :class:`MissingValuesError` naming the producer rank and the consumer ranks that needed it.
    """
    if len(producer_values) != producer.world_size:
        raise ValueError(
            f"pair_values: got {len(producer_values)} producer results for producer world_size "
            f"{producer.world_size}; pass one result per producer rank"
        )
    pairs = pair_ranks(producer, consumer)
    out: list[Box] = []
    for producer_rank in pairs:
        values = producer_values[producer_rank]
        if not isinstance(values, Box):
            needing = [c for c, p in enumerate(pairs) if p == producer_rank]
            got = "none" if values is None else type(values).__name__
            raise MissingValuesError(
                f"critic rank {producer_rank} (last pipeline stage) returned {got} instead of a values "
                f"Box; actor ranks {needing} need its values"
            )
        out.append(values)
    return out
