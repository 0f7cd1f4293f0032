"""The vLLM adapter's parts that need no server: its command line and environment, one prompt's request,
the workers' replies, and the settings it refuses. The real server: ``tests-vllm/``."""

from __future__ import annotations

from pathlib import Path

import pytest

import ppo_weight_sync
from ppo_rollout.config import RolloutConfig, SamplingConfig
from ppo_rollout.engine.vllm_client import completion_body
from ppo_rollout.engine.vllm_server import VLLMServerSpec
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint, replies_of


def test_the_command_line_carries_the_extension_the_dtype_and_the_log_prob_mode() -> None:
    spec = VLLMServerSpec(model_path="/m", port=8100, python="/venv/bin/python", dtype="bfloat16")
    argv = spec.argv()
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--worker-extension-cls"] == "ppo_weight_sync.vllm_worker.WeightSyncExtension"
    assert flags["--dtype"] == "bfloat16"
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert "--enforce-eager" in argv
    ours = VLLMServerSpec(model_path="/m", port=8100, python="p", extra_args=("--dtype", "float16")).argv()
    assert ours.count("--dtype") == 1
    assert ours[-1] == "float16"


def test_the_server_imports_this_processes_weight_sync_package() -> None:
    env = VLLMServerSpec(model_path="/m", port=8100, python="p").environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    folder = Path(env["PYTHONPATH"].split(":")[0])
    assert (folder / "ppo_weight_sync").resolve() == Path(ppo_weight_sync.__file__).resolve().parent
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["ppo_weight_sync"]


def test_one_prompts_request_is_seeded_and_asks_for_ids_and_log_probs() -> None:
    sampling = SamplingConfig(temperature=0.5, top_k=0, n_samples_per_prompt=3, stop_token_ids=(2,))
    body = completion_body([1, 5], sampling, seed=11, max_tokens=7, stop=["\n"])
    assert body["prompt"] == [1, 5]
    assert body["n"] == 3
    assert body["seed"] == 11
    assert (body["logprobs"], body["return_token_ids"], body["max_tokens"]) == (0, True, 7)
    assert (body["stop_token_ids"], body["stop"], body["top_k"]) == ([2], ["\n"], 0)


def test_the_workers_replies_make_one() -> None:
    ok = {"success": True, "message": "ok"}
    assert replies_of({"results": [ok, ok]}, "e", "op").success
    lost = replies_of({"results": [ok, {"success": False, "message": "gone", "group_lost": True}]}, "e", "op")
    assert (lost.success, lost.group_lost, lost.message) == (False, True, "gone")
    refused = replies_of({"error": "no such method"}, "e", "op")
    assert not refused.success
    assert "no such method" in refused.message


def test_the_endpoint_travels_to_a_trainer_process_with_its_manifest() -> None:
    import pickle

    endpoint = VLLMEngineEndpoint("http://127.0.0.1:1", [("w", "float32", (2, 3))], name="vllm-0")
    copy = pickle.loads(pickle.dumps(endpoint))
    assert (copy.name, copy.expected, copy.load_formats) == (
        "vllm-0",
        [["w", "float32", [2, 3]]],
        ("ppo_flat_stream:", "ppo_ipc_bucket", "ppo_ipc_stream"),
    )
    assert copy.version_routes is True
    with pytest.raises(ValueError, match="expected must name"):
        VLLMEngineEndpoint("http://127.0.0.1:1", [])


def test_adapter_only_updates_are_refused() -> None:
    from ppo_rollout.config import AdapterUpdates

    with pytest.raises(ValueError, match=r"rollout\.engine='vllm' takes merged"):
        RolloutConfig(model_path="/m", engine="vllm", lora=AdapterUpdates(rank=4, alpha=8.0))
