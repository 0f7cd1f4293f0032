"""A transport of another kind slots in beside the group, chosen per engine, in one update sequence."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch

from ppo_weight_sync import (
    RECEIVER_LOAD_FORMATS,
    EngineReply,
    EngineUnavailableError,
    HttpEngineEndpoint,
    Pending,
    Sent,
    Transport,
    WeightSender,
    checksum,
)
from ppo_weight_sync.endpoints import EngineEndpoint
from ppo_weight_sync.requests import DestroyRequest, InitRequest, UpdateRequest
from ppo_weight_sync.testing import TensorEngine, make_weights
from ppo_weight_sync.testing.http_engine import start_process

pytestmark = pytest.mark.timeout(120)

SPEC = {"a.weight": ("float32", [16, 8]), "b.bias": ("bfloat16", [8])}


@dataclass(frozen=True)
class _Done:
    value: object

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float) -> object:
        return self.value


class LocalEndpoint:
    """An engine in this process, reached by direct calls (what a colocated engine's handle would be)."""

    def __init__(self, engine: TensorEngine, name: str) -> None:
        self.engine, self.name, self.num_gpus, self.load_formats = engine, name, 1, ()

    def init_weights_update_group(self, request: InitRequest) -> Pending[EngineReply]:
        raise AssertionError("a claimed engine must never be asked to join the group")

    def update_weights_from_distributed(self, request: UpdateRequest) -> Pending[EngineReply]:
        raise AssertionError("a claimed engine must never receive over the group")

    def destroy_weights_update_group(self, request: DestroyRequest) -> Pending[EngineReply]:
        raise AssertionError("a claimed engine never joined the group")

    def pause_generation(self) -> Pending[EngineReply]:
        return _Done(self.engine.pause_generation())  # type: ignore[return-value]

    def continue_generation(self) -> Pending[EngineReply]:
        return _Done(self.engine.continue_generation())  # type: ignore[return-value]

    def flush_cache(self) -> Pending[EngineReply]:
        return _Done(self.engine.flush_cache())  # type: ignore[return-value]

    def begin_weight_update(self) -> Pending[EngineReply]:
        return _Done(EngineReply.ok("no session"))  # type: ignore[return-value]

    def end_weight_update(self) -> Pending[EngineReply]:
        return _Done(EngineReply.ok("no session"))  # type: ignore[return-value]

    def get_weight_version(self) -> Pending[str | None]:
        return _Done(self.engine.get_weight_version())  # type: ignore[return-value]


class CopyTransport:
    """Copies straight into the engines' tensors, as a CUDA IPC transport does after mapping handles."""

    def __init__(self, engines: Sequence[LocalEndpoint]) -> None:
        self._engines = tuple(engines)
        self.sends = 0
        self.closed = 0
        self.seen_paused: list[bool] = []
        self.prepared: Sequence[tuple[str, torch.Tensor]] | None = None
        self.sent_prepared: list[bool] = []  # send got the very items prepare was given

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return self._engines  # type: ignore[return-value]

    @property
    def load_format(self) -> str | None:
        return "copy"

    def prepare(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.prepared = items

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent:
        self.sent_prepared.append(items is self.prepared)
        for endpoint in self._engines:
            self.seen_paused.append(endpoint.engine.paused)
            for name, tensor in items:
                endpoint.engine.weights[name].copy_(tensor)
            endpoint.engine.receiver.weight_version = version
        self.sends += 1
        return Sent(sum(t.numel() * t.element_size() for _, t in items), 1)

    def close(self) -> None:
        self.closed += 1


class CopyFactory:
    def __init__(self) -> None:
        self.opened: list[CopyTransport] = []

    def serves(self, engine: EngineEndpoint) -> bool:
        return isinstance(engine, LocalEndpoint)

    def open(self, engines: Sequence[EngineEndpoint], timeout_s: float) -> Transport:
        transport = CopyTransport([e for e in engines if isinstance(e, LocalEndpoint)])
        self.opened.append(transport)
        return transport


def test_one_update_serves_a_claimed_engine_and_a_group_engine() -> None:
    local = TensorEngine(SPEC, seed=1)
    # The group's other member is another process: torch registers groups by name, once per process.
    proc, url = start_process(SPEC, seed=2, timeout_s=90)
    factory = CopyFactory()
    sender = WeightSender(timeout_s=30, bucket_bytes=256, transports=[factory])
    try:
        http = HttpEngineEndpoint(url, name="remote", load_formats=RECEIVER_LOAD_FORMATS)
        sender.connect([LocalEndpoint(local, "local"), http])
        assert sender.load_format is not None
        assert sender.load_format.startswith("ppo_flat_stream:")
        assert sender.active_group_name.startswith("ppo_weights-")
        sent = make_weights(SPEC, seed=7)
        sender.update(sent.items(), "v1")
        state = http.request("GET", "/state")
        for held in (local.state(), state):
            assert held["checksum"] == checksum(sent.items())
            assert held["weight_version"] == "v1"
            assert held["paused"] is False  # continued after the update
            assert held["flushes"] >= 1
        (transport,) = factory.opened
        assert transport.seen_paused == [True]  # sent inside the pause
        assert transport.sent_prepared == [True]  # prepared (before the pause) with what it sent
        metrics = sender.pop_metrics()
        assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
        sender.disconnect()
        assert transport.closed == 1
        assert not sender.is_connected
        assert sender.last_disconnect_errors == []
    finally:
        sender.disconnect()
        proc.kill()
        proc.wait(30)


def test_a_failed_update_keeps_no_tensor_alive_for_the_cyclic_collector() -> None:
    """The update's tensors (on a trainer, a whole gathered model) are freed as soon as the caller drops
    them after a failure, not when Python's cyclic collector next runs: no exception-frame cycle."""
    import gc
    import weakref

    proc, url = start_process(SPEC, seed=2, timeout_s=90)
    sender = WeightSender(timeout_s=30, bucket_bytes=256)
    try:
        http = HttpEngineEndpoint(url, name="doomed", load_formats=RECEIVER_LOAD_FORMATS)
        sender.connect([http])
        proc.kill()
        proc.wait(30)
        sent = make_weights(SPEC, seed=9)
        watch = weakref.ref(next(iter(sent.values())))
        gc.disable()
        try:
            with pytest.raises(EngineUnavailableError, match="doomed"):
                sender.update(sent.items(), "never")
            del sent
            assert watch() is None, "a failed update left its tensors to the cyclic collector"
        finally:
            gc.enable()
        assert not sender.is_connected
    finally:
        sender.disconnect()
        proc.kill()
        proc.wait(30)
