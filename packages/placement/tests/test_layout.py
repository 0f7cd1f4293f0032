"""plan_layout: the reference numbers of slime/miles for every mode, and properties over all specs."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppo_placement import Layout, PlacementSpec, RoleLayout, plan_layout


def _ranges(layout: Layout) -> dict[str, tuple[int, int]]:
    return {role: (r.offset, r.count) for role, r in layout.roles.items()}


# (spec kwargs, num_bundles, role -> (offset, count), rollout_offset, engine_count)
TABLE: list[tuple[str, dict[str, Any], int, dict[str, tuple[int, int]], int, int]] = [
    (
        "disaggregate 8+8",
        {"actor_gpus": 8, "rollout_gpus": 8},
        16,
        {"actor": (0, 8), "rollout": (8, 8)},
        8,
        8,
    ),
    (
        "disaggregate, 2 GPUs per engine",
        {"actor_gpus": 4, "rollout_gpus": 8, "gpus_per_engine": 2},
        12,
        {"actor": (0, 4), "rollout": (4, 8)},
        4,
        4,
    ),
    (
        "colocate, rollout larger",
        {"actor_gpus": 4, "rollout_gpus": 8, "colocate": True},
        8,
        {"actor": (0, 4), "rollout": (0, 8)},
        0,
        8,
    ),
    (
        "colocate, actor larger",
        {"actor_gpus": 8, "rollout_gpus": 4, "colocate": True, "gpus_per_engine": 4},
        8,
        {"actor": (0, 8), "rollout": (0, 4)},
        0,
        1,
    ),
    ("train-only", {"actor_gpus": 8, "rollout_gpus": 8, "train_only": True}, 8, {"actor": (0, 8)}, 8, 0),
    (
        "rollout-only",
        {"actor_gpus": 8, "rollout_gpus": 4, "rollout_only": True},
        4,
        {"rollout": (0, 4)},
        0,
        4,
    ),
    (
        "external rollout",
        {"actor_gpus": 8, "rollout_gpus": 8, "external_rollout": True},
        8,
        {"actor": (0, 8)},
        8,
        8,
    ),
    (
        "external rollout + rollout-only",
        {"actor_gpus": 8, "rollout_gpus": 8, "external_rollout": True, "rollout_only": True},
        0,
        {},
        0,
        8,
    ),
    (
        "shared critic counted once",
        {"actor_gpus": 8, "rollout_gpus": 8, "critic": "shared"},
        16,
        {"actor": (0, 8), "critic": (0, 8), "rollout": (8, 8)},
        8,
        8,
    ),
    (
        "dedicated critic after the actor",
        {"actor_gpus": 8, "rollout_gpus": 8, "critic": "dedicated", "critic_gpus": 4},
        20,
        {"actor": (0, 8), "critic": (8, 4), "rollout": (12, 8)},
        12,
        8,
    ),
    (
        "dedicated critic, default size",
        {"actor_gpus": 2, "rollout_gpus": 2, "critic": "dedicated"},
        6,
        {"actor": (0, 2), "critic": (2, 2), "rollout": (4, 2)},
        4,
        2,
    ),
    (
        "colocate + shared critic",
        {"actor_gpus": 8, "rollout_gpus": 8, "colocate": True, "critic": "shared"},
        8,
        {"actor": (0, 8), "critic": (0, 8), "rollout": (0, 8)},
        0,
        8,
    ),
    (
        "dedicated critic, train-only",
        {"actor_gpus": 4, "rollout_gpus": 4, "critic": "dedicated", "train_only": True},
        8,
        {"actor": (0, 4), "critic": (4, 4)},
        8,
        0,
    ),
    (
        "dedicated critic, external rollout",
        {"actor_gpus": 4, "rollout_gpus": 4, "critic": "dedicated", "external_rollout": True},
        8,
        {"actor": (0, 4), "critic": (4, 4)},
        8,
        4,
    ),
    (
        "rollout-only ignores the critic",
        {"actor_gpus": 4, "rollout_gpus": 2, "critic": "shared", "rollout_only": True},
        2,
        {"rollout": (0, 2)},
        0,
        2,
    ),
    (
        "CPU-only disaggregate",
        {"actor_gpus": 2, "rollout_gpus": 2, "use_gpus": False},
        4,
        {"actor": (0, 2), "rollout": (2, 2)},
        2,
        2,
    ),
]


@pytest.mark.parametrize(
    ("spec_kwargs", "num_bundles", "ranges", "rollout_offset", "engines"),
    [pytest.param(*row[1:], id=row[0]) for row in TABLE],
)
def test_reference_layouts(
    spec_kwargs: dict[str, Any],
    num_bundles: int,
    ranges: dict[str, tuple[int, int]],
    rollout_offset: int,
    engines: int,
) -> None:
    layout = plan_layout(PlacementSpec(**spec_kwargs))
    assert (layout.num_bundles, layout.rollout_offset) == (num_bundles, rollout_offset)
    assert _ranges(layout) == ranges
    assert layout.engine_count == engines


def test_gpu_shares_when_roles_share_bundles() -> None:
    layout = plan_layout(PlacementSpec(actor_gpus=4, rollout_gpus=8, colocate=True, critic="shared"))
    shares = {role: r.gpu_share for role, r in layout.roles.items()}
    assert shares == {"actor": 0.4, "critic": 0.4, "rollout": 0.2}
    assert layout.bundle == {"GPU": 1.0, "CPU": 1.0}


def test_gpu_shares_disaggregated() -> None:
    # The shared critic splits the actor's GPUs; the rollout has its own whole GPUs.
    layout = plan_layout(PlacementSpec(actor_gpus=8, rollout_gpus=8, critic="shared"))
    assert layout.roles["actor"] == RoleLayout(offset=0, count=8, gpu_share=0.4, cpu_share=0.4)
    assert layout.roles["critic"].gpu_share == 0.4
    assert layout.roles["rollout"].gpu_share == 1.0
    dedicated = plan_layout(PlacementSpec(actor_gpus=8, rollout_gpus=8, critic="dedicated"))
    assert {r.gpu_share for r in dedicated.roles.values()} == {1.0}


def test_cpu_only_run_has_cpu_bundles_and_no_gpu_share() -> None:
    layout = plan_layout(
        PlacementSpec(actor_gpus=2, rollout_gpus=2, colocate=True, use_gpus=False, cpus_per_bundle=0.5)
    )
    assert layout.bundle == {"CPU": 0.5}
    assert {r.gpu_share for r in layout.roles.values()} == {0.0}
    assert layout.roles["actor"].cpu_share == pytest.approx(0.2)
    assert layout.roles["rollout"].cpu_share == pytest.approx(0.1)


def test_plan_layout_does_not_mutate_and_is_deterministic() -> None:
    spec = PlacementSpec(actor_gpus=8, rollout_gpus=8, critic="shared")
    before = repr(spec)
    assert plan_layout(spec) == plan_layout(spec)
    assert repr(spec) == before


# --- properties over every spec hypothesis can build -------------------------------------------

specs_kwargs = st.fixed_dictionaries(
    {
        "actor_gpus": st.integers(-1, 12),
        "rollout_gpus": st.integers(-1, 12),
        "gpus_per_engine": st.integers(0, 4),
        "colocate": st.booleans(),
        "critic": st.sampled_from(["none", "shared", "dedicated"]),
        "critic_gpus": st.none() | st.integers(0, 12),
        "train_only": st.booleans(),
        "rollout_only": st.booleans(),
        "external_rollout": st.booleans(),
        "use_gpus": st.booleans(),
        "cpus_per_bundle": st.sampled_from([0.0, 0.25, 1.0, 2.0]),
    }
)


def _may_overlap(spec: PlacementSpec, a: str, b: str) -> bool:
    if spec.colocate:
        return True
    return {a, b} == {"actor", "critic"} and spec.critic == "shared"


@settings(max_examples=200, deadline=None)
@given(specs_kwargs)
def test_layout_properties(kwargs: dict[str, Any]) -> None:
    try:
        spec = PlacementSpec(**kwargs)
    except ValueError:
        return
    layout = plan_layout(spec)
    roles = layout.roles
    # Every index in range, and no bundle unused.
    for r in roles.values():
        assert r.count > 0
        assert r.offset >= 0
        assert r.offset + r.count <= layout.num_bundles
    assert layout.num_bundles == max((r.offset + r.count for r in roles.values()), default=0)
    # Roles never overlap unless colocated or a shared critic.
    names = list(roles)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ra, rb = roles[a].positions, roles[b].positions
            if set(ra) & set(rb):
                assert _may_overlap(spec, a, b), (a, b, layout)
    # A bundle's GPU is never oversubscribed, and its CPUs neither.
    for position in range(layout.num_bundles):
        on = [r for r in roles.values() if position in r.positions]
        assert on, f"bundle {position} is unused"
        assert sum(r.gpu_share for r in on) <= 1.0 + 1e-9
        assert sum(r.cpu_share for r in on) <= spec.cpus_per_bundle + 1e-9
    # Totals add up.
    actor = 0 if spec.rollout_only else spec.actor_gpus
    critic = spec.critic_bundles if (spec.critic == "dedicated" and not spec.rollout_only) else 0
    rollout = 0 if (spec.train_only or spec.external_rollout) else spec.rollout_gpus
    if spec.colocate:
        assert layout.num_bundles == max(actor + critic, rollout)
    else:
        assert layout.num_bundles == actor + critic + rollout
    assert roles.get("rollout", RoleLayout(0, 0, 0, 0)).count == rollout
    assert layout.engine_count == (0 if spec.train_only else spec.rollout_gpus // spec.gpus_per_engine)
    assert layout.engine_count * spec.gpus_per_engine == (0 if spec.train_only else spec.rollout_gpus)
    if not spec.use_gpus:
        assert "GPU" not in layout.bundle
        assert all(r.gpu_share == 0.0 for r in roles.values())
