"""The TCP sockets a process listens on, read from ``/proc`` (Linux): what a test of "bound to one
address, never every interface" checks."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

__all__ = ["listening_addresses"]

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column


def _decode(hex_address: str) -> tuple[str, int]:
    """``0100007F:1F90`` (little-endian words, as the kernel prints them) -> ``("127.0.0.1", 8080)``."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # The kernel prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port, 16)


def listening_addresses(pid: int | None = None) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` (default: this one) listens on.

    ``0.0.0.0`` or ``::`` as the address means every interface. Raises ``RuntimeError`` off Linux.
    """
    proc = Path("/proc") / str(pid if pid is not None else os.getpid())
    if not (proc / "fd").is_dir():
        raise RuntimeError(f"{proc}/fd is not readable: listening_addresses needs Linux's /proc")
    inodes: set[str] = set()
    for fd in (proc / "fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found: list[tuple[str, int]] = []
    for table in ("tcp", "tcp6"):
        path = proc / "net" / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN and fields[9] in inodes:
                found.append(_decode(fields[1]))
    return sorted(found)
