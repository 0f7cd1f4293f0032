"""create_placement_groups on a real local Ray with 8 logical GPUs and 4 CPUs."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_placement import (
    PlacementSpec,
    PlacementTimeoutError,
    RoleSlots,
    create_placement_groups,
    remove_placement_groups,
)

# 16 bundles x 0.25 CPU fit the 4 CPUs the shared test machine allows.
CPUS = 0.25


def test_needs_ray_init_first() -> None:
    if ray.is_initialized():  # pragma: no cover - only if another module left Ray running
        ray.shutdown()
    with pytest.raises(RuntimeError, match=r"call ray.init\(...\) first"):
        create_placement_groups(PlacementSpec(actor_gpus=1, rollout_gpus=1))


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=4, num_gpus=8, object_store_memory=256 * 1024**2, include_dashboard=False)
    yield
    ray.shutdown()


@ray.remote
def _seen_gpus() -> list[int]:
    return [int(g) for g in ray.get_gpu_ids()]


def _land(slots: RoleSlots, i: int) -> list[int]:
    """Run a task the way a role's actor is scheduled on slot i, and return the GPUs it got."""
    strategy = PlacementGroupSchedulingStrategy(
        placement_group=slots.placement_group, placement_group_bundle_index=slots.bundle_indices[i]
    )
    ref = _seen_gpus.options(
        scheduling_strategy=strategy, num_gpus=slots.gpu_share, num_cpus=slots.cpu_share
    ).remote()
    return ray.get(ref, timeout=60)


def _free_gpus() -> float:
    # Resources return to the pool asynchronously after a removal.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        free = ray.available_resources().get("GPU", 0.0)
        if free == 8.0:
            return free
        time.sleep(0.2)
    return ray.available_resources().get("GPU", 0.0)


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("local_ray")
def test_disaggregate_shared_critic_slots() -> None:
    spec = PlacementSpec(actor_gpus=4, rollout_gpus=4, critic="shared", cpus_per_bundle=CPUS)
    placements = create_placement_groups(spec, timeout_s=60)
    try:
        pg = placements.placement_group
        assert pg is not None
        assert placement_group_table(pg)["strategy"] == "PACK"
        assert len(placement_group_table(pg)["bundles"]) == 8
        actor, critic, rollout = (placements.slots[r] for r in ("actor", "critic", "rollout"))
        assert critic == actor
        assert (actor.gpu_share, rollout.gpu_share) == (0.4, 1.0)
        # Every bundle once, GPUs in ascending order along the sorted bundle order.
        assert sorted(actor.bundle_indices + rollout.bundle_indices) == list(range(8))
        assert actor.gpu_ids + rollout.gpu_ids == tuple(range(8))
        assert len(set(actor.node_ips)) == 1
        # An actor scheduled on slot i really gets gpu_ids[i]; actor and critic fit one bundle together.
        assert _land(rollout, 2) == [rollout.gpu_ids[2]]
        assert _land(actor, 1) == [actor.gpu_ids[1]]
        assert ray.get(
            [
                _seen_gpus.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=actor.bundle_indices[0]
                    ),
                    num_gpus=s.gpu_share,
                    num_cpus=s.cpu_share,
                ).remote()
                for s in (actor, critic)
            ],
            timeout=60,
        ) == [[actor.gpu_ids[0]], [actor.gpu_ids[0]]]
    finally:
        remove_placement_groups(placements)
    remove_placement_groups(placements)  # a second removal is a no-op
    assert placement_group_table(pg)["state"] == "REMOVED"
    assert _free_gpus() == 8.0


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("local_ray")
def test_gpu_ids_follow_the_bundles_ray_chose() -> None:
    # With 3 GPUs taken first, our group lands on the other 5: the ids come from the probes.
    other = ray.util.placement_group([{"GPU": 1, "CPU": 0.1}] * 3, strategy="PACK")
    ray.get(other.ready(), timeout=60)
    taken = sorted(
        ray.get(
            [
                _seen_gpus.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=other, placement_group_bundle_index=i
                    ),
                    num_gpus=1,
                    num_cpus=0,
                ).remote()
                for i in range(3)
            ],
            timeout=60,
        )
    )
    spec = PlacementSpec(actor_gpus=2, rollout_gpus=4, colocate=True, critic="shared", cpus_per_bundle=CPUS)
    placements = create_placement_groups(spec, timeout_s=60)
    try:
        ours = placements.slots["rollout"].gpu_ids
        assert len(ours) == 4
        assert list(ours) == sorted(ours)
        assert not set(ours) & {g[0] for g in taken}
        assert placements.slots["actor"].gpu_ids == ours[:2]
        shares = {r: s.gpu_share for r, s in placements.slots.items()}
        assert shares == {"actor": 0.4, "critic": 0.4, "rollout": 0.2}
        assert _land(placements.slots["rollout"], 3) == [ours[3]]
    finally:
        remove_placement_groups(placements)
        ray.util.remove_placement_group(other)
    assert _free_gpus() == 8.0


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("local_ray")
def test_cpu_only_run() -> None:
    spec = PlacementSpec(actor_gpus=2, rollout_gpus=2, use_gpus=False, cpus_per_bundle=0.5)
    placements = create_placement_groups(spec, timeout_s=60)
    try:
        assert placement_group_table(placements.placement_group)["bundles"] == {
            i: {"CPU": 0.5} for i in range(4)
        }
        actor, rollout = placements.slots["actor"], placements.slots["rollout"]
        assert (actor.gpu_ids, rollout.gpu_ids) == ((), ())
        assert (actor.gpu_share, actor.cpu_share) == (0.0, 0.5)
        assert sorted(actor.bundle_indices + rollout.bundle_indices) == [0, 1, 2, 3]
        assert _land(actor, 0) == []
    finally:
        remove_placement_groups(placements)


@pytest.mark.usefixtures("local_ray")
def test_nothing_to_place() -> None:
    spec = PlacementSpec(actor_gpus=8, rollout_gpus=8, external_rollout=True, rollout_only=True)
    placements = create_placement_groups(spec, timeout_s=5)
    assert placements.placement_group is None
    assert dict(placements.slots) == {}
    remove_placement_groups(placements)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("local_ray")
def test_timeout_says_what_was_asked_and_what_the_cluster_has() -> None:
    spec = PlacementSpec(actor_gpus=8, rollout_gpus=8, cpus_per_bundle=CPUS)
    with pytest.raises(PlacementTimeoutError) as info:
        create_placement_groups(spec, timeout_s=1.0)
    message = str(info.value)
    assert "after 1 s" in message
    assert "16 bundles of {GPU=1, CPU=0.25} (in all 16 GPU, 4 CPU)" in message
    assert re.search(r"cluster total: 8 GPU, 4 CPU", message)
    assert isinstance(info.value, TimeoutError)
    # The half-made group is gone: nothing stays pending or reserved.
    pending = [t for t in placement_group_table().values() if t["state"] not in ("REMOVED",)]
    assert pending == []
    assert _free_gpus() == 8.0


@pytest.mark.usefixtures("local_ray")
def test_bad_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        create_placement_groups(PlacementSpec(actor_gpus=1, rollout_gpus=1), timeout_s=0)
