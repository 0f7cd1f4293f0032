"""Addresses and ports, once for every package: a free TCP port, and this host's address for peers."""

from __future__ import annotations

import socket
import sys

__all__ = ["free_port", "listen_socket", "local_address_toward", "node_address"]


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


def local_address_toward(peer: str) -> str:
    """The address of this host's interface that reaches ``peer`` (what ``peer`` sees us as).

    ``127.0.0.1`` for a loopback peer (everything on one machine); otherwise the source address the
    routing table picks for ``peer``. A listener bound to it is reachable by ``peer`` and by no other
    interface's network.
    """
    infos = socket.getaddrinfo(peer, None, type=socket.SOCK_DGRAM)
    family, _, _, _, sockaddr = infos[0]
    if family == socket.AF_INET and str(sockaddr[0]).startswith("127."):
        return "127.0.0.1"
    if family == socket.AF_INET6 and sockaddr[0] == "::1":
        return "::1"
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        # connect() on UDP sends nothing; it only selects the outgoing interface.
        sock.connect((sockaddr[0], 1))
        return str(sock.getsockname()[0])


def listen_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``address`` only (never every interface); ``port`` 0 lets the OS pick.

    Raises ``ValueError`` naming the address when it is not one of this host's (bind fails).
    """
    infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {address}:{port} ({exc.strerror or exc}); pass an address of this host "
            "that the peers reach (127.0.0.1 when every peer runs on this machine)"
        ) from exc
    return sock
