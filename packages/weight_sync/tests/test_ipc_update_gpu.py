"""WeightSender.update() to colocated engines over CUDA IPC, alone and mixed with an NCCL engine.

Trainer: this process on GPU 0. Engine "near": an HTTP engine process (TensorEngine on WeightReceiver) on
GPU 0 too; engine "far" (2 GPUs only): the same on GPU 1, over NCCL, in the same update.
"""

from __future__ import annotations

import math
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ppo_weight_sync import ColocatedIpc, EngineUnavailableError, HttpEngineEndpoint, WeightSender, checksum
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.testing import llama_like_spec, make_weights
from ppo_weight_sync.testing.http_engine import start_process

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]

SPEC = llama_like_spec(layers=4, hidden=256, intermediate=512, vocab=1024, dtype="bfloat16")
MiB = 1 << 20


def _start(device: str, name: str) -> tuple[subprocess.Popen[str], HttpEngineEndpoint]:
    proc, url = start_process(SPEC, seed=1, device=device, group_timeout_s=30)
    return proc, HttpEngineEndpoint(url, name=name, timeout_s=60, load_formats=RECEIVER_LOAD_FORMATS)


@pytest.fixture
def near() -> Iterator[tuple[subprocess.Popen[str], HttpEngineEndpoint]]:
    torch.cuda.set_device(0)
    proc, ep = _start("cuda:0", "near")
    yield proc, ep
    proc.kill()
    proc.wait()


def _near(bucket_bytes: int, stream: bool = True) -> ColocatedIpc:
    """The engine named "near" is on this process's GPU: CUDA IPC; any other joins the group.
    ``stream``: one request per update (ppo_ipc_stream), else one per bucket (ppo_ipc_bucket)."""
    return ColocatedIpc(["near"], bucket_bytes=bucket_bytes, stream=stream)


def _used_mib() -> float:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / MiB


@pytest.mark.parametrize("stream", [True, False], ids=["one-request", "request-per-bucket"])
def test_update_over_ipc_alone_is_bit_identical_and_frees_its_buffers(
    near: tuple[subprocess.Popen[str], HttpEngineEndpoint], stream: bool
) -> None:
    _, ep = near
    sender = WeightSender(
        backend="nccl", bucket_bytes=256 << 10, timeout_s=30, transports=[_near(256 << 10, stream)]
    )
    # A warm-up connection first: the engine process loads its copy kernels lazily on first use (CUDA's
    # lazy module loading), which the GPU's used figure would otherwise count as growth.
    sender.connect([ep])
    sender.update(make_weights(SPEC, seed=99, device="cuda").items(), "warm-up")
    sender.disconnect()
    sender.pop_metrics()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    used_before = _used_mib()
    sender.connect([ep])
    for step in range(3):
        sent = {n: t.cuda() for n, t in make_weights(SPEC, seed=100 + step).items()}
        sender.update(sent.items(), f"v{step}")
        assert sender.engines[0].name == "near"
        state = ep.request("GET", "/state")
        assert state["checksum"] == checksum(sent.items())
        assert state["weight_version"] == f"v{step}"
        assert state["ipc_mappings"] == 2  # two buffers, mapped once for the whole connection
        metrics = sender.pop_metrics()
        assert metrics["weight_sync/ipc_bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
        del sent
    during = torch.cuda.memory_allocated(0) - before
    # Two buckets (a tensor bigger than the bucket size makes its bucket that big), never a model copy.
    biggest = max(256 << 10, *(math.prod(shape) * 2 for _, shape in SPEC.values()))
    assert 0 < during <= 2 * biggest + 4096
    sender.disconnect()
    assert ep.request("GET", "/state")["ipc_mappings"] == 0
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(0) == before
    print(f"\nGPU used: before {used_before:.0f} MiB, after disconnect {_used_mib():.0f} MiB")
    assert _used_mib() <= used_before + 4
    # Reconnect: fresh exports and mappings.
    sender.connect([ep])
    sent = {n: t.cuda() for n, t in make_weights(SPEC, seed=7).items()}
    sender.update(sent.items(), "again")
    assert ep.request("GET", "/state")["checksum"] == checksum(sent.items())
    sender.disconnect()
    sender.disconnect()


def test_one_update_serves_a_colocated_and_a_remote_engine(
    near: tuple[subprocess.Popen[str], HttpEngineEndpoint],
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: a remote engine on GPU 1")
    _, ep_near = near
    proc_far, ep_far = _start("cuda:1", "far")
    try:
        sender = WeightSender(
            backend="nccl", bucket_bytes=256 << 10, timeout_s=30, transports=[_near(256 << 10)]
        )
        sender.connect([ep_near, ep_far])
        for step in range(2):
            sent = {n: t.cuda() for n, t in make_weights(SPEC, seed=200 + step).items()}
            sender.update(sent.items(), f"m{step}")
            for ep in (ep_near, ep_far):
                state = ep.request("GET", "/state")
                assert state["checksum"] == checksum(sent.items()), ep.name
                assert state["weight_version"] == f"m{step}", ep.name
                assert state["paused"] is False
        sender.disconnect()
        assert ep_near.request("GET", "/state")["ipc_mappings"] == 0
    finally:
        proc_far.kill()
        proc_far.wait()


@pytest.mark.parametrize("stream", [True, False], ids=["one-request", "request-per-bucket"])
def test_a_colocated_engine_killed_mid_update_is_named_within_the_timeout(
    near: tuple[subprocess.Popen[str], HttpEngineEndpoint], stream: bool
) -> None:
    proc, ep = near
    sender = WeightSender(
        backend="nccl", bucket_bytes=64 << 10, timeout_s=20, transports=[_near(64 << 10, stream)]
    )
    sender.connect([ep])
    ep.request("POST", "/set_load_delay", {"seconds": 0.2})
    killer = threading.Timer(1.0, proc.kill)
    killer.start()
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="near"):
        sender.update(make_weights(SPEC, seed=5, device="cuda").items(), "killed")
    killer.join()
    assert time.monotonic() - start < 20 + 10
    assert not sender.is_connected
    sender.disconnect()
