"""What the rollout manager needs from the placement package's ``RoleSlots`` (no dependency on it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

__all__ = ["EngineSlots", "actor_options"]


class EngineSlots(Protocol):
    """A role's bundles in order; ``gpu_ids`` is empty on CPU-only runs."""

    @property
    def placement_group(self) -> Any: ...
    @property
    def bundle_indices(self) -> Sequence[int]: ...
    @property
    def gpu_ids(self) -> Sequence[int]: ...
    @property
    def gpu_share(self) -> float: ...


def actor_options(slots: EngineSlots | None, bundle: int, num_gpus: float) -> dict[str, Any]:
    """Ray options that put an actor on bundle ``bundle`` of ``slots`` (anywhere when ``slots`` is None)."""
    # num_cpus=0: the engine shares its bundle's CPUs with whatever else the bundle holds (colocated
    # trainers); asking for a CPU could leave a CPU-only bundle unable to fit both.
    options: dict[str, Any] = {"num_cpus": 0, "num_gpus": num_gpus}
    if slots is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=slots.placement_group,
            placement_group_bundle_index=slots.bundle_indices[bundle],
        )
    return options
