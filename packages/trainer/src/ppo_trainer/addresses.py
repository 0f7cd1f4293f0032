"""The address a worker's listeners bind to: the trainer's own rendezvous store and the weight-update
group's store and gloo device. None of them authenticates, so they listen on one address only."""

from __future__ import annotations

import sys

from ppo_weight_sync import node_address

__all__ = ["peer_address"]

LOOPBACK = "127.0.0.1"


def peer_address() -> str:
    """``127.0.0.1`` when every peer is on this machine (the Ray cluster is one node: the role's ranks
    and the engines all run in it), else this node's address as the other nodes see it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        alive = [node for node in ray.nodes() if node.get("Alive")]
        if len(alive) == 1:
            return LOOPBACK
    return node_address()
