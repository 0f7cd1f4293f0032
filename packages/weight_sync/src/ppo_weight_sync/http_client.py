"""JSON over HTTP/1.1 with one kept-alive connection per calling thread (standard library only).

A weight update makes a handful of small control calls (pause, flush, the metadata call, continue) in
series; opening a TCP connection for each (as ``urllib`` does) costs more than the call itself. Each
thread keeps its own ``http.client`` connection: a connection is never shared between two requests in
flight, and a server that closes it (HTTP/1.0, ``Connection: close``, an idle timeout, a restart) only
costs a new connection on the next request. Requests are never retried: a weight operation is not safe
to send twice, so an error on a connection the server dropped is reported like any unreachable server.
"""

from __future__ import annotations

import http.client
import json
import select
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

__all__ = ["HttpReply", "JsonHttpClient"]


@dataclass(frozen=True, slots=True)
class HttpReply:
    """Status and decoded body (JSON, else text) of one answered request."""

    status: int
    body: Any


class JsonHttpClient:
    """Requests to ``base_url`` (``http[s]://host[:port][/prefix]``); thread-safe.

    ``timeout_s`` bounds connecting and each socket read or write of a request. Transport failures raise
    ``OSError`` (``TimeoutError`` for a timeout) or ``http.client.HTTPException``; the caller names the
    server in its own error.
    """

    def __init__(self, base_url: str, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"base_url must look like http://host:port, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port
        self._prefix = parts.path.rstrip("/")
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> HttpReply:
        """Send one request and read the whole answer, whatever its status."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn = self._connection()
        try:
            conn.request(method, self._prefix + route, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except BaseException:
            # The connection's state is unknown (a late answer could still arrive on it): never reuse it.
            self._discard(conn)
            raise
        if resp.will_close:
            self._discard(conn)
        return HttpReply(resp.status, _decode(raw))

    def close(self) -> None:
        """Close every connection; later requests open new ones."""
        with self._lock:
            conns, self._open = self._open, set()
        for conn in conns:
            conn.close()

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and _dropped_by_peer(conn):
            self._discard(conn)
            conn = None
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=self.timeout_s)
            self._local.conn = conn
        with self._lock:
            self._open.add(conn)  # again after close(): http.client reopens a closed connection on use
        return conn

    def _discard(self, conn: http.client.HTTPConnection) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._lock:
            self._open.discard(conn)


def _dropped_by_peer(conn: http.client.HTTPConnection) -> bool:
    """True when an idle kept-alive connection was closed by the server (its socket reads as ready: EOF).

    Checked before each reuse so that a server's idle timeout does not fail the next request.
    """
    sock = conn.sock
    if sock is None:
        return False  # not connected yet (or closed by http.client): the next request connects
    try:
        ready, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(ready)


def _decode(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
