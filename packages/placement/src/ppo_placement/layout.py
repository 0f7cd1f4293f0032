"""Layout math: which bundles of the one placement group each role gets. Pure, no Ray."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from ppo_placement.spec import PlacementSpec

ROLES: tuple[str, ...] = ("actor", "critic", "rollout")

# How much of its node resource (``PlacementSpec.node_resources``) one bundle asks for: a node tagged
# with 1 of it takes up to 1000 bundles, so the tag chooses nodes without limiting how many bundles fit.
NODE_RESOURCE_SHARE = 0.001

# A role that shares its bundles with another role asks for this fraction of each bundle's GPU
# (and of its CPUs). The three together fill exactly one GPU, so any mix of them fits a bundle.
SHARED_FRACTION: Mapping[str, float] = MappingProxyType({"actor": 0.4, "critic": 0.4, "rollout": 0.2})


@dataclass(frozen=True)
class RoleLayout:
    """One role's bundles: positions ``[offset, offset + count)`` in the sorted bundle order."""

    offset: int
    count: int
    gpu_share: float  # num_gpus each Ray actor of this role asks for (0.0 on CPU-only runs)
    cpu_share: float  # num_cpus each Ray actor of this role asks for

    @property
    def positions(self) -> range:
        return range(self.offset, self.offset + self.count)


@dataclass(frozen=True)
class Layout:
    """Bundles of the placement group and each placed role's part of them.

    ``roles`` holds only roles that get bundles: a run without a critic has no ``"critic"``, an
    external or absent rollout has no ``"rollout"``. ``engine_count`` counts the rollout engines
    of the run, external ones included (0 in train-only runs).
    """

    num_bundles: int
    roles: Mapping[str, RoleLayout]
    engine_count: int
    bundle: Mapping[str, float]  # resources of one bundle, e.g. {"GPU": 1, "CPU": 1.0}

    @property
    def rollout_offset(self) -> int:
        """Where the rollout bundles start; ``num_bundles`` when no rollout is placed (train-only), the
        first index past the trainers' bundles. slime's ``create_placement_groups``
        (slime/ray/placement_group.py) sets ``rollout_offset = 0`` for ``--debug-train-only``, a value it
        never reads there since no engine is placed; this one names no bundle that exists either."""
        rollout = self.roles.get("rollout")
        return self.num_bundles if rollout is None else rollout.offset


def _ranges(spec: PlacementSpec) -> tuple[int, dict[str, tuple[int, int]]]:
    """(num_bundles, role -> (offset, count)) following slime/miles' layout."""
    actor, rollout = spec.actor_gpus, spec.rollout_gpus
    critic = spec.critic_bundles
    if spec.rollout_only:
        # External engines and rollout-only: nothing of ours runs at all (miles' (0, 0)).
        if spec.external_rollout:
            return 0, {}
        return rollout, {"rollout": (0, rollout)}
    roles: dict[str, tuple[int, int]] = {"actor": (0, actor)}
    train_end = actor
    if spec.critic == "shared":
        roles["critic"] = (0, actor)
    elif spec.critic == "dedicated":
        roles["critic"] = (actor, critic)
        train_end = actor + critic
    if spec.train_only or spec.external_rollout:
        return train_end, roles
    if spec.colocate:
        roles["rollout"] = (0, rollout)
        return max(train_end, rollout), roles
    roles["rollout"] = (train_end, rollout)
    return train_end + rollout, roles


def plan_layout(spec: PlacementSpec) -> Layout:
    """Lay the roles of ``spec`` out over one placement group's bundles.

    - disaggregate: actor ``[0, A)``, a dedicated critic ``[A, A+C)``, rollout after them;
    - colocate: ``max(train, rollout)`` bundles, every role at offset 0;
    - a shared critic reuses the actor's bundles and adds none;
    - train-only: no rollout; rollout-only: only the rollout, at 0;
    - external rollout: only the training roles; with rollout-only, no bundles at all.
    """
    num_bundles, ranges = _ranges(spec)
    roles: dict[str, RoleLayout] = {}
    for role, (offset, count) in ranges.items():
        shared = any(
            other != role and offset < o_off + o_count and o_off < offset + count
            for other, (o_off, o_count) in ranges.items()
        )
        fraction = SHARED_FRACTION[role] if shared else 1.0
        roles[role] = RoleLayout(
            offset=offset,
            count=count,
            gpu_share=fraction if spec.use_gpus else 0.0,
            cpu_share=fraction * spec.cpus_per_bundle,
        )
    engine_count = 0 if spec.train_only else spec.rollout_gpus // spec.gpus_per_engine
    bundle: dict[str, float] = {"CPU": float(spec.cpus_per_bundle)}
    if spec.use_gpus:
        bundle = {"GPU": 1.0, **bundle}
    ordered = {role: roles[role] for role in ROLES if role in roles}
    return Layout(
        num_bundles=num_bundles,
        roles=MappingProxyType(ordered),
        engine_count=engine_count,
        bundle=MappingProxyType(bundle),
    )


def bundle_resources(layout: Layout, spec: PlacementSpec) -> list[dict[str, float]]:
    """Each bundle's resources, in request order: ``layout.bundle``, plus ``NODE_RESOURCE_SHARE`` of the
    node resource of every role placed on it (``spec.node_resources``; roles sharing a bundle need a
    node that has all of theirs)."""
    tags = dict(spec.node_resources)
    bundles = []
    for i in range(layout.num_bundles):
        bundle = dict(layout.bundle)
        for role, part in layout.roles.items():
            if role in tags and i in part.positions:
                bundle[tags[role]] = NODE_RESOURCE_SHARE
        bundles.append(bundle)
    return bundles
