"""A stand-in for ``python -m sglang.launch_server``: SGLang's routes, served by the built-in engine.

It takes the arguments we pass to SGLang (unknown ones are ignored), serves ``/health``,
``/generate``, the weight-update routes (through ``WeightReceiver``), pause/continue, flush, the
weight version and the memory routes, with SGLang's response shapes. Every request is appended to
``--standin-record`` (JSON lines) so tests can check routes and payloads. Test knobs:
``--standin-startup-delay S`` (no answer for S seconds), ``--standin-exit-code C`` (exit at once),
``--standin-ignore-sigterm`` (so that stopping needs SIGKILL).

Run: ``python -m ppo_rollout.testing.sglang_standin --model-path DIR --port 30000``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ppo_weight_sync.routes import serve_engine_route

if TYPE_CHECKING:  # imported lazily: the failure knobs act before torch is loaded
    from ..config import SamplingConfig
    from ..engine.builtin import BuiltinEngine


def _sampling(sp: dict[str, Any]) -> tuple[SamplingConfig, int]:
    from ..config import SamplingConfig

    top_k = int(sp.get("top_k", -1))
    cfg = SamplingConfig(
        temperature=float(sp.get("temperature", 1.0)),
        top_p=float(sp.get("top_p", 1.0)),
        top_k=0 if top_k < 0 else top_k,
        max_new_tokens=int(sp.get("max_new_tokens", 128)),
        stop_token_ids=tuple(int(t) for t in sp.get("stop_token_ids") or ()),
    )
    return cfg, int(sp.get("sampling_seed") or 0)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, payload: Any, *, text: bool = False) -> None:
        body = (payload if text else json.dumps(payload)).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def do_GET(self) -> None:
        self._route("GET", None)

    def do_POST(self) -> None:
        try:
            body = self._body()
        except ValueError as exc:
            self._send(400, {"object": "error", "message": f"bad JSON: {exc}", "code": 400})
            return
        self._route("POST", body)

    def _route(self, method: str, body: Any) -> None:
        path = self.path.split("?", 1)[0]
        self.server.record({"method": method, "path": path, "body": body})
        engine = self.server.engine
        try:
            if path in ("/health", "/health_generate"):
                self._send(200, "", text=True)
            elif path == "/generate":
                self._generate(body or {})
            elif (answer := serve_engine_route(engine, method, path, body)) is not None:
                if isinstance(answer.body, str):
                    self._send(answer.status, answer.body, text=True)
                else:
                    self._send(answer.status, answer.body)
            else:
                self._send(404, {"detail": "Not Found"})
        except Exception as exc:  # a server answers; it does not die
            self._send(400, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

    def _generate(self, body: dict[str, Any]) -> None:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            self._send(400, {"error": {"message": "input_ids is required"}})
            return
        single = not isinstance(ids[0], list)
        batch = [ids] if single else ids
        params = body.get("sampling_params") or {}
        per_req = params if isinstance(params, list) else [params] * len(batch)
        results = []
        for prompt, sp in zip(batch, per_req, strict=True):
            cfg, seed = _sampling(sp)
            out = self.server.engine.generate([prompt], cfg, seed=seed)[0]
            meta: dict[str, Any] = {
                "finish_reason": {"type": out.finish_reason},
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out.token_ids),
                "weight_version": self.server.engine.get_weight_version(),
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(out.log_probs, out.token_ids, strict=True)
                ]
            results.append({"text": "", "output_ids": list(out.token_ids), "meta_info": meta})
        self._send(200, results[0] if single else results)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], engine: BuiltinEngine, record_path: str | None) -> None:
        super().__init__(addr, _Handler)
        self.engine = engine
        self._record_path = record_path
        self._record_lock = threading.Lock()

    def record(self, entry: dict[str, Any]) -> None:
        if self._record_path is None:
            return
        with self._record_lock, open(self._record_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--base-gpu-id", type=int, default=0)
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument("--standin-record", default=None)
    parser.add_argument("--standin-startup-delay", type=float, default=0.0)
    parser.add_argument("--standin-exit-code", type=int, default=None)
    parser.add_argument("--standin-ignore-sigterm", action="store_true")
    args, _unknown = parser.parse_known_args(argv)
    if args.standin_exit_code is not None:
        print(f"stand-in: exiting with code {args.standin_exit_code} as asked", flush=True)
        return int(args.standin_exit_code)
    if args.standin_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.standin_startup_delay:
        time.sleep(args.standin_startup_delay)
    from ..engine.builtin import BuiltinEngine

    engine = BuiltinEngine(args.model_path, name=f"standin:{args.port}", torch_threads=1)
    server = _Server((args.host, args.port), engine, args.standin_record)
    print(f"stand-in SGLang server on http://{args.host}:{args.port} argv={sys.argv[1:]}", flush=True)
    try:
        server.serve_forever(poll_interval=0.1)
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
