"""Addresses and ports, once for every package: a free TCP port, and this host's address for peers."""

from __future__ import annotations

import socket
import sys

__all__ = ["free_port", "node_address"]


def free_port(address: str = "") -> int:
    """A TCP port that is free on ``address`` right now (the OS picks it; '' means every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


def node_address() -> str:
    """This host's address as other hosts see it, else ``127.0.0.1``.

    Ray's node address when this process already uses Ray (so the trainer and its engines agree with
    the addresses Ray reports); otherwise the interface of the default route. Ray is never imported here.
    """
    ray = sys.modules.get("ray")
    if ray is not None:
        try:
            return str(ray.util.get_node_ip_address())
        except Exception:  # Ray without its util module loaded, or no network: the socket lookup below
            pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            # connect() on UDP sends nothing; it only selects the outgoing interface.
            sock.connect(("10.255.255.255", 1))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1"
