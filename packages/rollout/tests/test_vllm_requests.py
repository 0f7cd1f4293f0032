"""The vLLM adapter before and around a server, without vLLM: the settings and models it refuses before
any server starts, and the requests it sends, read off the wire by a stand-in of vLLM's completions route
on 127.0.0.1 (what a real server does with them: ``tests-vllm/``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ppo_rollout.config import PartialSettings, RolloutConfig, SamplingConfig
from ppo_rollout.engine.vllm_client import VLLMClient
from ppo_rollout.engine.vllm_handle import VLLMEngineHandle
from ppo_rollout.engine.vllm_server import CPU_HEAD_SIZES, VLLMError, check_cpu_head_size
from ppo_rollout.engine_pool import vllm_spec_args
from ppo_rollout.stops import RequestStop
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint

SIZES = list(CPU_HEAD_SIZES)


# ---------------------------------------------------------------------------------- refused before a server
def _config(model: Path | str, **settings: Any) -> RolloutConfig:
    return RolloutConfig(model_path=str(model), engine="vllm", task="copy_small", **settings)


def test_a_head_size_vllms_cpu_attention_cannot_run_is_refused_before_a_server_starts(
    tiny_model: Path, tmp_path: Path
) -> None:
    sixteen = tiny_model  # the built-in tiny model's defaults: hidden size 64, 4 heads
    with pytest.raises(ValueError) as info:
        vllm_spec_args(_config(sixteen), 0)
    assert str(info.value) == (
        f"rollout.engine='vllm' on CPU takes attention head sizes {SIZES}; the model at {sixteen} has 16 "
        "(head_dim): run vLLM on GPUs (placement.device='cuda'), or use rollout.engine='builtin'"
    )
    two_heads = json.loads((tiny_model / "config.json").read_text()) | {
        "num_attention_heads": 2,
        "head_dim": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(two_heads))  # tests-vllm's model: 2 heads of 32
    assert vllm_spec_args(_config(tmp_path), 0)["model_path"] == str(tmp_path)
    # on GPUs vLLM picks another attention: no such rule
    on_gpu = vllm_spec_args(_config(sixteen, device="cuda", gpus_per_engine=1), 0)
    assert on_gpu["tp_size"] == 1
    # sleep frees GPU memory only from vLLM's own pool, made with --enable-sleep-mode (not on CPU)
    assert on_gpu["extra_args"] == ("--enable-sleep-mode",)
    assert "--enable-sleep-mode" not in vllm_spec_args(_config(tmp_path), 0)["extra_args"]


@pytest.mark.parametrize(
    ("model_config", "refused"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4}, "has 16 (hidden_size 64 / num_attention_heads 4)"),
        ({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}, None),  # head_dim wins
        ({"hidden_size": 576, "num_attention_heads": 9}, None),  # SmolLM2-135M: 64
        ({"text_config": {"hidden_size": 96, "num_attention_heads": 4}}, "has 24 (hidden_size 96"),
        ({"hidden_size": 64, "num_attention_heads": 4, "kv_lora_rank": 8}, None),  # MLA: vLLM's own sizing
        ({"model_type": "llama"}, None),  # no head size named: left to vLLM
    ],
)
def test_the_head_size_is_read_as_vllm_reads_it(
    tmp_path: Path, model_config: dict[str, Any], refused: str | None
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(model_config))
    if refused is None:
        check_cpu_head_size(str(tmp_path))
        return
    with pytest.raises(
        ValueError, match=r"^rollout\.engine='vllm' on CPU takes attention head sizes"
    ) as info:
        check_cpu_head_size(str(tmp_path))
    assert refused in str(info.value)


def test_a_path_without_a_config_is_left_to_vllm(tmp_path: Path) -> None:
    check_cpu_head_size("HuggingFaceTB/SmolLM2-135M-Instruct")  # a hub id: vLLM downloads and checks it
    (tmp_path / "config.json").write_text("[1, 2]")
    check_cpu_head_size(str(tmp_path))


def test_partial_rollouts_are_taken_with_vllm() -> None:
    # the handle generates a call with an early stop in chunks (test_server_partial.py)
    assert _config("/m", partial=PartialSettings(enabled=True, chunk_tokens=64)).partial.chunk_tokens == 64


# ---------------------------------------------------------------------------------- the requests on the wire
class _Completions(BaseHTTPRequestHandler):
    """``POST /v1/completions`` as vLLM 0.32.0 answers it (``choices`` with ``index``, ``token_ids``,
    ``logprobs.token_logprobs``, ``finish_reason``), in reverse index order; every body recorded."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server: Any = self.server
        with server.lock:
            server.bodies.append(body)
        choices = [
            {
                "index": i,
                "token_ids": [body["prompt"][-1] + i, *body.get("stop_token_ids", [])[:1]],
                "logprobs": {"token_logprobs": [-0.5, -0.25][: 1 + bool(body.get("stop_token_ids"))]},
                "finish_reason": server.finish_reason,
            }
            for i in reversed(range(body["n"]))
        ]
        data = json.dumps({"object": "text_completion", "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler], **state: Any) -> Iterator[Any]:
    """A stand-in server on 127.0.0.1 with ``state`` as its attributes, shut down on exit."""
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in state.items():
        setattr(server, name, value)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def completions() -> Iterator[Any]:
    with _serving(_Completions, bodies=[], lock=threading.Lock(), finish_reason="stop") as server:
        yield server


def _client(server: Any) -> VLLMClient:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    return VLLMClient(VLLMEngineEndpoint(url, [("w", "float32", (2,))], timeout_s=10.0, name="vllm-0"))


def test_stop_token_ids_and_each_prompts_stop_strings_reach_the_request(completions: Any) -> None:
    client = _client(completions)
    sampling = SamplingConfig(n_samples_per_prompt=2, stop_token_ids=(7, 9), ignore_eos=True)
    try:
        out = client.generate(
            [[3, 4], [5]], sampling, seed=1, max_new_tokens=[6, 2], stop=[["</a>", "\n"], []]
        )
    finally:
        client.close()
    bodies = sorted(completions.bodies, key=lambda b: b["prompt"])
    assert [b["prompt"] for b in bodies] == [[3, 4], [5]]
    assert [b["max_tokens"] for b in bodies] == [6, 2]
    assert all(b["stop_token_ids"] == [7, 9] for b in bodies)  # every prompt's: the sampling's
    assert all(b["ignore_eos"] is True for b in bodies)  # eos ignored, the stop tokens still stop
    assert bodies[0]["stop"] == ["</a>", "\n"]
    assert "stop" not in bodies[1]  # no stop strings: no key (vLLM's default, none)
    assert bodies[0]["seed"] != bodies[1]["seed"]
    # the samples come back in prompt order, each prompt's in vLLM's index order, the stop token kept
    assert [(o.prompt_position, o.token_ids) for o in out] == [
        (0, (4, 7)),
        (0, (5, 7)),
        (1, (5, 7)),
        (1, (6, 7)),
    ]
    assert {o.finish_reason for o in out} == {"stop"}


def test_no_stop_settings_send_no_stop_keys(completions: Any) -> None:
    client = _client(completions)
    try:
        client.generate([[3]], SamplingConfig(n_samples_per_prompt=1), seed=0)
    finally:
        client.close()
    (body,) = completions.bodies
    assert "stop" not in body
    assert "stop_token_ids" not in body
    assert body["ignore_eos"] is False


def test_the_handle_sends_a_requests_stop_strings_not_its_token_sequences(completions: Any) -> None:
    """The built-in engine matches a stop string by the token sequences that spell it; vLLM matches the
    decoded text itself (``stop``), so the handle sends the strings only."""
    handle = VLLMEngineHandle.__new__(VLLMEngineHandle)  # the handle's generate, on a client made here
    handle.name, handle._client = "rollout-0", _client(completions)
    handle._pool = concurrent.futures.ThreadPoolExecutor(1)
    stops = [RequestStop(("</call>",), ((11, 12), (13,))), RequestStop()]
    try:
        wait = handle.submit_generate([[3], [4]], SamplingConfig(n_samples_per_prompt=1), 5, stop=stops)
        out = wait(10.0)
    finally:
        handle._pool.shutdown()
        handle.client.close()
    bodies = sorted(completions.bodies, key=lambda b: b["prompt"])
    assert bodies[0]["stop"] == ["</call>"]
    assert "stop" not in bodies[1]
    assert not any(k.startswith("stop_token") for b in bodies for k in b)  # no sequences, no sampling ids
    assert [o.token_ids for o in out] == [(3,), (4,)]


def test_a_sample_that_did_not_finish_by_stop_or_length_is_an_error(completions: Any) -> None:
    completions.finish_reason = "abort"  # vLLM's reason for a request it dropped
    client = _client(completions)
    try:
        with pytest.raises(VLLMError, match=r"^vLLM server vllm-0: prompt 0 finished with 'abort'$"):
            client.generate([[3]], SamplingConfig(n_samples_per_prompt=1), seed=0)
    finally:
        client.close()


# ---------------------------------------------------------------------------- the weight version's routes
class _DevRoutes(BaseHTTPRequestHandler):
    """vLLM's dev routes as ``server.release`` serves them: 0.32.0 keeps the weight version
    (``/update_weight_version``, ``/weight_info``); 0.26.0 has neither (404, as FastAPI answers an unknown
    route). ``/collective_rpc`` answers each worker method as the extension would; every call recorded."""

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str) -> None:
        server: Any = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        server.calls.append((method, self.path, body))
        versioned = server.release == "0.32.0"
        if self.path == "/get_world_size?include_dp=false":
            self._answer(200, {"world_size": 1})
        elif self.path == "/weight_info" and versioned:
            self._answer(200, {"weight_version": server.version})
        elif self.path == "/update_weight_version" and versioned:
            server.version = body["new_version"]
            self._answer(200, {"success": True})
        elif self.path == "/collective_rpc" and body["method"].startswith("ppo_update_weights_from_"):
            server.worker_version = json.loads(body["args"][0]).get("weight_version")
            self._answer(200, {"results": [{"success": True, "message": "Loaded 1 tensors into vLLM."}]})
        elif self.path == "/collective_rpc" and body["method"] == "ppo_weight_version":
            self._answer(200, {"results": [{"weight_version": server.worker_version}]})
        else:
            self._answer(404, {"detail": "Not Found"})

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(params=["0.26.0", "0.32.0"])
def dev_routes(request: pytest.FixtureRequest) -> Iterator[Any]:
    state = {"release": request.param, "calls": [], "version": "default", "worker_version": None}
    with _serving(_DevRoutes, **state) as server:
        yield server


def test_the_weight_version_goes_where_the_servers_vllm_keeps_it(dev_routes: Any) -> None:
    import pickle

    from ppo_weight_sync.requests import UpdateRequest

    url = f"http://127.0.0.1:{dev_routes.server_address[1]}"
    endpoint = VLLMEngineEndpoint.for_server(url, [("w", "float32", (2,))], 1, timeout_s=10.0, name="vllm-0")
    old = dev_routes.release == "0.26.0"
    try:
        assert endpoint.version_routes is not old  # read off GET /weight_info: 404 on 0.26.0
        assert pickle.loads(pickle.dumps(endpoint)).version_routes is endpoint.version_routes
        assert endpoint.get_weight_version().result(10.0) is None  # nothing loaded yet
        update = UpdateRequest.parse({"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]})
        versioned = UpdateRequest.parse(update.to_json() | {"weight_version": "step-3"})
        reply = endpoint.update_weights_from_distributed(versioned).result(10.0)
        assert reply.success, reply.message
        assert endpoint.get_weight_version().result(10.0) == "step-3"
    finally:
        endpoint.close()
    routes = [(method, path) for method, path, _ in dev_routes.calls]
    sent = [body for _, path, body in dev_routes.calls if path == "/update_weight_version"]
    if old:  # the worker extension keeps it: no route of vLLM's asked for it
        assert sent == []
        assert ("GET", "/weight_info") in routes
        assert routes.count(("POST", "/collective_rpc")) == 3  # two reads of the version, one update
    else:
        assert sent == [{"new_version": "step-3"}]
        assert routes.count(("GET", "/weight_info")) == 3  # the probe and two reads


def test_a_fresh_worker_extension_has_no_weight_version() -> None:
    from ppo_weight_sync.vllm_worker import WeightSyncExtension

    assert WeightSyncExtension().ppo_weight_version("{}") == {"weight_version": None}


def test_a_colocated_update_reaches_the_workers_with_the_manifest(dev_routes: Any) -> None:
    """A colocated engine joins no group: each CUDA IPC call carries what the workers check it against."""
    from ppo_weight_sync.requests import TensorRequest

    url = f"http://127.0.0.1:{dev_routes.server_address[1]}"
    endpoint = VLLMEngineEndpoint.for_server(url, [("w", "float32", (2,))], 1, timeout_s=10.0, name="vllm-0")
    request = TensorRequest.parse(
        {"serialized_named_tensors": ["e30="], "load_format": "ppo_ipc_stream", "weight_version": "7"}
    )
    try:
        assert {"ppo_ipc_bucket", "ppo_ipc_stream"} <= set(endpoint.load_formats)  # our formats, not SGLang's
        assert endpoint.update_weights_from_tensor(request).result(10.0).success
        assert endpoint.get_weight_version().result(10.0) == "7"
    finally:
        endpoint.close()
    (rpc,) = [b for _, path, b in dev_routes.calls if path == "/collective_rpc" and "tensor" in b["method"]]
    assert rpc["method"] == "ppo_update_weights_from_tensor"
    sent = json.loads(rpc["args"][0])
    assert (sent["expected"], sent["timeout_s"]) == ([["w", "float32", [2]]], 10.0)
    assert (sent["serialized_named_tensors"], sent["load_format"]) == (["e30="], "ppo_ipc_stream")
