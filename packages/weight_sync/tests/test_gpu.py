"""Trainer on GPU 0 (this process), engine on GPU 1 (an HTTP server process), NCCL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ppo_weight_sync import (
    EngineUnavailableError,
    HttpEngineEndpoint,
    NonFiniteTensorsError,
    WeightSender,
    checksum,
)
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.testing import llama_like_spec, make_weights
from ppo_weight_sync.testing.http_engine import start_process

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(90)]

SPEC = llama_like_spec(layers=4, hidden=256, intermediate=512, vocab=1024, dtype="bfloat16")


@pytest.fixture
def engine() -> Iterator[tuple[HttpEngineEndpoint, object]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs: trainer on GPU 0, engine on GPU 1")
    torch.cuda.set_device(0)
    proc, url = start_process(SPEC, seed=1, device="cuda:1", group_timeout_s=30)
    yield HttpEngineEndpoint(url, name="gpu-engine", timeout_s=60, load_formats=RECEIVER_LOAD_FORMATS), proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("load_format", ["auto", "flattened_bucket", "per_tensor"])
def test_nccl_updates_are_bit_identical(engine: tuple[HttpEngineEndpoint, object], load_format: str) -> None:
    ep, _ = engine
    sender = WeightSender(backend="nccl", bucket_bytes=256 << 10, load_format=load_format, timeout_s=30)
    sender.connect([ep])
    for step in range(3):
        sent = {n: t.cuda() for n, t in make_weights(SPEC, seed=100 + step).items()}
        t0 = time.monotonic()
        sender.update(sent.items(), f"v{step}")
        t1 = time.monotonic()
        state = ep.request("GET", "/state")
        # Progress under `pytest -s`: where the time goes if a step is slow.
        print(f"[{load_format}] step {step}: update {t1 - t0:.2f} s, /state {time.monotonic() - t1:.2f} s")
        assert state["checksum"] == checksum(sent.items())
        assert state["weight_version"] == f"v{step}"
    sender.disconnect()
    sender.connect([ep])  # reconnect, update again
    sent = {n: t.cuda() for n, t in make_weights(SPEC, seed=200).items()}
    sender.update(sent.items(), "again")
    assert ep.request("GET", "/state")["checksum"] == checksum(sent.items())
    sender.disconnect()
    sender.disconnect()


def test_nccl_refuses_non_finite_weights_while_pausing_and_the_engine_keeps_its_own(
    engine: tuple[HttpEngineEndpoint, object],
) -> None:
    """The scan's sums are queued on GPU 0 while the pause and flush are in flight; a NaN in a bf16
    tensor ends the update before any byte: the engine is continued with its weights, still connected."""
    ep, _ = engine
    sender = WeightSender(backend="nccl", bucket_bytes=256 << 10, timeout_s=30)
    sender.connect([ep])
    good = {n: t.cuda() for n, t in make_weights(SPEC, seed=300).items()}
    sender.update(good.items(), "good")
    flushes = ep.request("GET", "/state")["flushes"]
    bad = {n: t.clone() for n, t in good.items()}
    name = "model.layers.2.mlp.down_proj.weight"
    bad[name][7, 3] = float("nan")
    with pytest.raises(NonFiniteTensorsError, match=r"down_proj\.weight") as caught:
        sender.update(bad.items(), "bad")
    assert caught.value.names == [name]
    state = ep.request("GET", "/state")
    assert (state["checksum"], state["weight_version"], state["paused"]) == (
        checksum(good.items()),
        "good",
        False,
    )
    assert state["flushes"] == flushes + 1  # paused and flushed while the scan ran, then continued
    assert sender.is_connected
    again = {n: t.cuda() for n, t in make_weights(SPEC, seed=301).items()}
    sender.update(again.items(), "again")
    assert ep.request("GET", "/state")["checksum"] == checksum(again.items())
    sender.disconnect()


def test_nccl_engine_killed_mid_update_surfaces_within_timeout(
    engine: tuple[HttpEngineEndpoint, object],
) -> None:
    ep, proc = engine
    sender = WeightSender(backend="nccl", bucket_bytes=64 << 10, timeout_s=20)
    sender.connect([ep])
    ep.request("POST", "/set_load_delay", {"seconds": 0.2})
    killer = threading.Timer(1.0, proc.kill)  # type: ignore[attr-defined]
    killer.start()
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="gpu-engine"):
        sender.update(make_weights(SPEC, seed=5, device="cuda").items(), "killed")
    killer.join()
    assert time.monotonic() - start < 20 + 10
    assert not sender.is_connected
    sender.disconnect()
