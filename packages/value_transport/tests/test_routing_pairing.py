"""route, require_values and pair_values: pure functions (Boxes need a Ray session to exist)."""

from __future__ import annotations

import random

import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_value_transport import (
    Box,
    MissingValuesError,
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


def _ids(*ranks: list[int]) -> list[list[int]]:
    return [list(r) for r in ranks]


@pytest.mark.usefixtures("ray_session")
def test_pair_values_maps_rows_in_the_consumers_order() -> None:
    boxes = [Box(ray.put(0)), Box(ray.put(1))]
    # critic: 2 ranks holding samples 0-2 and 3-5; actor: one rank holding them in another order
    per_actor = pair_values(boxes, _ids([0, 1, 2], [3, 4, 5]), _ids([4, 5, 0, 1, 2, 3]))
    assert len(per_actor) == 1
    assert [(p.box, p.rows, p.producer) for p in per_actor[0].parts] == [
        (boxes[1], (1, 2), 1),
        (boxes[0], (0, 1, 2), 0),
        (boxes[1], (0,), 1),
    ]
    assert per_actor[0].num_samples == 6
    # 1 -> 2: one payload, split by rows
    one = pair_values(boxes[:1], _ids([0, 1, 2, 3]), _ids([2, 3], [0, 1]))
    assert [[(p.box, p.rows) for p in pieces.parts] for pieces in one] == [
        [(boxes[0], (2, 3))],
        [(boxes[0], (0, 1))],
    ]


@pytest.mark.usefixtures("ray_session")
def test_pair_values_refuses_mismatched_splits() -> None:
    box = Box(ray.put(0))
    with pytest.raises(ValueError, match="got 1 producer payloads for 2 producer ranks"):
        pair_values([box], _ids([0], [1]), _ids([0, 1]))
    with pytest.raises(ValueError, match=r"producer only: \[2\], consumer only: \[\]"):
        pair_values([box], _ids([0, 1, 2]), _ids([0, 1]))
    with pytest.raises(ValueError, match="sample 1 is held twice by the consumer"):
        pair_values([box], _ids([0, 1]), _ids([0, 1], [1]))
    with pytest.raises(MissingValuesError, match=r"critic rank 1 returned none.*actor rank 0 needs"):
        pair_values([box, None], _ids([0], [1]), _ids([1, 0]))
    with pytest.raises(MissingValuesError, match="critic rank 0 returned str"):
        pair_values(["oops"], _ids([0]), _ids([0]))  # type: ignore[list-item]


@pytest.mark.usefixtures("ray_session")
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 2**16))
def test_pair_values_every_sample_once_in_order(producers: int, consumers: int, seed: int) -> None:
    rng = random.Random(seed)
    n = producers * consumers * 2
    order = list(range(n))
    rng.shuffle(order)
    held = [order[i::producers] for i in range(producers)]
    rng.shuffle(order)
    wanted = [order[i::consumers] for i in range(consumers)]
    boxes = [Box(ray.put(i)) for i in range(producers)]
    pieces = pair_values(boxes, held, wanted)
    for rank, p in enumerate(pieces):
        assert all(part.box is boxes[part.producer] for part in p.parts)
        got = [held[part.producer][row] for part in p.parts for row in part.rows]
        assert got == wanted[rank]
