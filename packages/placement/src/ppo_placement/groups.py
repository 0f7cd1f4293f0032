"""Ray side: one PACK placement group, probed, sorted and split into per-role slots."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from ppo_placement.layout import Layout, bundle_resources, plan_layout
from ppo_placement.order import Resolver, sort_bundles
from ppo_placement.spec import PlacementSpec

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


class PlacementTimeoutError(TimeoutError):
    """The placement group (or its probes) was not ready in time; the message says what was asked."""


@dataclass(frozen=True)
class RoleSlots:
    """One role's bundles, in sorted order; slot ``i`` is ``bundle_indices[i]`` on ``gpu_ids[i]``.

    ``gpu_ids`` is empty on CPU-only runs. Schedule Ray actor ``i`` with
    ``PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=bundle_indices[i])``,
    ``num_gpus=gpu_share`` and ``num_cpus=cpu_share``.
    """

    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]
    gpu_ids: tuple[int, ...]
    gpu_share: float
    cpu_share: float
    node_ips: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.bundle_indices)


@dataclass(frozen=True)
class Placements:
    """The layout, its one placement group (None when nothing is placed) and each placed role's slots."""

    layout: Layout
    placement_group: PlacementGroup | None
    slots: Mapping[str, RoleSlots]


def _probe_task(use_gpus: bool, cpus: float) -> Any:
    import ray

    # A one-shot task, not an actor: it runs on an already started worker, where an actor per
    # bundle starts a process each (several times slower; docs/benchmarks/placement.md has the figures).
    # It takes a whole bundle, so the probes never wait for one another, and get_gpu_ids() names
    # exactly the bundle's GPU (the logical id on a Ray started with num_gpus=N and no CUDA).
    # max_calls=0 keeps the worker for the next probe instead of Ray's one-call default for GPUs.
    @ray.remote(num_gpus=1 if use_gpus else 0, num_cpus=0 if use_gpus else cpus, max_calls=0)
    def where() -> tuple[str, int | None]:
        gpu_ids = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), (int(gpu_ids[0]) if gpu_ids else None)

    return where


def describe_cluster() -> str:
    """One line per alive node: its address and total / available GPUs and CPUs."""
    import ray

    available = ray.available_resources()
    lines = [
        f"cluster total: {ray.cluster_resources().get('GPU', 0):g} GPU, "
        f"{ray.cluster_resources().get('CPU', 0):g} CPU; "
        f"available: {available.get('GPU', 0):g} GPU, {available.get('CPU', 0):g} CPU"
    ]
    for node in ray.nodes():
        if node.get("Alive"):
            res = node.get("Resources", {})
            gpus, cpus = res.get("GPU", 0), res.get("CPU", 0)
            lines.append(f"  node {node.get('NodeManagerAddress')}: {gpus:g} GPU, {cpus:g} CPU")
    return "\n".join(lines)


def _asked(layout: Layout, spec: PlacementSpec) -> str:
    per = ", ".join(f"{k}={v:g}" for k, v in layout.bundle.items())
    total = ", ".join(f"{v * layout.num_bundles:g} {k}" for k, v in layout.bundle.items())
    tags = "".join(
        f"; the {role}'s bundles on nodes with resource {name!r}" for role, name in spec.node_resources
    )
    return f"{layout.num_bundles} bundles of {{{per}}} (in all {total}) with strategy PACK{tags}"


def create_placement_groups(
    spec: PlacementSpec, timeout_s: float = 60.0, *, resolve: Resolver = socket.gethostbyname
) -> Placements:
    """Create the run's one PACK placement group and hand each role its sorted slots.

    Needs ``ray.init()`` first. Raises ``PlacementTimeoutError`` (a ``TimeoutError``) naming what
    was asked and what the cluster has when the group or its probes are not ready in
    ``timeout_s``; the half-made group is removed first.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}; pass the seconds to wait, e.g. 60")
    if not ray.is_initialized():
        raise RuntimeError("create_placement_groups needs a Ray instance: call ray.init(...) first")
    layout = plan_layout(spec)
    if layout.num_bundles == 0:
        return Placements(layout=layout, placement_group=None, slots=MappingProxyType({}))

    pg = placement_group(bundle_resources(layout, spec), strategy="PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        cluster = describe_cluster()
        remove_placement_group(pg)
        raise PlacementTimeoutError(
            f"placement group not ready after {timeout_s:g} s: asked for {_asked(layout, spec)}; {cluster}"
        )

    probe = _probe_task(spec.use_gpus, spec.cpus_per_bundle)
    refs = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            )
        ).remote()
        for i in range(layout.num_bundles)
    ]
    try:
        where = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        for ref in refs:
            ray.cancel(ref, force=True)
        remove_placement_group(pg)
        raise PlacementTimeoutError(
            f"probing the {layout.num_bundles} bundles of the placement group for their node and GPU id "
            f"took over {timeout_s:g} s; {describe_cluster()}"
        ) from exc

    order = sort_bundles(where, resolve)
    slots: dict[str, RoleSlots] = {}
    for role, part in layout.roles.items():
        picked = _pick(order, part.positions, by_role=bool(spec.node_resources))
        slots[role] = RoleSlots(
            placement_group=pg,
            bundle_indices=tuple(picked),
            gpu_ids=tuple(int(g) for i in picked if (g := where[i][1]) is not None),
            gpu_share=part.gpu_share,
            cpu_share=part.cpu_share,
            node_ips=tuple(where[i][0] for i in picked),
        )
    return Placements(layout=layout, placement_group=pg, slots=MappingProxyType(slots))


def _pick(order: list[int], positions: range, *, by_role: bool) -> list[int]:
    """A role's bundles: its positions in the sorted order; with node resources, the bundles requested
    for it (which carry its resource), in the sorted order among themselves."""
    if not by_role:
        return order[positions.start : positions.stop]
    rank = {index: at for at, index in enumerate(order)}
    return sorted(positions, key=rank.__getitem__)


def remove_placement_groups(placements: Placements) -> None:
    """Remove the run's placement group; calling it again (or with nothing placed) is a no-op."""
    if placements.placement_group is None:
        return
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    pg = placements.placement_group
    if not ray.is_initialized():
        return
    if placement_group_table(pg).get("state") == "REMOVED":
        return
    remove_placement_group(pg)
