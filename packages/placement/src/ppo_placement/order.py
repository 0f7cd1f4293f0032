"""Bundle order: by node address as numbers, then GPU id as an int. Pure, no Ray."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

Resolver = Callable[[str], str]


def node_key(node: str, resolve: Resolver = socket.gethostbyname) -> tuple[int, ...]:
    """Numbers that order nodes: an IP's octets (10.0.0.9 before 10.0.0.10, unlike text order).

    A hostname is resolved to its IPv4 address; a name that does not resolve falls back to its
    characters' code points, so the order stays stable and total.
    """
    try:
        return tuple(ipaddress.ip_address(node).packed)
    except ValueError:
        pass
    try:
        return tuple(ipaddress.ip_address(resolve(node)).packed)
    except (OSError, UnicodeError, ValueError):
        return tuple(ord(c) for c in node)


def bundle_sort_key(
    node: str, gpu_id: int | str | None, resolve: Resolver = socket.gethostbyname
) -> tuple[tuple[int, ...], int]:
    """Sort key of one bundle: (node as numbers, GPU id as an int; -1 for a CPU bundle)."""
    return node_key(node, resolve), -1 if gpu_id is None else int(gpu_id)


def sort_bundles(
    probes: list[tuple[str, int | str | None]], resolve: Resolver = socket.gethostbyname
) -> list[int]:
    """Bundle indices in placement order, given each bundle's probed (node, GPU id).

    Ties keep the bundle index order. Each distinct node name is resolved once.
    """
    nodes = {node: node_key(node, resolve) for node in {node for node, _ in probes}}

    def key(i: int) -> tuple[tuple[int, ...], int, int]:
        node, gpu_id = probes[i]
        return nodes[node], -1 if gpu_id is None else int(gpu_id), i

    return sorted(range(len(probes)), key=key)
