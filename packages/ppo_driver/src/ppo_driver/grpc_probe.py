"""Whether a TCP address answers as a gRPC server, as Ray's GCS and its client server do.

Any HTTP/2 server's first frame is a SETTINGS frame (RFC 9113, section 3.4): a client that sends the
connection preface and its own empty SETTINGS gets one back at once. A port of another service (a web
server on HTTP/1, a database, a silent listener) answers something else or nothing, and Ray itself
would retry it for minutes.
"""

from __future__ import annotations

import socket

__all__ = ["answers_http2"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # length 0, type SETTINGS (4), no flags, stream 0
FRAME_HEADER = 9
SETTINGS = 4


def answers_http2(sock: socket.socket, timeout_s: float) -> bool:
    """Send the HTTP/2 preface on a connected ``sock``; True when a SETTINGS frame on stream 0 comes
    back within ``timeout_s``. False on silence, another protocol's bytes or a closed connection."""
    sock.settimeout(timeout_s)
    try:
        sock.sendall(PREFACE + EMPTY_SETTINGS)
        header = b""
        while len(header) < FRAME_HEADER:
            chunk = sock.recv(FRAME_HEADER - len(header))
            if not chunk:
                return False
            header += chunk
    except OSError:  # a timeout included
        return False
    return header[3] == SETTINGS and int.from_bytes(header[5:9], "big") & 0x7FFFFFFF == 0
