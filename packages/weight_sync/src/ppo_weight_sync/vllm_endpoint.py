"""A vLLM server as the sender sees it: :class:`VLLMEngineEndpoint`, the engine operations over vLLM's routes.

vLLM has no route for a weight update over a group of another framework's making; a server launched with
this package's worker extension (:mod:`ppo_weight_sync.vllm_worker`) and ``VLLM_SERVER_DEV_MODE=1``
answers the weight operations through ``POST /collective_rpc``. The routes, from vLLM 0.32.0's source:

- ``pause_generation``: ``POST /pause?mode=keep`` (``vllm/entrypoints/rl/online/api_router.py``): new
  requests wait, running ones are frozen and, with the cache cleared, moved back to the waiting queue
  (``vllm/v1/engine/core.py`` ``pause_scheduler``, ``_reset_caches``), so they continue on the new
  weights, recomputing what they had; ``continue_generation``: ``POST /resume``;
- ``flush_cache``: ``POST /reset_prefix_cache`` (``{"success": bool}``; retried while it is false);
- the weight operations: ``POST /collective_rpc`` with ``{"method": "ppo_<operation>", "args": [body]}``
  (``vllm/entrypoints/serve/dev/rpc/api_router.py``), one answer per worker in ``results``; a colocated
  engine (on the sending actor rank's GPU) takes CUDA IPC (``update_weights_from_tensor``, our formats);
- the weight version: ``POST /update_weight_version`` after an update's last call, read from
  ``GET /weight_info`` (vLLM's ``"default"`` until the first update: None here). vLLM 0.26.0 has neither
  route (its ``vllm/entrypoints/serve/dev/`` routers serve none): a server whose ``GET /weight_info``
  answers 404 keeps the version in the worker extension instead (:meth:`VLLMEngineEndpoint.for_server`
  asks once; ``ppo_weight_version`` over ``/collective_rpc`` reads it);
- the ranks a server adds to the group: ``GET /get_world_size?include_dp=false``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ppo_weight_sync.buckets import STREAM_FORMAT_PREFIX
from ppo_weight_sync.endpoints import Done, HttpEngineEndpoint, Pending, _FuturePending, _Mapped
from ppo_weight_sync.errors import EngineUnavailableError
from ppo_weight_sync.ipc.payload import PPO_IPC_FORMAT, PPO_IPC_STREAM
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.requests import InitRequest, TensorRequest, UpdateRequest, WeightRequest

__all__ = ["VLLM_INITIAL_VERSION", "VLLMEngineEndpoint"]

VLLM_INITIAL_VERSION = "default"  # vLLM's weight version before anything set one (EngineCore.__init__)
_NO_SESSION = Done(EngineReply.ok("vLLM needs no weight-update session"))

ManifestRows = Sequence[tuple[str, str, Sequence[int]]]


def _rows(manifest: ManifestRows) -> list[list[Any]]:
    return [[str(n), str(d), [int(s) for s in shape]] for n, d, shape in manifest]


def replies_of(body: Any, engine: str, op: str) -> EngineReply:
    """``/collective_rpc``'s ``{"results": [reply, ...]}`` (one per worker) as one reply: a success when
    every worker's is; ``group_lost`` when any worker's is."""
    results = body.get("results") if isinstance(body, Mapping) else None
    if not isinstance(results, list) or not results or not all(isinstance(r, Mapping) for r in results):
        detail = body.get("error", body) if isinstance(body, Mapping) else body
        return EngineReply.refused(f"vLLM server {engine}: {op} answered {str(detail)[:300]}")
    replies = [EngineReply.from_json(r) for r in results]
    failed = [r for r in replies if not r.success]
    if not failed:
        return replies[0]
    message = "; ".join(r.message for r in failed)
    return EngineReply(False, message, group_lost=any(r.group_lost for r in failed))


def _status_reply(status: int, body: Any) -> EngineReply:
    """``/pause`` and ``/resume``: ``{"status": ...}`` on 200, ``{"error": ...}`` otherwise."""
    if 200 <= status < 300 and not (isinstance(body, Mapping) and "error" in body):
        return EngineReply.ok(str(body))
    return EngineReply.refused(str(body.get("error", body) if isinstance(body, Mapping) else body))


class VLLMEngineEndpoint(HttpEngineEndpoint):
    """The vLLM server at ``base_url`` (launched with the worker extension). ``expected``: name, dtype
    name and shape of every tensor the actor sends (the workers check each update against it, and read
    the weights back by it). Updates arrive as one stream per update (``ppo_flat_stream:``), loaded into
    vLLM at its end."""

    def __init__(
        self,
        base_url: str,
        expected: ManifestRows,
        num_gpus: int = 1,
        timeout_s: float = 600.0,
        name: str = "",
        *,
        flush_retry_s: float = 60.0,
        version_routes: bool = True,
    ) -> None:
        formats = (STREAM_FORMAT_PREFIX, PPO_IPC_FORMAT, PPO_IPC_STREAM)  # the group's, CUDA IPC's
        super().__init__(base_url, num_gpus, timeout_s, name, formats, flush_retry_s=flush_retry_s)
        self.expected = _rows(expected)
        if not self.expected:
            raise ValueError("expected must name at least one tensor (the model's manifest)")
        # True: vLLM keeps the weight version (/update_weight_version, /weight_info; 0.32.0); False: the
        # worker extension keeps it (vLLM 0.26.0 has no such route)
        self.version_routes = version_routes

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.base_url, self.expected, self.num_gpus, self.timeout_s, self.name)
        return (_endpoint, (args, self.flush_retry_s, self.version_routes))

    @classmethod
    def for_server(
        cls, base_url: str, expected: ManifestRows, num_gpus: int, timeout_s: float = 600.0, name: str = ""
    ) -> VLLMEngineEndpoint:
        """The endpoint, once the server's size (``/get_world_size``) matched ``num_gpus``; ValueError
        naming both otherwise. Where the weight version is kept is read off ``GET /weight_info``: 404
        (vLLM 0.26.0) leaves it to the worker extension."""
        endpoint = cls(base_url, expected, num_gpus, timeout_s, name)
        body = endpoint.request("GET", "/get_world_size?include_dp=false")
        size = body.get("world_size") if isinstance(body, Mapping) else None
        if not isinstance(size, int):
            endpoint.close()
            raise EngineUnavailableError(endpoint.name, "get_world_size", f"answered {str(body)[:200]}")
        if size != num_gpus:
            endpoint.close()
            raise ValueError(
                f"vLLM server {endpoint.name} runs on {size} GPU(s) (its world size), but "
                f"num_gpus={num_gpus} was given: set the engine's GPUs in the config to the server's "
                "(or relaunch it)"
            )
        endpoint.version_routes = endpoint._answer("GET", "/weight_info", None, also=(404,))[0] != 404
        return endpoint

    # -- the weight operations, over /collective_rpc --------------------------------------------------
    def rpc(self, method: str, body: Mapping[str, Any]) -> Any:
        """One blocking ``/collective_rpc`` of the extension's ``method`` with ``body`` as its argument."""
        payload = {"method": method, "args": [json.dumps(body)], "timeout": self.timeout_s}
        return self.request("POST", "/collective_rpc", payload)

    def _weights_call(self, request: WeightRequest) -> EngineReply:
        body: dict[str, Any] = request.to_json()
        if isinstance(request, InitRequest | TensorRequest):  # a colocated engine joins no group
            body.update(expected=self.expected, timeout_s=self.timeout_s)
        reply = replies_of(self.rpc("ppo_" + request.OP, body), self.name, request.OP)
        version = request.weight_version if isinstance(request, UpdateRequest | TensorRequest) else None
        if version is not None and reply.success and self.version_routes:
            answer = self.request("POST", "/update_weight_version", {"new_version": version})
            if not (isinstance(answer, Mapping) and answer.get("success")):
                return EngineReply.refused(f"weights loaded, but the version was not set: {answer}")
        return reply

    def _forward(self, request: WeightRequest) -> Pending[EngineReply]:
        future = self._executor().submit(self._weights_call, request)
        return _FuturePending(future, self.name, request.OP)

    # -- generation control ---------------------------------------------------------------------------
    def _status_call(self, method: str, route: str, body: dict[str, Any] | None) -> EngineReply:
        return _status_reply(*self._answer(method, route, body))

    def pause_generation(self) -> Pending[EngineReply]:
        return self._submit("POST", "/pause?mode=keep&clear_cache=true", None, self._status_call)

    def continue_generation(self) -> Pending[EngineReply]:
        return self._submit("POST", "/resume", None, self._status_call)

    def flush_cache(self) -> Pending[EngineReply]:
        return self._submit("POST", "/reset_prefix_cache", None, self._flush_call)

    def begin_weight_update(self) -> Pending[EngineReply]:
        return _NO_SESSION

    def end_weight_update(self) -> Pending[EngineReply]:
        return _NO_SESSION

    def get_weight_version(self) -> Pending[str | None]:
        if self.version_routes:
            future = self._executor().submit(self.request, "GET", "/weight_info")
        else:
            future = self._executor().submit(self.rpc, "ppo_weight_version", {})
        return _Mapped(_FuturePending(future, self.name, "get_weight_version"), _version_of)

    def __repr__(self) -> str:
        return f"VLLMEngineEndpoint({self.base_url!r}, num_gpus={self.num_gpus})"


def _version_of(body: Any) -> str | None:
    """``/weight_info``'s ``{"weight_version": ...}``, or the workers' (``{"results": [{...}, ...]}``)."""
    results = body.get("results") if isinstance(body, Mapping) else None
    if isinstance(results, list) and results:
        body = results[0]
    version = body.get("weight_version") if isinstance(body, Mapping) else None
    return None if version is None or version == VLLM_INITIAL_VERSION else str(version)


def _endpoint(args: tuple[Any, ...], flush_retry_s: float, version_routes: bool = True) -> VLLMEngineEndpoint:
    return VLLMEngineEndpoint(*args, flush_retry_s=flush_retry_s, version_routes=version_routes)
