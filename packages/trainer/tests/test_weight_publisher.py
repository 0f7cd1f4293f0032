"""WeightPublisher on its own (no Ray, no trainer): one actor rank's connect, update, disconnect, metrics."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ppo_trainer.config import TrainerConfig
from ppo_trainer.errors import NonFiniteWeightsError
from ppo_trainer.weight_publisher import WeightPublisher
from ppo_weight_sync import RECEIVER_LOAD_FORMATS, HttpEngineEndpoint, checksum
from ppo_weight_sync.testing import TensorEngine
from ppo_weight_sync.testing.http_engine import serve

SPEC = {"w": ("float32", [4, 4]), "b": ("float32", [4])}


@pytest.fixture
def engine() -> Iterator[tuple[TensorEngine, HttpEngineEndpoint]]:
    tensors = TensorEngine(SPEC, seed=1, timeout_s=30)
    server = serve(tensors)
    endpoint = HttpEngineEndpoint(
        server.url, name="engine-0", timeout_s=30, load_formats=RECEIVER_LOAD_FORMATS
    )
    yield tensors, endpoint
    endpoint.close()
    server.shutdown()


def _publisher(rank: int, world_size: int) -> WeightPublisher:
    config = TrainerConfig(role="actor", model_path="unused", weight_sync_group="test_publisher")
    return WeightPublisher(config, rank, world_size, tp_groups={}, timeout_s=30)


def _weights(scale: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((4, 4), scale)), ("b", torch.arange(4, dtype=torch.float32) * scale)]


def test_rank_zero_connects_updates_reconnects_and_reports(
    engine: tuple[TensorEngine, HttpEngineEndpoint],
) -> None:
    tensors, endpoint = engine
    publisher = _publisher(0, 1)
    assert not publisher.has_engines
    publisher.connect([endpoint], resident=True)
    assert publisher.has_engines
    assert publisher.sends_weights
    assert publisher.rank_sends().group == (0,)  # no colocated engine: rank 0 sends over the group
    metrics = publisher.update(_weights(2.0), "v1")
    assert metrics["weight_sync/bytes"] == 20 * 4
    assert tensors.checksum() == checksum(_weights(2.0))
    assert tensors.receiver.weight_version == "v1"
    publisher.disconnect()  # before a sleep: the next update reconnects
    assert publisher.update(_weights(3.0), "v2")["weight_sync/updates"] == 1
    assert tensors.checksum() == checksum(_weights(3.0))
    assert publisher.pop_metrics() == {}  # update() popped its own; zero totals are left out
    publisher.close()
    publisher.close()  # idempotent on the way out


def test_non_finite_weights_are_refused_before_any_engine_sees_them(
    engine: tuple[TensorEngine, HttpEngineEndpoint],
) -> None:
    tensors, endpoint = engine
    publisher = _publisher(0, 1)
    publisher.connect([endpoint], resident=False)  # asleep: connects at the update
    before = tensors.checksum()
    bad = [("w", torch.full((4, 4), float("nan"))), ("b", torch.zeros(4))]
    with pytest.raises(NonFiniteWeightsError, match=r"actor rank 0: non-finite weights \(w\)"):
        publisher.update(bad, "bad")
    assert tensors.checksum() == before
    publisher.close()


def test_a_rank_without_engines_of_its_own_sends_nothing(
    engine: tuple[TensorEngine, HttpEngineEndpoint],
) -> None:
    _, endpoint = engine
    publisher = _publisher(1, 2)
    publisher.connect([endpoint], resident=True)
    assert not publisher.sends_weights
    assert publisher.update(_weights(1.0), "v1") == {}
    with pytest.raises(ValueError, match="engines is empty"):
        publisher.connect([], resident=True)
