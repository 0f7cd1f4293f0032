"""The engine operations, declared once: :class:`EngineOps` and its reply, :class:`EngineReply`.

Every engine implementation satisfies :class:`EngineOps` (mypy checks it where each is defined): the
built-in engine, the test engines, the SGLang stand-in's ranks. :class:`WeightReceiver` satisfies its
weight half, :class:`WeightOps`. The sender reaches an engine through an
:class:`~ppo_weight_sync.endpoints.EngineEndpoint`, whose methods are these operations, each returning a
``Pending[...]`` of the same result.

Each weight operation takes one request value (:mod:`ppo_weight_sync.requests`: SGLang's request body,
its field names, no defaults: every caller says which group and which backend it means; only the HTTP
routes fill SGLang's defaults for a body that leaves a field out). :class:`WeightOpsForwarder` declares
the four weight operations once for the implementations that only pass the value on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ppo_weight_sync.requests import DestroyRequest, InitRequest, TensorRequest, UpdateRequest, WeightRequest

__all__ = ["EngineOps", "EngineReply", "TensorOps", "WeightOps", "WeightOpsForwarder"]

R = TypeVar("R")


@dataclass(frozen=True)
class EngineReply:
    """An engine's answer to an operation: SGLang's ``{"success", "message"}`` plus what broke.

    ``group_lost``: the engine's side of the weight group is gone (its data did not arrive, or it can
    no longer say what it loaded), so the sender must drop the group and reconnect. A failure without
    it is a refusal that leaves the group usable (e.g. a tensor the engine does not hold). The sender
    chooses its error class from this field, never from the message text.
    """

    success: bool
    message: str = ""
    group_lost: bool = False

    @classmethod
    def ok(cls, message: str) -> EngineReply:
        return cls(True, message)

    @classmethod
    def refused(cls, message: str) -> EngineReply:
        return cls(False, message)

    @classmethod
    def lost(cls, message: str) -> EngineReply:
        return cls(False, message, group_lost=True)

    def to_json(self) -> dict[str, Any]:
        """SGLang's reply body; ``group_lost`` only when set (SGLang clients ignore unknown fields)."""
        body: dict[str, Any] = {"success": self.success, "message": self.message}
        if self.group_lost:
            body["group_lost"] = True
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> EngineReply:
        """The reply in a ``{"success", "message"[, "group_lost"]}`` body."""
        return cls(
            bool(body.get("success")), str(body.get("message", "")), bool(body.get("group_lost", False))
        )


@runtime_checkable
class WeightOps(Protocol):
    """The weight half of an engine: join a group, receive over it, leave it, report the version."""

    def init_weights_update_group(self, request: InitRequest) -> EngineReply: ...
    def update_weights_from_distributed(self, request: UpdateRequest) -> EngineReply: ...
    def destroy_weights_update_group(self, request: DestroyRequest) -> EngineReply: ...
    def get_weight_version(self) -> str | None: ...


@runtime_checkable
class TensorOps(Protocol):
    """Colocated updates (CUDA IPC, :mod:`ppo_weight_sync.ipc`): one bucket per call, SGLang's
    ``update_weights_from_tensor`` (:class:`~ppo_weight_sync.requests.TensorRequest`)."""

    def update_weights_from_tensor(self, request: TensorRequest) -> EngineReply: ...


@runtime_checkable
class EngineOps(WeightOps, Protocol):
    """Everything an engine serves: the weight operations, generation control and memory release.

    ``pause_generation`` holds generation so weights can change under it; ``flush_cache`` drops cached
    prefixes computed with the old weights; ``release_memory_occupation`` / ``resume_memory_occupation``
    move the tagged memory (SGLang's tags: ``weights``, ``kv_cache``; None: all) off and back on the
    device for colocated runs.
    """

    def pause_generation(self) -> EngineReply: ...
    def continue_generation(self) -> EngineReply: ...
    def flush_cache(self) -> EngineReply: ...
    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply: ...
    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply: ...


class WeightOpsForwarder(Generic[R]):
    """The four weight operations of an implementation that passes each request value on: to its
    receiver, to every TP rank, over Ray or HTTP. A subclass defines :meth:`_forward` (``R``: the reply,
    or a ``Pending`` of it)."""

    def _forward(self, request: WeightRequest) -> R:
        raise NotImplementedError(f"{type(self).__name__} must define _forward")

    def init_weights_update_group(self, request: InitRequest) -> R:
        return self._forward(request)

    def update_weights_from_distributed(self, request: UpdateRequest) -> R:
        return self._forward(request)

    def update_weights_from_tensor(self, request: TensorRequest) -> R:
        return self._forward(request)

    def destroy_weights_update_group(self, request: DestroyRequest) -> R:
        return self._forward(request)
