"""Engine endpoints: how the sender reaches an engine (a Ray actor handle, or an SGLang-style HTTP URL).

Every operation returns a :class:`Pending`; ``result(timeout_s)`` gives the engine's reply (SGLang's
``{"success": bool, "message": str}`` for the weight operations) or raises
:class:`~ppo_weight_sync.errors.EngineUnavailableError` / ``EngineTimeoutError`` naming the engine.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import threading
from typing import Any, Protocol, runtime_checkable

from ppo_weight_sync.buckets import FLATTENED_BUCKET, STREAM_FORMAT_PREFIX
from ppo_weight_sync.errors import EngineTimeoutError, EngineUnavailableError
from ppo_weight_sync.http_client import JsonHttpClient

__all__ = ["EngineEndpoint", "HttpEngineEndpoint", "Pending", "RayEngineEndpoint"]

# load formats an engine may accept besides per-tensor broadcast (load_format None, every SGLang).
RECEIVER_LOAD_FORMATS: tuple[str, ...] = (STREAM_FORMAT_PREFIX, FLATTENED_BUCKET)


class Pending(Protocol):
    """A call in flight. ``done()`` never blocks; ``result`` waits at most ``timeout_s`` seconds."""

    def done(self) -> bool: ...
    def result(self, timeout_s: float) -> Any: ...


@runtime_checkable
class EngineEndpoint(Protocol):
    """One engine, as the sender sees it. ``num_gpus`` ranks join the group from ``rank_offset``.

    ``load_formats`` lists the transfer formats the engine accepts beyond per-tensor broadcast:
    ``"flattened_bucket"`` (SGLang's name: one flat buffer per call) and ``"ppo_flat_stream:"`` (ours:
    one call per update, flat buffers per bucket; :class:`~ppo_weight_sync.WeightReceiver` accepts both).
    """

    name: str
    num_gpus: int
    load_formats: tuple[str, ...]

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> Pending: ...

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
    ) -> Pending: ...

    def destroy_weights_update_group(self, *, group_name: str) -> Pending: ...
    def pause_generation(self) -> Pending: ...
    def continue_generation(self) -> Pending: ...
    def flush_cache(self) -> Pending: ...
    def get_weight_version(self) -> Pending: ...


def _check_gpus(num_gpus: int) -> int:
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(
            f"num_gpus must be an int >= 1 (ranks the engine adds to the group), got {num_gpus!r}"
        )
    return num_gpus


# ---------------------------------------------------------------- Ray


class _RayPending:
    def __init__(self, ref: Any, engine: str, op: str) -> None:
        self._ref, self._engine, self._op = ref, engine, op

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self, timeout_s: float) -> Any:
        import ray
        from ray import exceptions as rex

        try:
            return ray.get(self._ref, timeout=timeout_s)
        except rex.GetTimeoutError:
            raise EngineTimeoutError(self._engine, self._op, timeout_s) from None
        except (rex.RayActorError, rex.ActorUnavailableError) as exc:
            raise EngineUnavailableError(
                self._engine, self._op, f"actor is dead or unreachable ({exc})"
            ) from exc
        except rex.RayTaskError as exc:
            raise EngineUnavailableError(self._engine, self._op, f"raised {exc.cause!r}") from exc


class RayEngineEndpoint:
    """An engine that is a Ray actor exposing the operations as methods.

    Create the actor with ``max_concurrency >= 2`` so that the weight calls run while it generates.
    """

    def __init__(
        self,
        handle: Any,
        num_gpus: int = 1,
        name: str = "",
        load_formats: tuple[str, ...] = RECEIVER_LOAD_FORMATS,
    ) -> None:
        self.handle = handle
        self.num_gpus = _check_gpus(num_gpus)
        self.name = name or f"ray-actor-{handle._actor_id.hex()[:12]}"
        self.load_formats = tuple(load_formats)

    def _call(self, op: str, **kwargs: Any) -> Pending:
        try:
            ref = getattr(self.handle, op).remote(**kwargs)
        except Exception as exc:  # submitting to a dead actor can raise here rather than on get
            raise EngineUnavailableError(self.name, op, f"could not submit: {exc}") from exc
        return _RayPending(ref, self.name, op)

    def init_weights_update_group(self, **kwargs: Any) -> Pending:
        return self._call("init_weights_update_group", **kwargs)

    def update_weights_from_distributed(self, **kwargs: Any) -> Pending:
        return self._call("update_weights_from_distributed", **kwargs)

    def destroy_weights_update_group(self, *, group_name: str) -> Pending:
        return self._call("destroy_weights_update_group", group_name=group_name)

    def pause_generation(self) -> Pending:
        return self._call("pause_generation")

    def continue_generation(self) -> Pending:
        return self._call("continue_generation")

    def flush_cache(self) -> Pending:
        return self._call("flush_cache")

    def get_weight_version(self) -> Pending:
        return self._call("get_weight_version")

    def __repr__(self) -> str:
        return f"RayEngineEndpoint(name={self.name!r}, num_gpus={self.num_gpus})"


# ---------------------------------------------------------------- HTTP (standard library only)


class _FuturePending:
    def __init__(self, future: concurrent.futures.Future[Any], engine: str, op: str) -> None:
        self._future, self._engine, self._op = future, engine, op

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout_s: float) -> Any:
        try:
            return self._future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise EngineTimeoutError(self._engine, self._op, timeout_s) from None


class HttpEngineEndpoint:
    """An engine behind SGLang's HTTP routes at ``base_url`` (``http://host:port``).

    Requests use the standard library, over one kept-alive HTTP/1.1 connection per thread (see
    :mod:`ppo_weight_sync.http_client`). ``timeout_s`` is the socket timeout of one request; the
    sender bounds each wait with its own timeout as well. ``load_formats`` defaults to per-tensor only
    (what every SGLang accepts); pass ``("flattened_bucket",)`` for an SGLang that has it, or
    ``RECEIVER_LOAD_FORMATS`` for a server built on :class:`~ppo_weight_sync.WeightReceiver`.
    """

    def __init__(
        self,
        base_url: str,
        num_gpus: int = 1,
        timeout_s: float = 600.0,
        name: str = "",
        load_formats: tuple[str, ...] = (),
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.num_gpus = _check_gpus(num_gpus)
        self.timeout_s = timeout_s
        self.name = name or self.base_url
        self.load_formats = tuple(load_formats)
        self._http = JsonHttpClient(self.base_url, timeout_s)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=f"http-{self.name}")
            return self._pool

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One blocking request; returns the decoded JSON (or text) body, including 400 answers."""
        op = route.strip("/")
        try:
            reply = self._http.request(method, route, body)
        except TimeoutError:
            raise EngineTimeoutError(self.name, op, self.timeout_s) from None
        except (http.client.HTTPException, OSError) as exc:
            raise EngineUnavailableError(self.name, op, f"unreachable: {type(exc).__name__}: {exc}") from exc
        if 200 <= reply.status < 300:
            return reply.body
        if reply.status == 400:
            # SGLang answers a refused operation with 400: JSON for the weight operations, text for
            # flush_cache. Either is a refusal, not a dead engine.
            payload = reply.body
            return payload if isinstance(payload, dict) else {"success": False, "message": str(payload)}
        raise EngineUnavailableError(self.name, op, f"HTTP {reply.status}: {reply.body!r}")

    def _submit(self, method: str, route: str, body: dict[str, Any] | None = None) -> Pending:
        future = self._executor().submit(self.request, method, route, body)
        return _FuturePending(future, self.name, route.strip("/"))

    def init_weights_update_group(self, **kwargs: Any) -> Pending:
        return self._submit("POST", "/init_weights_update_group", kwargs)

    def update_weights_from_distributed(self, **kwargs: Any) -> Pending:
        return self._submit("POST", "/update_weights_from_distributed", kwargs)

    def destroy_weights_update_group(self, *, group_name: str) -> Pending:
        return self._submit("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def pause_generation(self) -> Pending:
        return self._submit("POST", "/pause_generation", {})

    def continue_generation(self) -> Pending:
        return self._submit("POST", "/continue_generation", {})

    def flush_cache(self) -> Pending:
        return self._submit("POST", "/flush_cache")

    def get_weight_version(self) -> Pending:
        return _Mapped(self._submit("GET", "/get_weight_version"), lambda r: r.get("weight_version"))

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __repr__(self) -> str:
        return f"HttpEngineEndpoint({self.base_url!r}, num_gpus={self.num_gpus})"


class _Mapped:
    def __init__(self, inner: Pending, fn: Any) -> None:
        self._inner, self._fn = inner, fn

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout_s: float) -> Any:
        return self._fn(self._inner.result(timeout_s))
