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

A weight route's body is parsed into its request value (:mod:`ppo_weight_sync.requests`: SGLang's fields
and their defaults, ``sglang/srt/managers/io_struct.py``), which goes to the engine's operation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ppo_weight_sync.ops import EngineOps, EngineReply, TensorOps
from ppo_weight_sync.requests import (
    DestroyRequest,
    InitRequest,
    TensorRequest,
    UpdateRequest,
    ValidationError,
)

__all__ = ["RouteResult", "serve_engine_route", "validation_error", "weight_reply"]


@dataclass(frozen=True)
class RouteResult:
    """What a route answers: an HTTP status and a body (a str is sent as text, anything else as JSON)."""

    status: int
    body: Any


def validation_error(message: str) -> RouteResult:
    return RouteResult(
        400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
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
        if path == "/" + InitRequest.OP:
            return weight_reply(engine.init_weights_update_group(InitRequest.parse(data)))
        if path == "/" + UpdateRequest.OP:
            return weight_reply(engine.update_weights_from_distributed(UpdateRequest.parse(data)))
        if path == "/" + TensorRequest.OP and isinstance(engine, TensorOps):
            return weight_reply(engine.update_weights_from_tensor(TensorRequest.parse(data)))
        if path == "/" + DestroyRequest.OP:
            return weight_reply(engine.destroy_weights_update_group(DestroyRequest.parse(data)))
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
