"""Which Ray node each role's processes run on (``nodes.json`` in the run folder), and a node that left
the cluster named in the run's stop, with the roles it ran.

A lost node kills every process on it at once; what the driver sees first is one of them failing
(a dead actor, a lost object, a broken weight-update group). ``name_lost_nodes`` turns that failure into
``NodeLostError`` when one of the roles' nodes is dead, so the run's one-line stop (``stops.py``) says
"node 10.0.0.3 left the Ray cluster; it ran the critic rank 0, engine 0" instead of one victim's error.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.exceptions
from rich.console import Console

from ppo_driver.faults import Interrupted
from ppo_driver.processes import _handles
from ppo_driver.roles import Roles
from ppo_placement import node_key

NODES_FILE = "nodes.json"
# A node that crashed is known dead once Ray's health checks give up on it (about 15 s with Ray's
# defaults: health_check_period_ms 3000 x health_check_failure_threshold 5); a node removed in order
# is known at once. A process death on a live node waits this long before it is reported as itself.
NODE_DEATH_WAIT_S = 30.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placed:
    """One process of a role: ``label`` ("actor rank 0", "engine 1"), and its node's id and address."""

    label: str
    node_id: str
    node_ip: str


class NodeLostError(RuntimeError):
    """A node running some of the run's processes left the Ray cluster."""

    def __init__(self, node_ip: str, node_id: str, labels: list[str]) -> None:
        super().__init__(
            f"node {node_ip} (id {node_id[:12]}) left the Ray cluster; it ran the {', '.join(labels)}"
        )
        self.node_ip = node_ip
        self.node_id = node_id
        self.labels = labels


def _where(_instance: Any) -> tuple[str, str]:
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def locate(roles: Roles, timeout_s: float) -> list[Placed]:
    """Ask every role's process where it runs (Ray's ``__ray_call__``); roles made by another factory
    than ``create_roles`` are listed as far as they are known."""
    placed: list[Placed] = []
    for role, actors in _handles(roles).items():
        refs = [a.__ray_call__.remote(_where) for a in actors]
        for rank, (node_id, node_ip) in enumerate(ray.get(refs, timeout=timeout_s)):
            label = f"engine {rank}" if role == "rollout" else f"{role} rank {rank}"
            placed.append(Placed(label, node_id, node_ip))
    return placed


def by_node(placed: list[Placed]) -> dict[str, list[Placed]]:
    """Node id -> its processes, the nodes in address order (as the placement orders bundles)."""
    nodes: dict[str, list[Placed]] = {}
    for p in sorted(placed, key=lambda p: node_key(p.node_ip)):
        nodes.setdefault(p.node_id, []).append(p)
    return nodes


def record(roles: Roles, run_dir: Path, timeout_s: float, console: Console) -> list[Placed]:
    """Write ``nodes.json``; on more than one node, print one line of which roles run where."""
    try:
        placed = locate(roles, timeout_s)
    except Exception as exc:  # a diagnostic: the run's own calls report a dead worker properly
        log.warning("nodes.json: the roles' nodes are unknown (%s)", exc)
        placed = []
    nodes = by_node(placed)
    listing = [
        {"node_ip": ps[0].node_ip, "node_id": node_id, "roles": [p.label for p in ps]}
        for node_id, ps in nodes.items()
    ]
    (run_dir / NODES_FILE).write_text(json.dumps({"nodes": listing}, indent=1) + "\n")
    if len(nodes) > 1:
        where = "; ".join(f"{n['node_ip']}: {', '.join(n['roles'])}" for n in listing)
        console.print(f"roles by node: {where}", highlight=False)
    return placed


def _dead(node_ids: set[str]) -> list[str]:
    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return sorted(node_ids - alive)


def _ray_failure(exc: BaseException) -> bool:
    """A failure Ray reported about a process or an object (not a role's own exception)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayError) and not isinstance(seen, ray.exceptions.RayTaskError):
            return True
        if (
            isinstance(seen, ray.exceptions.RayTaskError)
            and seen.cause is not None
            and seen.cause is not seen
        ):
            seen = seen.cause
            continue
        seen = seen.__cause__ or seen.__context__
    return False


def lost_node(
    placed: list[Placed], exc: BaseException, wait_s: float = NODE_DEATH_WAIT_S
) -> NodeLostError | None:
    """The first (by address) of the roles' nodes that is dead; after a Ray failure on a run of several
    nodes, waits up to ``wait_s`` for Ray to declare the node dead. None when every node is alive."""
    nodes = by_node(placed)
    if not nodes:
        return None
    deadline = time.monotonic() + (wait_s if len(nodes) > 1 and _ray_failure(exc) else 0.0)
    while True:
        try:
            dead = _dead(set(nodes))
        except Exception as probe:  # the report of the original failure matters more
            log.warning("could not ask Ray which nodes are alive: %s", probe)
            return None
        if dead:
            first = min(dead, key=lambda node_id: node_key(nodes[node_id][0].node_ip))
            ps = nodes[first]
            return NodeLostError(ps[0].node_ip, first, [p.label for p in ps])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.5)


@contextmanager
def name_lost_nodes(placed: list[Placed]) -> Iterator[None]:
    """A failure inside the block becomes ``NodeLostError`` (caused by it) when a role's node is gone."""
    try:
        yield
    except Interrupted:  # the user's stop, at a safe point: said as it is
        raise
    except Exception as exc:
        lost = lost_node(placed, exc)
        if lost is None:
            raise
        raise lost from exc
