"""The engine operations, declared once: :class:`EngineOps` and its reply, :class:`EngineReply`.

Every engine implementation satisfies :class:`EngineOps` (mypy checks it where each is defined): the
built-in engine, the SGLang client, the test engines, the SGLang stand-in. :class:`WeightReceiver`
satisfies its weight half, :class:`WeightOps`. The sender reaches an engine through an
:class:`~ppo_weight_sync.endpoints.EngineEndpoint`, whose methods are these operations with the same
keyword arguments, each returning a ``Pending[...]`` of the same result.

The operation and field names are SGLang's (``sglang/srt/entrypoints/http_server.py`` and
``sglang/srt/managers/io_struct.py``); there are no defaults here: every caller says which group and
which backend it means, and only the HTTP routes fill SGLang's defaults for a request that leaves a
field out (:mod:`ppo_weight_sync.routes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

__all__ = ["EngineOps", "EngineReply", "TensorOps", "WeightOps"]


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

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> EngineReply: ...

    def update_weights_from_distributed(
        self,
        *,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: str | None,
        flush_cache: bool,
        load_format: str | None,
    ) -> EngineReply: ...

    def destroy_weights_update_group(self, *, group_name: str) -> EngineReply: ...

    def get_weight_version(self) -> str | None: ...


@runtime_checkable
class TensorOps(Protocol):
    """Colocated updates (CUDA IPC, :mod:`ppo_weight_sync.ipc`): one bucket per call, SGLang's
    ``update_weights_from_tensor`` (``UpdateWeightsFromTensorReqInput``, 0.5.15.post1 and 0.5.23).
    ``serialized_named_tensors`` holds one entry per TP rank; the version and the cache flush apply once
    the call's bucket is loaded."""

    def update_weights_from_tensor(
        self,
        *,
        serialized_named_tensors: list[str],
        load_format: str | None,
        flush_cache: bool,
        abort_all_requests: bool,
        weight_version: str | None,
    ) -> EngineReply: ...


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
