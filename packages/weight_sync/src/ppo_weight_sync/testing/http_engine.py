"""An HTTP server on 127.0.0.1 that serves SGLang's weight routes for a :class:`TensorEngine`.

Routes (SGLang's paths and JSON bodies): ``POST /init_weights_update_group``,
``/update_weights_from_distributed``, ``/update_weights_from_tensor``, ``/destroy_weights_update_group``
(reply ``{"success", "message"}``, HTTP 400 on failure), ``POST /pause_generation``, ``/continue_generation``,
``GET|POST /flush_cache``, ``GET /get_weight_version`` (``{"weight_version": ...}``), ``GET /health``,
``POST /release_memory_occupation``, ``/resume_memory_occupation``; plus, for tests, ``GET /state``
(paused, flushes, weight_version, checksum, ipc_mappings, and in SGLang mode ``tp_checksums``: TP ranks
1..tp_size-1's checksums of their shards) and ``POST /set_load_delay`` (``{"seconds": s}``).

In a process: ``server = serve(engine)``; ``server.url``; ``server.shutdown()``.
As its own process: ``proc, url = start_process(spec, seed=0)`` runs
``python -m ppo_weight_sync.testing.http_engine --spec JSON --seed N`` and waits for its ``READY <url>`` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import IO, Any

from ppo_weight_sync.buckets import dtype_name
from ppo_weight_sync.routes import RouteResult, serve_engine_route, validation_error
from ppo_weight_sync.testing.engine import Spec, TensorEngine
from ppo_weight_sync.testing.sglang_like import SGLangReceiver, SGLangServerState
from ppo_weight_sync.testing.sglang_tp import TPRanks, start_remote_ranks

__all__ = ["ClosingHTTPServer", "EngineHTTPServer", "serve", "start_process", "wait_until_ready"]


class ClosingHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server whose ``shutdown()`` also closes the kept-alive client connections.

    ``ThreadingHTTPServer.shutdown`` only stops accepting: a handler thread would go on serving a kept-alive
    connection, so a stopped test server would still answer. Closing them makes a stopped server look
    like a dead one to its clients.
    """

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._clients: set[socket.socket] = set()
        self._clients_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._clients_lock:
            self._clients.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._clients_lock:
            self._clients.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away (timed out, killed) is not the server's error: no traceback for it.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def shutdown(self) -> None:
        super().shutdown()
        with self._clients_lock:
            clients, self._clients = self._clients, set()
        for sock in clients:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class EngineHTTPServer(ClosingHTTPServer):
    def __init__(
        self,
        engine: TensorEngine,
        host: str,
        port: int,
        extra_routes: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None,
        sglang_version: str | None = None,
        tp_size: int = 1,
        tp_one_device: bool = False,
    ) -> None:
        super().__init__((host, port), _Handler)
        self.engine = engine
        self.extra_routes = dict(extra_routes or {})
        # SGLang mode: the weight and control routes are an SGLang server's of that version (its receiver
        # and its server-side rules, testing.sglang_like) around this engine's weights.
        self.sglang: SGLangServerState | None = None
        if sglang_version is not None:
            receiver = SGLangReceiver(
                engine.load, engine.device, version=sglang_version, timeout_s=engine.timeout_s
            )
            # TP ranks 1.. in processes of their own, holding their shards of the engine's tensors
            remotes = start_remote_ranks(
                {n: (dtype_name(t.dtype), list(t.shape)) for n, t in engine.weights.items()},
                version=sglang_version,
                tp_size=tp_size,
                device=str(engine.device),
                timeout_s=engine.timeout_s,
                one_device=tp_one_device,
            )
            ranks = TPRanks(receiver, remotes, timeout_s=engine.timeout_s)
            self.sglang = SGLangServerState(sglang_version, ranks, _TensorHooks(engine), _die)
        elif tp_size != 1:
            raise ValueError(f"tp_size {tp_size} needs sglang_version (TP ranks are an SGLang server's)")

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> RouteResult | None:
        if self.sglang is not None:
            return self.sglang.handle(method, path, body)
        return serve_engine_route(self.engine, method, path, body)

    def weight_version(self) -> str | None:
        if self.sglang is not None:
            return self.sglang.receiver.weight_version
        return self.engine.get_weight_version()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: EngineHTTPServer
    # Keep connections alive like SGLang's uvicorn server (every answer carries Content-Length), and send
    # each answer without waiting on Nagle: headers and body go out in two writes, and a kept-alive
    # client's delayed ACK would otherwise hold the body back ~40 ms.
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read stdout
        return

    def _send(self, status: int, body: Any) -> None:
        raw = (json.dumps(body) if not isinstance(body, str) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if not isinstance(body, str) else "text/plain")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return {}
        data = json.loads(self.rfile.read(length))
        return data if isinstance(data, dict) else {}

    def do_GET(self) -> None:
        self._guarded(self._get)

    def do_POST(self) -> None:
        self._guarded(self._post)

    def _guarded(self, handle: Callable[[], None]) -> None:
        # An unexpected error answers 500 with its message rather than dropping the connection, so the
        # caller sees what went wrong (e.g. a timed-out wait for the GPU) instead of a bare reset.
        try:
            handle()
        except Exception as exc:
            with contextlib.suppress(OSError):
                self._send(500, {"success": False, "message": f"{type(exc).__name__}: {exc}"})

    def _get(self) -> None:
        engine = self.server.engine
        answer = self.server.answer("GET", self.path, None)
        if answer is not None:
            self._send(answer.status, answer.body)
        elif self.path == "/health":
            self._send(200, "")
        elif self.path == "/state":
            sglang = self.server.sglang
            tp = sglang.ranks.remote_checksums() if sglang is not None else []
            pids = [r.process.pid for r in sglang.ranks.remotes] if sglang is not None else []
            self._send(
                200,
                {
                    **engine.state(),
                    "weight_version": self.server.weight_version(),
                    "tp_checksums": tp,
                    "tp_pids": pids,
                },
            )
        else:
            self._send(404, {"detail": "Not Found"})

    def _post(self) -> None:
        engine = self.server.engine
        try:
            body = self._body()
        except ValueError as exc:
            refusal = validation_error(f"bad JSON: {exc}")
            self._send(refusal.status, refusal.body)
            return
        answer = self.server.answer("POST", self.path, body)
        if answer is not None:
            self._send(answer.status, answer.body)
        elif self.path in self.server.extra_routes:
            try:
                self._send(200, self.server.extra_routes[self.path](body))
            except Exception as exc:
                self._send(400, {"success": False, "message": f"{type(exc).__name__}: {exc}"})
        elif self.path == "/set_load_delay":
            engine.set_load_delay(float(body.get("seconds", 0.0)))
            self._send(200, {"success": True, "message": "ok"})
        else:
            self._send(404, {"detail": "Not Found"})


class _TensorHooks:
    """An engine that only holds weights, as an SGLang server's scheduler sees it: never busy."""

    def __init__(self, engine: TensorEngine) -> None:
        self.engine = engine

    def pause(self, mode: str) -> None:
        self.engine.pause_generation()

    def resume(self) -> None:
        self.engine.continue_generation()

    def running_requests(self) -> int:
        return 0

    def waiting_requests(self) -> int:
        return 0

    def flush(self) -> None:
        self.engine.flush_cache()

    def release(self, tags: Sequence[str]) -> None:
        return None

    def restore(self, tags: Sequence[str]) -> None:
        return None


def _die(message: str) -> None:
    """Where SGLang's scheduler raises, the server goes down: this process exits."""
    print(f"scheduler died: {message}", flush=True)
    os._exit(1)


def serve(
    engine: TensorEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    extra_routes: Mapping[str, Callable[[dict[str, Any]], Any]] | None = None,
) -> EngineHTTPServer:
    """Serve ``engine`` on a background thread; returns the server (``.url``, ``.shutdown()``).

    ``extra_routes`` maps more POST paths to functions of the JSON body (their return value is the reply).
    """
    server = EngineHTTPServer(engine, host, port, extra_routes)
    threading.Thread(target=server.serve_forever, name="http-engine", daemon=True).start()
    return server


def start_process(
    spec: Spec,
    seed: int | None = 0,
    *,
    device: str = "cpu",
    timeout_s: float = 60.0,
    group_timeout_s: float = 60.0,
    load_delay_s: float = 0.0,
    env: dict[str, str] | None = None,
    sglang_version: str | None = None,
    tp_size: int = 1,
    tp_one_device: bool = False,
) -> tuple[subprocess.Popen[str], str]:
    """Start a server process for a TensorEngine of ``spec``; returns ``(process, base_url)``.

    ``tp_one_device``: SGLang mode's TP ranks all on ``device`` (see ``sglang_tp.start_remote_ranks``).
    ``env`` is added to this process's environment (e.g. ``{"CUDA_VISIBLE_DEVICES": "1"}``). The caller
    owns the process: ``proc.kill(); proc.wait()`` when done.
    """
    cmd = [
        sys.executable,
        "-m",
        "ppo_weight_sync.testing.http_engine",
        "--spec",
        json.dumps(dict(spec)),
        "--seed",
        str(-1 if seed is None else seed),
        "--device",
        device,
        "--group-timeout",
        str(group_timeout_s),
        "--load-delay",
        str(load_delay_s),
        *(["--sglang-version", sglang_version] if sglang_version else []),
        *(["--tp-size", str(tp_size)] if tp_size != 1 else []),
        *(["--tp-one-device"] if tp_one_device else []),
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=full_env)

    def echo(line: str) -> None:
        sys.stdout.write(f"[engine {proc.pid}] {line}\n")
        sys.stdout.flush()

    return proc, wait_until_ready(proc, timeout_s, echo)


def wait_until_ready(proc: subprocess.Popen[str], timeout_s: float, echo: Callable[[str], None]) -> str:
    """Wait for a server process's ``READY <url>`` line on its stdout; returns the URL.

    Every other line goes to ``echo`` (without its newline), before READY and after: a pipe nobody reads
    fills up (64 KiB) and then blocks whichever server thread writes next, e.g. NCCL's own log lines.
    A process that exits first raises ``RuntimeError``; no READY within ``timeout_s`` kills the process
    and raises ``TimeoutError``.
    """
    stream = proc.stdout
    if stream is None:
        raise ValueError("wait_until_ready: start the process with stdout=subprocess.PIPE, text=True")
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"http engine process exited with {proc.returncode} before it was ready")
        if sel.select(timeout=0.1):
            line = stream.readline()
            if line.startswith("READY "):
                _forward_output(proc, stream, echo)
                return line.split()[1]
            if line:
                echo(line.rstrip())
    proc.kill()
    raise TimeoutError(f"http engine process printed no READY line within {timeout_s:g} s")


def _forward_output(proc: subprocess.Popen[str], stream: IO[str], echo: Callable[[str], None]) -> None:
    """Keep reading the server's stdout after READY, on a daemon thread."""

    def pump() -> None:
        with contextlib.suppress(ValueError, OSError):
            for line in stream:
                echo(line.rstrip())

    threading.Thread(target=pump, name=f"engine-{proc.pid}-stdout", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--spec", required=True, help='JSON {name: [dtype, shape]}, e.g. {"w": ["float32", [4, 4]]}'
    )
    parser.add_argument("--seed", type=int, default=0, help="-1: zeros")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--group-timeout", type=float, default=60.0)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--sglang-version", default=None, help="serve as an SGLang server of this version")
    parser.add_argument("--tp-size", type=int, default=1, help="SGLang mode: TP ranks (1.. in processes)")
    parser.add_argument("--tp-one-device", action="store_true", help="SGLang mode: every TP rank on --device")
    args = parser.parse_args(argv)
    engine = TensorEngine(
        json.loads(args.spec),
        seed=None if args.seed < 0 else args.seed,
        device=args.device,
        timeout_s=args.group_timeout,
        load_delay_s=args.load_delay,
    )
    server = EngineHTTPServer(
        engine,
        args.host,
        args.port,
        sglang_version=args.sglang_version,
        tp_size=args.tp_size,
        tp_one_device=args.tp_one_device,
    )
    print(f"READY {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
