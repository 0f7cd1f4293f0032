"""route, require_values, Topology and pair_ranks: pure functions, no Ray calls."""

from __future__ import annotations

import pytest
import ray
from hypothesis import given
from hypothesis import strategies as st

from ppo_value_transport import (
    Box,
    MissingValuesError,
    Topology,
    pair_ranks,
    pair_values,
    require_values,
    route,
)


def test_route_one_per_rank_or_one_for_all() -> None:
    assert route(["a", "b", "c"], 3) == ["a", "b", "c"]
    assert route(["x"], 4) == ["x", "x", "x", "x"]
    assert route(["x"], 1) == ["x"]


@given(st.integers(0, 12), st.integers(1, 12))
def test_route_wrong_count_gives_both_numbers(count: int, world: int) -> None:
    payloads = list(range(count))
    if count in (1, world):
        assert len(route(payloads, world)) == world
    else:
        with pytest.raises(ValueError, match=rf"got {count} payloads for world_size {world}"):
            route(payloads, world)


def test_route_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        route([1], 0)
    with pytest.raises(ValueError, match="world_size must be a positive int, got True"):
        route([1], True)
    with pytest.raises(ValueError, match="payloads must be a sequence"):
        route("ab", 2)


def test_require_values_names_rank_and_role() -> None:
    with pytest.raises(MissingValuesError, match="actor rank 3 needs critic values but received none"):
        require_values(3, None)
    with pytest.raises(MissingValuesError, match="policy rank 0 received int where a values Box"):
        require_values(0, 5, role="policy")  # type: ignore[arg-type]


@pytest.mark.usefixtures("ray_session")
def test_require_values_passes_a_box_through() -> None:
    box = Box(ray.put(1))
    assert require_values(0, box) is box


def test_topology_megatron_order() -> None:
    topo = Topology(tensor_parallel=2, context_parallel=1, data_parallel=2, pipeline_parallel=3)
    assert topo.world_size == 12
    assert topo.stage_size == 4
    assert topo.last_stage_ranks() == [8, 9, 10, 11]
    assert [topo.pipeline_rank(r) for r in (0, 3, 4, 11)] == [0, 0, 1, 2]
    assert [topo.data_parallel_rank(r) for r in (0, 1, 2, 3, 10)] == [0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="rank 12 is outside world_size 12"):
        topo.pipeline_rank(12)
    with pytest.raises(ValueError, match=r"Topology\.data_parallel must be a positive int, got 0"):
        Topology(data_parallel=0)


def test_pair_ranks_same_coordinates_last_stage() -> None:
    topo = Topology(tensor_parallel=2, data_parallel=2, pipeline_parallel=2)
    assert pair_ranks(topo, topo) == [4, 5, 6, 7, 4, 5, 6, 7]
    flat = Topology(data_parallel=4)
    assert pair_ranks(flat, flat) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="need the same parallel layout"):
        pair_ranks(Topology(data_parallel=2), Topology(tensor_parallel=2))


@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 3), st.integers(1, 3))
def test_pair_ranks_keeps_tp_cp_dp_and_lands_on_last_stage(tp: int, cp: int, dp: int, pp: int) -> None:
    topo = Topology(tp, cp, dp, pp)
    pairs = pair_ranks(topo, topo)
    assert len(pairs) == topo.world_size
    for consumer, producer in enumerate(pairs):
        assert topo.pipeline_rank(producer) == pp - 1
        assert producer % topo.stage_size == consumer % topo.stage_size
        assert topo.data_parallel_rank(producer) == topo.data_parallel_rank(consumer)


def test_pair_values_wrong_count() -> None:
    topo = Topology(data_parallel=2)
    with pytest.raises(ValueError, match="got 1 producer results for producer world_size 2"):
        pair_values([None], topo, topo)
    with pytest.raises(MissingValuesError, match=r"critic rank 0 \(last pipeline stage\) returned str"):
        pair_values(["oops", None], topo, topo)  # type: ignore[list-item]
