"""``PlacementSpec.node_resources``: which bundles ask for a node resource, and which bundles each role
then gets. Pure (no Ray): the multi-node end-to-end test (tests-e2e/test_multinode.py) places real
bundles on a simulated cluster."""

from __future__ import annotations

import pytest

from ppo_placement import NODE_RESOURCE_SHARE, PlacementSpec, bundle_resources, plan_layout
from ppo_placement.groups import _pick


def _spec(**kw: object) -> PlacementSpec:
    base: dict[str, object] = {"actor_gpus": 2, "rollout_gpus": 2, "use_gpus": False}
    return PlacementSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_disaggregated_roles_ask_for_their_own_resource() -> None:
    spec = _spec(critic="dedicated", critic_gpus=1, node_resources=(("actor", "a"), ("rollout", "r")))
    bundles = bundle_resources(plan_layout(spec), spec)
    # actor [0, 2), critic [2, 3) untagged, rollout [3, 5)
    assert [sorted(b) for b in bundles] == [["CPU", "a"], ["CPU", "a"], ["CPU"], ["CPU", "r"], ["CPU", "r"]]
    assert bundles[0]["a"] == NODE_RESOURCE_SHARE


def test_colocated_bundle_needs_every_role_s_resource() -> None:
    spec = _spec(colocate=True, critic="shared", node_resources=(("actor", "t"), ("rollout", "e")))
    assert bundle_resources(plan_layout(spec), spec) == [{"CPU": 1.0, "t": 0.001, "e": 0.001}] * 2


def test_without_node_resources_the_bundles_are_unchanged() -> None:
    spec = _spec()
    layout = plan_layout(spec)
    assert bundle_resources(layout, spec) == [dict(layout.bundle)] * layout.num_bundles


def test_a_role_keeps_the_bundles_requested_for_it_in_node_order() -> None:
    # Sorted by node, the rollout's bundles (3, 4) came first: without node resources the actor would
    # take them; with them, each role keeps its own, in sorted order among themselves.
    order = [4, 3, 1, 0, 2]
    assert _pick(order, range(0, 2), by_role=False) == [4, 3]
    assert _pick(order, range(0, 2), by_role=True) == [1, 0]
    assert _pick(order, range(3, 5), by_role=True) == [4, 3]


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ((("trainer", "x"),), "the roles are actor, critic and rollout"),
        ((("critic", "x"),), "which this run does not place"),
        ((("actor", "x"), ("actor", "y")), "names the actor twice"),
        ((("actor", " x"),), "without spaces around it"),
        ((("actor", "GPU"),), "one of Ray's own resources"),
        ((("actor", "node:10.0.0.1"),), "one of Ray's own resources"),
    ],
)
def test_bad_node_resources_say_what_to_fix(resources: tuple[tuple[str, str], ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(node_resources=resources)
