"""SGLang's engine routes on the server side, for any :class:`~ppo_weight_sync.ops.EngineOps`.

One dispatcher serves the test HTTP engine (:mod:`ppo_weight_sync.testing.http_engine`) and the SGLang
stand-in (``ppo_rollout.testing.sglang_standin``), so both answer with SGLang's shapes and statuses
(``sglang/srt/entrypoints/http_server.py``, 0.5.15.post1 and 0.5.23 alike):

- weight routes: ``{"success", "message"}``, 200 or 400;
- ``/pause_generation``, ``/continue_generation``: ``{"message": ..., "status": "ok"}``, 200;
- ``/flush_cache`` (GET or POST): text, 200, or 400 with the failure text;
- memory routes: ``null`` with 200, or ``{"error": {"message"}}`` with 400 (``_create_error_response``);
- a body that fails validation (a required field missing, a wrong type): 400
  ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`` (SGLang's
  ``RequestValidationError`` handler, which replaces FastAPI's 422).

Request fields and their defaults follow ``sglang/srt/managers/io_struct.py``
(``InitWeightsUpdateGroupReqInput``: ``group_name="weight_update_group"``, ``backend="nccl"``;
``UpdateWeightsFromDistributedReqInput``: ``group_name``, ``flush_cache=True``, ``weight_version=None``,
``load_format=None``; fields we do not use are accepted and ignored).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ppo_weight_sync.ops import EngineOps, EngineReply, TensorOps, WeightOps

__all__ = [
    "DEFAULT_GROUP_NAME",
    "DestroyRequest",
    "InitRequest",
    "RouteResult",
    "TensorRequest",
    "UpdateRequest",
    "ValidationError",
    "serve_engine_route",
    "validation_error",
    "weight_reply",
]

DEFAULT_GROUP_NAME = "weight_update_group"  # io_struct.py's default for every weight request


@dataclass(frozen=True)
class RouteResult:
    """What a route answers: an HTTP status and a body (a str is sent as text, anything else as JSON)."""

    status: int
    body: Any


class ValidationError(ValueError):
    """A request body that SGLang's FastAPI layer would refuse before reaching the engine."""


def validation_error(message: str) -> RouteResult:
    return RouteResult(
        400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    )


def _field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in body or (body[name] is None and default is not ...):
        if default is ...:
            raise ValidationError(f"field required: body.{name}")
        return default
    value = body[name]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValidationError(f"body.{name}: expected {kind}, got {type(value).__name__}")
    return value


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise ValidationError(f"body.{name}: expected a string or null, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class InitRequest:
    """``POST /init_weights_update_group``'s body (``InitWeightsUpdateGroupReqInput``)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> InitRequest:
        return cls(
            master_address=_field(body, "master_address", str),
            master_port=_field(body, "master_port", int),
            rank_offset=_field(body, "rank_offset", int),
            world_size=_field(body, "world_size", int),
            group_name=_field(body, "group_name", str, DEFAULT_GROUP_NAME),
            backend=_field(body, "backend", str, "nccl"),
        )

    def send_to(self, ops: WeightOps) -> EngineReply:
        return ops.init_weights_update_group(
            master_address=self.master_address,
            master_port=self.master_port,
            rank_offset=self.rank_offset,
            world_size=self.world_size,
            group_name=self.group_name,
            backend=self.backend,
        )


@dataclass(frozen=True)
class UpdateRequest:
    """``POST /update_weights_from_distributed``'s body (``UpdateWeightsFromDistributedReqInput``; fields we
    do not use are accepted and ignored)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str
    weight_version: str | None
    flush_cache: bool
    load_format: str | None

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> UpdateRequest:
        return cls(
            names=_field(body, "names", list),
            dtypes=_field(body, "dtypes", list),
            shapes=_field(body, "shapes", list),
            group_name=_field(body, "group_name", str, DEFAULT_GROUP_NAME),
            weight_version=_optional_str(body, "weight_version"),
            flush_cache=_field(body, "flush_cache", bool, True),
            load_format=_optional_str(body, "load_format"),
        )

    def send_to(self, ops: WeightOps) -> EngineReply:
        return ops.update_weights_from_distributed(
            names=self.names,
            dtypes=self.dtypes,
            shapes=self.shapes,
            group_name=self.group_name,
            weight_version=self.weight_version,
            flush_cache=self.flush_cache,
            load_format=self.load_format,
        )


@dataclass(frozen=True)
class DestroyRequest:
    """``POST /destroy_weights_update_group``'s body."""

    group_name: str

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> DestroyRequest:
        return cls(group_name=_field(body, "group_name", str, DEFAULT_GROUP_NAME))

    def send_to(self, ops: WeightOps) -> EngineReply:
        return ops.destroy_weights_update_group(group_name=self.group_name)


@dataclass(frozen=True)
class TensorRequest:
    """``POST /update_weights_from_tensor``'s body: ``UpdateWeightsFromTensorReqInput`` (io_struct.py,
    0.5.15.post1 to 0.5.23), its fields and defaults."""

    serialized_named_tensors: list[str]
    load_format: str | None
    flush_cache: bool
    abort_all_requests: bool
    weight_version: str | None

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> TensorRequest:
        entries = _field(body, "serialized_named_tensors", list)
        if not all(isinstance(e, str) for e in entries):
            raise ValidationError("body.serialized_named_tensors: expected a list of base64 strings")
        return cls(
            serialized_named_tensors=entries,
            load_format=_optional_str(body, "load_format"),
            flush_cache=_field(body, "flush_cache", bool, True),
            abort_all_requests=_field(body, "abort_all_requests", bool, False),
            weight_version=_optional_str(body, "weight_version"),
        )

    def send_to(self, ops: TensorOps) -> EngineReply:
        return ops.update_weights_from_tensor(
            serialized_named_tensors=self.serialized_named_tensors,
            load_format=self.load_format,
            flush_cache=self.flush_cache,
            abort_all_requests=self.abort_all_requests,
            weight_version=self.weight_version,
        )


def weight_reply(reply: EngineReply) -> RouteResult:
    """A weight route's answer: the reply's body, 200 or 400."""
    return RouteResult(200 if reply.success else 400, reply.to_json())


def _generation(op: Callable[[], EngineReply], done: str) -> RouteResult:
    reply = op()
    if not reply.success:
        return RouteResult(400, {"error": {"message": reply.message}})
    return RouteResult(200, {"message": done, "status": "ok"})


def _flush(engine: EngineOps) -> RouteResult:
    reply = engine.flush_cache()
    if reply.success:
        return RouteResult(200, "Cache flushed.\n")
    return RouteResult(400, reply.message or "Flush cache failed.\n")


def _memory(op: Callable[..., EngineReply], body: Mapping[str, Any]) -> RouteResult:
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise ValidationError("body.tags: expected a list of strings or null")
    reply = op(tags=tags)
    return (
        RouteResult(200, None) if reply.success else RouteResult(400, {"error": {"message": reply.message}})
    )


def serve_engine_route(
    engine: EngineOps, method: str, path: str, body: Mapping[str, Any] | None
) -> RouteResult | None:
    """The answer of SGLang's route ``method path`` for ``engine``; None when it is not an engine route."""
    data: Mapping[str, Any] = body or {}
    try:
        if path == "/flush_cache" and method in ("GET", "POST"):
            return _flush(engine)
        if path == "/get_weight_version" and method == "GET":
            return RouteResult(200, {"weight_version": engine.get_weight_version()})
        if method != "POST":
            return None
        if path == "/init_weights_update_group":
            return weight_reply(InitRequest.parse(data).send_to(engine))
        if path == "/update_weights_from_distributed":
            return weight_reply(UpdateRequest.parse(data).send_to(engine))
        if path == "/update_weights_from_tensor" and isinstance(engine, TensorOps):
            return weight_reply(TensorRequest.parse(data).send_to(engine))
        if path == "/destroy_weights_update_group":
            return weight_reply(DestroyRequest.parse(data).send_to(engine))
        if path == "/pause_generation":
            return _generation(engine.pause_generation, "Generation paused successfully.")
        if path == "/continue_generation":
            return _generation(engine.continue_generation, "Generation continued successfully.")
        if path == "/release_memory_occupation":
            return _memory(engine.release_memory_occupation, data)
        if path == "/resume_memory_occupation":
            return _memory(engine.resume_memory_occupation, data)
    except ValidationError as exc:
        return validation_error(str(exc))
    return None
