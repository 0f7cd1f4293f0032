"""Which actor rank sends to which engine, checked on a real local Ray with logical GPUs: the plan the
driver derives from bundle positions (build.weight_sync_plan) equals the plan from the GPU ids Ray really
hands the actor ranks and the engines when they are scheduled the way the driver schedules them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_driver import build
from ppo_driver.config import load_config
from ppo_placement import RoleSlots, create_placement_groups, remove_placement_groups
from ppo_weight_sync import RankSends, plan_senders

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, num_gpus=4, object_store_memory=128 * 1024**2, include_dashboard=False)
    yield
    ray.shutdown()


@ray.remote
def _where() -> tuple[str, int]:
    return ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0])


def _gpu_of(slots: RoleSlots, i: int) -> tuple[str, int]:
    """The (node, GPU id) a Ray actor of this role gets on slot i, scheduled as the driver does."""
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=slots.placement_group, placement_group_bundle_index=slots.bundle_indices[i]
    )
    ref = _where.options(scheduling_strategy=strategy, num_gpus=slots.gpu_share, num_cpus=0).remote()
    return ray.get(ref, timeout=60)


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        # The shipped colocated config: rank 0 -> engine 0, rank 1 -> engine 1, both over CUDA IPC.
        ("2gpu-colocate", [], [RankSends(0, (0,), ()), RankSends(1, (1,), ())]),
        (
            "2gpu-colocate",
            ["placement.actor_gpus=4", "train.micro_batch_size=8"],
            [RankSends(r, (r,), ()) for r in range(4)],
        ),
        # Disaggregated: no engine shares an actor GPU; rank 0 sends to both over NCCL, rank 1 nothing.
        (
            "2gpu-colocate",
            ["placement.mode=disaggregate", "placement.rollout_gpus=2"],
            [RankSends(0, (), (0, 1)), RankSends(1, (), ())],
        ),
        # One colocated engine of two GPUs: no CUDA IPC (TP 2), rank 0 sends over the group (gloo).
        (
            "2gpu-colocate",
            ["placement.gpus_per_engine=2"],
            [RankSends(0, (0,), ()), RankSends(1, (), (), exports=((0, 1),))],
        ),
    ],
)
def test_the_plan_matches_the_gpus_ray_hands_out(
    local_ray: None, name: str, overrides: list[str], expected: list[RankSends]
) -> None:
    config = load_config(REPO / "configs" / f"{name}.yaml", [*overrides, "placement.cpus_per_bundle=0.1"])
    planned = build.weight_sync_plan(config)
    assert list(planned.ranks) == expected
    placements = create_placement_groups(build.placement_spec(config), timeout_s=60)
    try:
        actor, rollout = placements.slots["actor"], placements.slots["rollout"]
        ranks = [_gpu_of(actor, r) for r in range(len(actor))]
        g = config.placement.gpus_per_engine
        engines = [
            [_gpu_of(rollout, i * g + j) for j in range(g)] for i in range(placements.layout.engine_count)
        ]
        # The same plan from what Ray really assigned: same GPU <=> same (node, GPU id).
        assert plan_senders(ranks, engines) == planned
        for sends in planned.ranks:
            for i in sends.ipc:
                assert engines[i][0] == ranks[sends.rank]  # IPC from the rank on the engine's (first) GPU
            for i, tp_rank in sends.exports:
                assert engines[i][tp_rank] == ranks[sends.rank]  # fed by the rank on that TP rank's GPU
            for i in sends.group:
                assert ranks[0] not in engines[i] or g > 1  # NCCL never to rank 0's own GPU
    finally:
        remove_placement_groups(placements)
    actor_config = build.actor_trainer_config(config, "/m")
    assert actor_config.weight_sync_colocated == planned.ipc_by_rank
    assert actor_config.weight_sync_colocated_tp == planned.tp_wire
    assert actor_config.weight_sync_backend == ("gloo" if g > 1 else "nccl")
