"""The recording proxy and the comparison behind the replay test: what counts as a different answer."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ppo_rollout.engine.sglang import SGLangClient
from ppo_rollout.testing.sglang_record import (
    RecordingProxy,
    StepRecord,
    differences,
    normalise,
    read_fixtures,
    write_fixtures,
)

GENERATED = [
    {
        "text": "ab",
        "output_ids": [3, 4],
        "meta_info": {
            "id": "f00",
            "finish_reason": {"type": "length", "length": 2},
            "completion_tokens": 2,
            "e2e_latency": 0.25,
            "output_token_logprobs": [[-0.5, 3, None], [-1.5, 4, None]],
        },
    }
]


def test_normalise_hides_what_changes_from_run_to_run() -> None:
    n = normalise({"meta_info": {"id": "x", "e2e_latency": 0.1}, "serialized_named_tensors": ["QUJD"]})
    assert n == {
        "meta_info": {"id": "<str>", "e2e_latency": "<float>"},
        "serialized_named_tensors": ["<base64>"],
    }
    long = normalise(list(range(20)))
    assert long == {"$len": 20, "$head": [0, 1, 2]}
    assert normalise(n) == n  # idempotent: a fixture normalises to itself
    assert normalise(long) == long


def test_differences_catch_keys_types_statuses_and_deterministic_values() -> None:
    step = StepRecord("generate")
    recorded = normalise(GENERATED)
    same = json.loads(json.dumps(GENERATED))
    same[0]["meta_info"]["id"], same[0]["meta_info"]["e2e_latency"] = "other", 9.0
    same[0]["output_ids"] = [7, 8]  # token values are not deterministic: only their type counts
    assert differences(recorded, same, step) == []
    wrong = json.loads(json.dumps(GENERATED))
    wrong[0]["meta_info"]["finish_reason"]["type"] = "stop"  # under an exact key: its whole value counts
    wrong[0]["meta_info"]["cached_tokens"] = 0  # a key the real server does not send
    del wrong[0]["text"]  # a key it does send
    wrong[0]["meta_info"]["output_token_logprobs"][0][0] = 0  # an int where SGLang sends a float
    found = "\n".join(differences(recorded, wrong, step))
    assert "0.meta_info.finish_reason.type: 'stop', recorded 'length'" in found
    assert "keys ['cached_tokens'] not in the recording" in found
    assert "keys ['text'] missing" in found
    assert "0.meta_info.output_token_logprobs.0.0: int" in found
    loose = StepRecord("generate_stop", loose=["*.meta_info.finish_reason"])
    relaxed = json.loads(json.dumps(GENERATED))
    relaxed[0]["meta_info"]["finish_reason"]["type"] = "stop"
    assert differences(recorded, relaxed, loose) == []
    # /server_info: only the keys the adapter reads must be there
    subset = StepRecord("connect", subset={"/server_info": ["version"]})
    assert differences({"version": "0.5.17", "a": 1}, {"version": "0.5.17"}, subset, "/server_info") == []
    assert differences({"version": "0.5.17"}, {"version": "0.5.23"}, subset, "/server_info")
    assert differences("Cache flushed.\n", "Flush cache failed.\n", step)  # a text body is compared whole


class _Upstream(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"version": "0.5.17", "tp_size": 1, "dp_size": 1, "pp_size": 1}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        body = b"Flush cache failed.\n"
        self.send_response(400)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_the_proxy_records_each_exchange_under_its_step(tmp_path: Path) -> None:
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        with RecordingProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            with proxy.step("connect", subset={"/server_info": ["version"]}):
                client = SGLangClient(proxy.url, timeout_s=10)
            with proxy.step("flush_cache"):
                assert not client.endpoint.call("POST", "/flush_cache").success
            client.close()
        write_fixtures(tmp_path, proxy.steps, {"models": "tiny"})
    finally:
        upstream.shutdown()
    meta, steps = read_fixtures(tmp_path)
    assert meta["models"] == "tiny"
    assert [p.name for p, _ in steps] == ["00-connect.json", "01-flush-cache.json"]
    (flush,) = steps[1][1].exchanges
    assert (flush.method, flush.route, flush.status, flush.response) == (
        "POST",
        "/flush_cache",
        400,
        "Flush cache failed.\n",
    )
    assert flush.start <= flush.end
    assert steps[0][1].subset == {"/server_info": ["version"]}
