"""Critic actors -> driver -> actor actors, with real Ray actors in separate processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_value_transport import (
    Box,
    MissingValuesError,
    Pieces,
    dispatch,
    gather,
    pack,
    pack_fields,
    pair_values,
    require_values,
    unpack,
    unpack_pieces,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def values_for(rank: int, lengths: list[int]) -> list[torch.Tensor]:
    """What critic rank ``rank`` computes: distinct per rank, so a mix-up shows."""
    return [torch.full((n,), float(rank), dtype=torch.float32) + torch.arange(n) / 1000 for n in lengths]


@ray.remote(num_cpus=0)
class Worker:
    """Plays critic rank ``rank`` and actor rank ``rank`` (two roles, one process, to spare CPUs)."""

    def __init__(self, rank: int, last_stage: bool) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.last_stage = last_stage

    def compute_values(self, lengths: list[int], dtype: str = "float32") -> Box | None:
        if not self.last_stage:
            return None  # a rank that produced nothing
        return pack_fields({"values": [v.to(getattr(torch, dtype)) for v in values_for(self.rank, lengths)]})

    def train(self, values: Box | Pieces | None) -> dict[str, Any]:
        got_values = require_values(self.rank, values)
        got = (
            unpack_pieces(got_values).get("values", [])
            if isinstance(got_values, Pieces)
            else unpack(got_values)
        )
        return {
            "rank": self.rank,
            "lengths": [len(v) for v in got],
            "dtypes": sorted({str(v.dtype) for v in got}),
            "tensors": [v.clone() for v in got],
        }

    def receive(self, payload: Any, extra: int = 0, *, tag: str = "") -> tuple[str, Any, int, str]:
        return type(payload).__name__, payload, extra, tag

    def relay(self, box: Box, consumer: Any) -> Any:
        """An intermediate hop: hands the Box on without fetching it."""
        assert isinstance(box, Box)
        return ray.get(consumer.train.remote(box))


@pytest.fixture(scope="module")
def groups() -> Iterator[tuple[list[Any], list[Any]]]:
    # Ranks 2 and 3 produce values (the critic); all four consume them (the actor), so most reads
    # cross processes.
    workers = [Worker.remote(rank, last_stage=rank >= 2) for rank in range(4)]
    gather([w.receive.remote(None) for w in workers], 240, "worker start")
    yield workers, workers
    for handle in workers:
        ray.kill(handle)


# Producer ranks 2 and 3 hold samples 0-2 and 3-5 (values_for(rank, LENGTHS)); each of the four
# consumer ranks holds a mix in its own order (two splits of the same samples over two ranks each).
LENGTHS = [5, 0, 17]
PRODUCER_IDS = [[0, 1, 2], [3, 4, 5]]
CONSUMER_IDS = [[0, 1, 2], [3, 4, 5], [5, 0, 4], [2, 3, 1]]


def _expected(sample: int, lengths: list[int]) -> torch.Tensor:
    rank, row = divmod(sample, len(lengths))
    return values_for(2 + rank, lengths)[row]


def test_each_actor_rank_gets_its_samples_values(groups: tuple[list[Any], list[Any]]) -> None:
    critics, actors = groups
    produced = gather([c.compute_values.remote(LENGTHS) for c in critics], 120, "critic values")
    assert produced[0] is None
    assert produced[1] is None
    per_actor = [
        *pair_values(produced[2:], PRODUCER_IDS, CONSUMER_IDS[:2]),
        *pair_values(produced[2:], PRODUCER_IDS, CONSUMER_IDS[2:]),
    ]
    results = gather(dispatch(actors, "train", per_actor), 120, "actor train")
    for rank, result in enumerate(results):
        assert result["rank"] == rank
        expected = [_expected(s, LENGTHS) for s in CONSUMER_IDS[rank]]
        assert result["lengths"] == [len(v) for v in expected]
        assert all(torch.equal(a, b) for a, b in zip(result["tensors"], expected, strict=True))


def test_missing_values_names_the_rank(groups: tuple[list[Any], list[Any]]) -> None:
    _, actors = groups
    box = pack([torch.zeros(2)])
    refs = dispatch(actors, "train", [box, box, None, box])
    with pytest.raises(MissingValuesError, match="actor rank 2 needs critic values but received none"):
        gather(refs, 120, "actor train")
    with pytest.raises(MissingValuesError, match=r"critic rank 1 returned none.*actor rank 1 needs"):
        pair_values([box, None], PRODUCER_IDS, CONSUMER_IDS[:2])


def test_dispatch_counts(groups: tuple[list[Any], list[Any]]) -> None:
    _, actors = groups
    with pytest.raises(ValueError, match="got 3 payloads for world_size 4"):
        dispatch(actors, "receive", [1, 2, 3])
    with pytest.raises(ValueError, match="got 0 payloads for world_size 4"):
        dispatch(actors, "receive", [])
    with pytest.raises(ValueError, match="non-empty sequence"):
        dispatch([], "receive", [1])
    with pytest.raises(ValueError, match="rank 0 has no method 'nope'"):
        dispatch(actors, "nope", [1])
    one_for_all = gather(dispatch(actors, "receive", ["same"], 7, tag="t"), 120, "receive")
    assert one_for_all == [("str", "same", 7, "t")] * 4


def test_refs_resolve_boxes_do_not(groups: tuple[list[Any], list[Any]]) -> None:
    _, actors = groups
    box = pack([torch.arange(3, dtype=torch.int64)])
    ref = ray.put(41)
    got = gather(dispatch(actors, "receive", [ref, box, ref, box]), 120, "receive")
    assert [g[0] for g in got] == ["int", "Box", "int", "Box"]
    assert got[0][1] == 41
    assert got[1][1] == box  # the same ref, not fetched on the way
    # and through an intermediate actor, which receives and forwards the Box unresolved
    relayed = ray.get(actors[0].relay.remote(box, actors[1]), timeout=120)
    assert relayed["rank"] == 1
    assert relayed["tensors"][0].tolist() == [0, 1, 2]


def test_gather_times_out_naming_the_pending_ranks() -> None:
    @ray.remote(num_cpus=0)
    def wait_for(seconds: float) -> float:
        import time

        time.sleep(seconds)
        return seconds

    refs = [wait_for.remote(0.0), wait_for.remote(30.0)]
    with pytest.raises(TimeoutError, match=r"actor train: ranks \[1\] did not finish within 2 s"):
        gather(refs, 2.0, "actor train")
    ray.cancel(refs[1], force=True)


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    lengths=st.lists(st.integers(0, 300), max_size=8),
    dtype=st.sampled_from(["float32", "bfloat16", "int64", "float16"]),
)
def test_handoff_round_trip_property(
    groups: tuple[list[Any], list[Any]], lengths: list[int], dtype: str
) -> None:
    critics, actors = groups
    produced = gather([c.compute_values.remote(lengths, dtype) for c in critics], 120, "critic values")
    n = len(lengths)
    # Every consumer rank takes all samples, in reverse order: each read spans both producers.
    ids = [list(range(n)), list(range(n, 2 * n))]
    pieces = pair_values(produced[2:], ids, [list(reversed(range(2 * n)))])
    results = gather(dispatch(actors, "train", pieces), 120, "actor train")
    for _rank, result in enumerate(results):
        expected = [
            values_for(2 + s // n, lengths)[s % n].to(getattr(torch, dtype)) for s in reversed(range(2 * n))
        ]
        assert result["lengths"] == [len(v) for v in expected]
        assert all(torch.equal(a, b) for a, b in zip(result["tensors"], expected, strict=True))
        assert result["dtypes"] == ([f"torch.{dtype}"] if lengths else [])
