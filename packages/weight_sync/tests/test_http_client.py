"""JsonHttpClient against real HTTP servers on 127.0.0.1: kept-alive reuse, servers that close, timeouts."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from ppo_weight_sync import EngineTimeoutError, EngineUnavailableError, HttpEngineEndpoint
from ppo_weight_sync.http_client import JsonHttpClient
from ppo_weight_sync.testing.http_engine import ClosingHTTPServer


class _Server(ClosingHTTPServer):
    allow_reuse_address = True

    def __init__(self, port: int, protocol: str) -> None:
        handler = type("Handler", (_Handler,), {"protocol_version": protocol})
        super().__init__(("127.0.0.1", port), handler)
        self.peers: list[tuple[str, int]] = []  # client address of every request: one port per connection
        self.paths: list[str] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        self._answer(None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self._answer(json.loads(self.rfile.read(length)) if length else None)

    def _answer(self, body: Any) -> None:
        self.server.peers.append(self.client_address)
        self.server.paths.append(self.path)
        if self.path.endswith("/slow"):
            time.sleep(1.0)
        if self.path.endswith("/text"):
            status, raw = 200, b"Cache flushed.\n"
        elif self.path.endswith("/refuse"):
            status, raw = 400, json.dumps({"success": False, "message": "no such group"}).encode()
        elif self.path.endswith("/boom"):
            status, raw = 500, b"Internal Server Error"
        else:
            status, raw = 200, json.dumps({"echo": body, "path": self.path}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def keep_alive() -> Iterator[_Server]:
    server = _Server(0, "HTTP/1.1")
    yield server
    server.stop()


def test_sequential_requests_share_one_connection(keep_alive: _Server) -> None:
    client = JsonHttpClient(keep_alive.url, timeout_s=5)
    replies = [client.request("POST", "/echo", {"i": i}) for i in range(5)]
    assert [r.body["echo"] for r in replies] == [{"i": i} for i in range(5)]
    assert {r.status for r in replies} == {200}
    assert len(set(keep_alive.peers)) == 1, keep_alive.peers
    client.close()


def test_each_thread_has_its_own_connection(keep_alive: _Server) -> None:
    client = JsonHttpClient(keep_alive.url, timeout_s=5)

    def three_requests() -> None:
        for _ in range(3):
            client.request("GET", "/x")

    threads = [threading.Thread(target=three_requests) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(keep_alive.peers) == 9
    assert len(set(keep_alive.peers)) == 3, keep_alive.peers
    client.close()


def test_a_server_that_closes_every_connection_still_works() -> None:
    server = _Server(0, "HTTP/1.0")  # answers, then closes: http.client sees will_close
    try:
        client = JsonHttpClient(server.url, timeout_s=5)
        assert [client.request("GET", f"/n{i}").body["path"] for i in range(3)] == ["/n0", "/n1", "/n2"]
        assert len(set(server.peers)) == 3
    finally:
        server.stop()


def test_a_restarted_server_is_reached_on_a_fresh_connection(keep_alive: _Server) -> None:
    client = JsonHttpClient(keep_alive.url, timeout_s=5)
    port = keep_alive.server_address[1]
    assert client.request("GET", "/before").status == 200
    keep_alive.stop()  # closes the kept-alive connection from the server's side
    time.sleep(0.1)
    again = _Server(port, "HTTP/1.1")
    try:
        assert client.request("GET", "/after").body["path"] == "/after"
        assert again.paths == ["/after"]
    finally:
        again.stop()


def test_statuses_and_text_bodies_pass_through(keep_alive: _Server) -> None:
    client = JsonHttpClient(keep_alive.url + "/prefix/", timeout_s=5)
    text = client.request("POST", "/text")
    assert (text.status, text.body) == (200, "Cache flushed.\n")
    refused = client.request("POST", "/refuse", {})
    assert (refused.status, refused.body) == (400, {"success": False, "message": "no such group"})
    assert client.request("GET", "/boom").status == 500
    assert keep_alive.paths == ["/prefix/text", "/prefix/refuse", "/prefix/boom"]
    assert len(set(keep_alive.peers)) == 1  # answers of any status keep the connection


def test_a_timeout_drops_the_connection_and_the_next_request_works(keep_alive: _Server) -> None:
    client = JsonHttpClient(keep_alive.url, timeout_s=0.3)
    with pytest.raises(TimeoutError):
        client.request("GET", "/slow")
    # The slow answer must not be read as the answer to the next request.
    assert client.request("GET", "/fast").body["path"] == "/fast"
    assert len(set(keep_alive.peers)) == 2


def test_close_then_request_reconnects(keep_alive: _Server) -> None:
    client = JsonHttpClient(keep_alive.url, timeout_s=5)
    client.request("GET", "/a")
    client.close()
    assert client.request("GET", "/b").body["path"] == "/b"
    assert len(set(keep_alive.peers)) == 2


@pytest.mark.parametrize("url", ["127.0.0.1:80", "ftp://host", "http://"])
def test_bad_base_url_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="base_url"):
        JsonHttpClient(url, timeout_s=1)


def test_endpoint_maps_statuses_to_replies_and_errors(keep_alive: _Server) -> None:
    ep = HttpEngineEndpoint(keep_alive.url, name="e0", timeout_s=0.3)
    assert ep.request("POST", "/refuse") == {"success": False, "message": "no such group"}
    with pytest.raises(EngineUnavailableError, match=r"e0.*HTTP 500"):
        ep.request("GET", "/boom")
    with pytest.raises(EngineTimeoutError, match="e0"):
        ep.request("GET", "/slow")
    port = keep_alive.server_address[1]
    keep_alive.stop()
    with pytest.raises(EngineUnavailableError, match=r"e0.*unreachable"):
        HttpEngineEndpoint(f"http://127.0.0.1:{port}", name="e0", timeout_s=1).request("GET", "/x")
    ep.close()
