"""Ray placement for PPO roles: GPU layout math, placement groups, bundle order.

``plan_layout`` is pure (no Ray); importing this package does not import Ray.
"""

from ppo_placement.groups import (
    Placements,
    PlacementTimeoutError,
    RoleSlots,
    create_placement_groups,
    describe_cluster,
    remove_placement_groups,
)
from ppo_placement.layout import (
    NODE_RESOURCE_SHARE,
    ROLES,
    SHARED_FRACTION,
    Layout,
    RoleLayout,
    bundle_resources,
    plan_layout,
)
from ppo_placement.order import bundle_sort_key, node_key, sort_bundles
from ppo_placement.spec import CriticMode, PlacementSpec

__version__ = "0.2.1"

__all__ = [
    "NODE_RESOURCE_SHARE",
    "ROLES",
    "SHARED_FRACTION",
    "CriticMode",
    "Layout",
    "PlacementSpec",
    "PlacementTimeoutError",
    "Placements",
    "RoleLayout",
    "RoleSlots",
    "__version__",
    "bundle_resources",
    "bundle_sort_key",
    "create_placement_groups",
    "describe_cluster",
    "node_key",
    "plan_layout",
    "remove_placement_groups",
    "sort_bundles",
]
