"""Engines for the end-to-end tests: TensorEngines as Ray actors or as HTTP server processes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ppo_weight_sync import EngineEndpoint, HttpEngineEndpoint, RayEngineEndpoint, WeightSender, checksum
from ppo_weight_sync.endpoints import RECEIVER_LOAD_FORMATS
from ppo_weight_sync.testing import TensorEngine, llama_like_spec, make_weights
from ppo_weight_sync.testing.http_engine import start_process

SPEC: dict[str, tuple[str, list[int]]] = {
    **llama_like_spec(layers=2, hidden=32, intermediate=64, vocab=128, dtype="bfloat16"),
    "model.rotary_scale": ("float32", [3]),  # a second dtype, at an odd offset after bf16 tensors
}
TOTAL_BYTES = sum(t.numel() * t.element_size() for t in make_weights(SPEC, 0).values())
GROUP_TIMEOUT_S = 30.0


class Engine(Protocol):
    endpoint: EngineEndpoint

    def state(self) -> dict[str, Any]: ...
    def set_load_delay(self, seconds: float) -> None: ...
    def kill(self) -> None: ...


@dataclass
class RayEngine:
    endpoint: RayEngineEndpoint

    def state(self) -> dict[str, Any]:
        import ray

        return dict(ray.get(self.endpoint.handle.state.remote(), timeout=60))

    def set_load_delay(self, seconds: float) -> None:
        import ray

        ray.get(self.endpoint.handle.set_load_delay.remote(seconds), timeout=60)

    def kill(self) -> None:
        import ray

        ray.kill(self.endpoint.handle, no_restart=True)


def spawn_ray(names: list[str]) -> list[RayEngine]:
    import ray

    cls = ray.remote(num_cpus=0)(TensorEngine).options(max_concurrency=4)
    handles = [cls.remote(SPEC, seed=i + 1, timeout_s=GROUP_TIMEOUT_S) for i, _ in enumerate(names)]
    ray.get([h.state.remote() for h in handles], timeout=120)  # started and ready
    return [RayEngine(RayEngineEndpoint(h, num_gpus=1, name=n)) for h, n in zip(handles, names, strict=True)]


@dataclass
class HttpEngine:
    endpoint: HttpEngineEndpoint
    proc: Any

    def state(self) -> dict[str, Any]:
        return dict(self.endpoint.request("GET", "/state"))

    def set_load_delay(self, seconds: float) -> None:
        self.endpoint.request("POST", "/set_load_delay", {"seconds": seconds})

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)


def spawn_http(names: list[str], load_formats: tuple[str, ...] = RECEIVER_LOAD_FORMATS) -> list[HttpEngine]:
    # Started side by side: each process spends most of its start-up importing torch.
    with ThreadPoolExecutor(len(names)) as pool:
        started = list(
            pool.map(
                lambda i: start_process(SPEC, seed=i + 1, timeout_s=180, group_timeout_s=GROUP_TIMEOUT_S),
                range(len(names)),
            )
        )
    return [
        HttpEngine(HttpEngineEndpoint(url, name=name, timeout_s=60, load_formats=load_formats), proc)
        for (proc, url), name in zip(started, names, strict=True)
    ]


def weights(step: int) -> dict[str, torch.Tensor]:
    return make_weights(SPEC, seed=1000 + step)


def assert_engines_hold(engines: list[Engine], sent: dict[str, torch.Tensor], version: str) -> None:
    expected = checksum(sent.items())
    for engine in engines:
        state = engine.state()
        assert state["checksum"] == expected, f"{engine.endpoint.name} does not hold the sent weights"
        assert state["weight_version"] == version
        assert state["paused"] is False
        assert engine.endpoint.get_weight_version().result(30) == version


def full_cycle(engines: list[Engine], **sender_kwargs: Any) -> WeightSender:
    """connect; three updates; disconnect; reconnect; update again; disconnect (the issue's scenario)."""
    sender = WeightSender(timeout_s=GROUP_TIMEOUT_S, bucket_bytes=4096, **sender_kwargs)
    endpoints = [e.endpoint for e in engines]
    sender.connect(endpoints)
    assert sender.is_connected
    for step in range(3):
        sent = weights(step)
        sender.update(sent.items(), f"v{step}")
        assert_engines_hold(engines, sent, f"v{step}")
    metrics = sender.pop_metrics()
    assert metrics["weight_sync/bytes"] == 3 * TOTAL_BYTES
    assert metrics["weight_sync/updates"] == 3
    assert metrics["weight_sync/buckets"] >= 3 * 2
    assert metrics["weight_sync/gb_per_s"] > 0
    sender.disconnect()
    assert not sender.is_connected
    sender.connect(endpoints)
    sent = weights(3)
    sender.update(sent.items(), "v3")
    assert_engines_hold(engines, sent, "v3")
    sender.disconnect()
    return sender


def wait_until(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.05)
