"""Engine endpoints: how the sender reaches an engine (a Ray actor handle, or an SGLang-style HTTP URL).

An endpoint's methods are the :class:`~ppo_weight_sync.ops.EngineOps` weight and generation operations,
with the same request values (:mod:`ppo_weight_sync.requests`), each returning a :class:`Pending` of the
same result:
``result(timeout_s)`` gives the engine's :class:`~ppo_weight_sync.ops.EngineReply` (the version string or
None for ``get_weight_version``) or raises :class:`~ppo_weight_sync.errors.EngineUnavailableError` /
``EngineTimeoutError`` naming the engine.
"""

from __future__ import annotations

import concurrent.futures
import copy
import http.client
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from ppo_weight_sync.buckets import FLATTENED_BUCKET, STREAM_FORMAT_PREFIX
from ppo_weight_sync.errors import EngineTimeoutError, EngineUnavailableError
from ppo_weight_sync.http_client import JsonHttpClient
from ppo_weight_sync.ops import EngineReply, WeightOpsForwarder
from ppo_weight_sync.requests import DestroyRequest, InitRequest, TensorRequest, UpdateRequest, WeightRequest
from ppo_weight_sync.sglang import SGLangProtocol, group_ranks_of

__all__ = [
    "RECEIVER_LOAD_FORMATS",
    "Done",
    "EngineEndpoint",
    "HttpEngineEndpoint",
    "Pending",
    "RayEngineEndpoint",
    "reply_from_http",
]

# load formats an engine may accept besides per-tensor broadcast (load_format None, every SGLang); the last
# two are the colocated (CUDA IPC) formats of update_weights_from_tensor (ppo_weight_sync.ipc): one
# request per bucket, one request per update.
RECEIVER_LOAD_FORMATS: tuple[str, ...] = (
    STREAM_FORMAT_PREFIX,
    FLATTENED_BUCKET,
    "ppo_ipc_bucket",
    "ppo_ipc_stream",
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
U = TypeVar("U")


class Pending(Protocol[T_co]):
    """A call in flight. ``done()`` never blocks; ``result`` waits at most ``timeout_s`` seconds."""

    def done(self) -> bool: ...
    def result(self, timeout_s: float) -> T_co: ...


@runtime_checkable
class EngineEndpoint(Protocol):
    """One engine, as the sender sees it. ``num_gpus`` ranks join the group from ``rank_offset``.

    ``load_formats`` lists the transfer formats the engine accepts beyond per-tensor broadcast:
    ``"flattened_bucket"`` (SGLang's name: one flat buffer per call) and ``"ppo_flat_stream:"`` (ours:
    one call per update, flat buffers per bucket; :class:`~ppo_weight_sync.WeightReceiver` accepts both).
    The operations are :class:`~ppo_weight_sync.ops.EngineOps`' (same names, same request values).
    """

    name: str
    num_gpus: int
    load_formats: tuple[str, ...]

    def init_weights_update_group(self, request: InitRequest) -> Pending[EngineReply]: ...
    def update_weights_from_distributed(self, request: UpdateRequest) -> Pending[EngineReply]: ...
    def update_weights_from_tensor(self, request: TensorRequest) -> Pending[EngineReply]: ...
    def destroy_weights_update_group(self, request: DestroyRequest) -> Pending[EngineReply]: ...
    def pause_generation(self) -> Pending[EngineReply]: ...
    def continue_generation(self) -> Pending[EngineReply]: ...
    def flush_cache(self) -> Pending[EngineReply]: ...
    def get_weight_version(self) -> Pending[str | None]: ...

    # The weight-update session of SGLang >= 0.5.21 (an immediate success for engines without one): the
    # sender opens it after the flush and closes it after the last bucket, also after a failure.
    def begin_weight_update(self) -> Pending[EngineReply]: ...
    def end_weight_update(self) -> Pending[EngineReply]: ...


@dataclass(frozen=True)
class Done(Generic[T]):
    """A call that needed no round trip: its answer is already here."""

    value: T

    def done(self) -> bool:
        return True

    def result(self, timeout_s: float) -> T:
        return self.value


_NO_SESSION = Done(EngineReply.ok("this engine needs no weight-update session"))


def reply_from_http(status: int, body: Any) -> EngineReply:
    """An answered request as an :class:`EngineReply`, whatever shape SGLang's route answers in.

    ``{"success", "message"}`` (weight routes); ``{"object": "error", ...}`` (FastAPI validation and
    ``HTTPException``, 400); ``{"error": {"message"}}`` (``_create_error_response``); ``{"message",
    "status": "ok"}`` (pause/continue); text (flush_cache); ``null`` (memory routes). A status outside
    2xx is never a success, whatever the body says.
    """
    ok_status = 200 <= status < 300
    if isinstance(body, Mapping):
        if body.get("object") == "error":
            return EngineReply(False, str(body.get("message", body)))
        if "success" in body:
            reply = EngineReply.from_json(body)
            return reply if ok_status or not reply.success else EngineReply(False, reply.message)
        if "error" in body:
            err = body["error"]
            return EngineReply(False, str(err.get("message", err) if isinstance(err, Mapping) else err))
        if body.get("status") not in (None, "ok"):
            return EngineReply(False, str(body))
        message = str(body.get("message", "")) if "message" in body else str(body)
        return EngineReply(ok_status, message)
    text = "" if body is None else str(body).strip()
    return EngineReply(ok_status, text or f"HTTP {status}")


def _check_gpus(num_gpus: int) -> int:
    if not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(
            f"num_gpus must be an int >= 1 (ranks the engine adds to the group), got {num_gpus!r}"
        )
    return num_gpus


# ---------------------------------------------------------------- Ray


class _RayPending(Generic[T]):
    def __init__(self, ref: Any, engine: str, op: str, kind: type[T]) -> None:
        self._ref, self._engine, self._op, self._kind = ref, engine, op, kind

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def result(self, timeout_s: float) -> T:
        import ray
        from ray import exceptions as rex

        try:
            value = ray.get(self._ref, timeout=timeout_s)
        except rex.GetTimeoutError:
            raise EngineTimeoutError(self._engine, self._op, timeout_s) from None
        except (rex.RayActorError, rex.ActorUnavailableError) as exc:
            # Ray's text runs to a dozen lines (ids, pid, possible causes): its first line says enough.
            what = "is unreachable" if isinstance(exc, rex.ActorUnavailableError) else "died"
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise EngineUnavailableError(
                self._engine, self._op, f"the engine actor {what} ({first})"
            ) from exc
        except rex.RayTaskError as exc:
            raise EngineUnavailableError(self._engine, self._op, f"raised {exc.cause!r}") from exc
        if not isinstance(value, self._kind):
            raise EngineUnavailableError(
                self._engine,
                self._op,
                f"answered a {type(value).__name__}, not a {self._kind.__name__} "
                "(does the actor implement EngineOps?)",
            )
        return value


class RayEngineEndpoint(WeightOpsForwarder[Pending[EngineReply]]):
    """An engine that is a Ray actor exposing :class:`~ppo_weight_sync.ops.EngineOps` as methods.

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

    def _call(self, op: str, kind: type[T], *args: Any) -> Pending[T]:
        try:
            ref = getattr(self.handle, op).remote(*args)
        except Exception as exc:  # submitting to a dead actor can raise here rather than on get
            raise EngineUnavailableError(self.name, op, f"could not submit: {exc}") from exc
        return _RayPending(ref, self.name, op, kind)

    def _forward(self, request: WeightRequest) -> Pending[EngineReply]:
        return self._call(request.OP, EngineReply, request)

    def pause_generation(self) -> Pending[EngineReply]:
        return self._call("pause_generation", EngineReply)

    def continue_generation(self) -> Pending[EngineReply]:
        return self._call("continue_generation", EngineReply)

    def flush_cache(self) -> Pending[EngineReply]:
        return self._call("flush_cache", EngineReply)

    def get_weight_version(self) -> Pending[str | None]:
        return _Mapped(self._call("get_weight_version", object), _version)

    def begin_weight_update(self) -> Pending[EngineReply]:
        return _NO_SESSION  # our engines load under their own step lock; no session to open

    def end_weight_update(self) -> Pending[EngineReply]:
        return _NO_SESSION

    def __repr__(self) -> str:
        return f"RayEngineEndpoint(name={self.name!r}, num_gpus={self.num_gpus})"


def _version(value: object) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------- HTTP (standard library only)


class _FuturePending(Generic[T]):
    def __init__(self, future: concurrent.futures.Future[T], engine: str, op: str) -> None:
        self._future, self._engine, self._op = future, engine, op

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout_s: float) -> T:
        try:
            error = self._future.exception(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            raise EngineTimeoutError(self._engine, self._op, timeout_s) from None
        if error is not None:
            # Raise a copy, never the future's own exception: raised here, that one would collect this
            # thread's frames (and every local they hold, such as an update's tensors) in a traceback
            # kept alive by the future, which those frames reference: a cycle only the collector frees.
            raise _fresh(error) from error
        return self._future.result(timeout=0)


def _fresh(error: BaseException) -> BaseException:
    try:
        return copy.copy(error)
    except Exception:  # an exception that does not copy: raise it as it is
        return error


class HttpEngineEndpoint(WeightOpsForwarder[Pending[EngineReply]]):
    """An engine behind SGLang's HTTP routes at ``base_url`` (``http://host:port``).

    Requests use the standard library, over one kept-alive HTTP/1.1 connection per thread (see
    :mod:`ppo_weight_sync.http_client`). ``timeout_s`` is the socket timeout of one request; the
    sender bounds each wait with its own timeout as well. ``load_formats`` defaults to per-tensor only
    (what every SGLang accepts); pass ``("flattened_bucket",)`` for an SGLang that has it, or
    ``RECEIVER_LOAD_FORMATS`` for a server built on :class:`~ppo_weight_sync.WeightReceiver`.

    ``sglang``: the protocol of a real SGLang server (:meth:`for_sglang` reads it from the server). It
    decides the pause mode, the weight-update session, where the weight version is read, and that every
    failed ``update_weights_from_distributed`` is ``group_lost``: SGLang's reply cannot say whether the
    group is still in step (its receive and load failures look alike), so the sender must rebuild it.
    Without it the endpoint speaks to our own servers (:mod:`ppo_weight_sync.routes`).
    """

    def __init__(
        self,
        base_url: str,
        num_gpus: int = 1,
        timeout_s: float = 600.0,
        name: str = "",
        load_formats: tuple[str, ...] = (),
        *,
        sglang: SGLangProtocol | None = None,
        flush_retry_s: float = 60.0,
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
        self.sglang = sglang
        self.flush_retry_s = flush_retry_s
        self._http = JsonHttpClient(self.base_url, timeout_s)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy sent to another process (a trainer's Ray worker) opens its own connections and threads.
        args = (self.base_url, self.num_gpus, self.timeout_s, self.name, self.load_formats)
        return (_endpoint, (args, self.sglang, self.flush_retry_s))

    @classmethod
    def for_sglang(
        cls,
        base_url: str,
        num_gpus: int | None = None,
        timeout_s: float = 600.0,
        name: str = "",
        load_formats: tuple[str, ...] = ("flattened_bucket",),
    ) -> HttpEngineEndpoint:
        """An endpoint for the SGLang server at ``base_url``, its protocol and size read from
        ``GET /server_info``: ``version`` (ValueError naming it when we do not support it) and ``tp_size``,
        the ranks it adds to the weight group (:func:`~ppo_weight_sync.sglang.group_ranks_of`).
        ``num_gpus``: what the config expects; a server of another TP size is a ValueError naming both."""
        probe = cls(base_url, 1, timeout_s, name)
        try:
            info = probe.request("GET", "/server_info")
        finally:
            probe.close()
        version = info.get("version") if isinstance(info, Mapping) else None
        if not isinstance(info, Mapping) or not isinstance(version, str):
            raise EngineUnavailableError(
                probe.name, "server_info", f"no SGLang version in GET /server_info: {str(info)[:200]}"
            )
        protocol = SGLangProtocol.for_version(version)
        ranks = group_ranks_of(info, probe.name)
        if num_gpus is not None and num_gpus != ranks:
            raise ValueError(
                f"SGLang server {probe.name} runs with tp_size={ranks}, but num_gpus={num_gpus} was given: "
                "set the engine's tp_size in the config to the server's (or relaunch the server)"
            )
        return cls(base_url, ranks, timeout_s, name, load_formats, sglang=protocol)

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix=f"http-{self.name}")
            return self._pool

    def _answer(
        self, method: str, route: str, body: dict[str, Any] | None, also: tuple[int, ...] = ()
    ) -> tuple[int, Any]:
        """One request's status and body; ``also``: statuses answered as they are besides 2xx and 400
        (a probe of whether a route exists takes 404)."""
        op = route.strip("/")
        try:
            reply = self._http.request(method, route, body)
        except TimeoutError:
            raise EngineTimeoutError(self.name, op, self.timeout_s) from None
        except (http.client.HTTPException, OSError) as exc:
            raise EngineUnavailableError(self.name, op, f"unreachable: {type(exc).__name__}: {exc}") from exc
        # 400 is SGLang's answer to a refused operation (JSON for the weight operations, text for
        # flush_cache): a refusal, not a dead engine. Anything else outside 2xx is an unusable engine.
        if not (200 <= reply.status < 300 or reply.status == 400 or reply.status in also):
            raise EngineUnavailableError(self.name, op, f"HTTP {reply.status}: {reply.body!r}")
        return reply.status, reply.body

    def request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        """One blocking request; returns the decoded JSON (or text) body, including 400 answers."""
        status, payload = self._answer(method, route, body)
        if status == 400 and not isinstance(payload, dict):
            return {"success": False, "message": str(payload)}
        return payload

    def call(self, method: str, route: str, body: dict[str, Any] | None = None) -> EngineReply:
        """One blocking request to an operation's route; its answer as an :class:`EngineReply`."""
        return reply_from_http(*self._answer(method, route, body))

    def _submit(
        self,
        method: str,
        route: str,
        body: dict[str, Any] | None = None,
        run: Callable[[str, str, dict[str, Any] | None], EngineReply] | None = None,
    ) -> Pending[EngineReply]:
        future = self._executor().submit(run or self.call, method, route, body)
        return _FuturePending(future, self.name, route.strip("/"))

    def _update_call(self, method: str, route: str, body: dict[str, Any] | None) -> EngineReply:
        reply = self.call(method, route, body)
        if self.sglang is not None and not reply.success:
            return EngineReply.lost(reply.message)
        return reply

    def _flush_call(self, method: str, route: str, body: dict[str, Any] | None) -> EngineReply:
        # SGLang answers 400 while requests are still running or queued (Scheduler.flush_cache); they
        # finish or abort within moments of a pause. Retried 1 s apart for up to flush_retry_s, as slime.
        deadline = time.monotonic() + min(self.flush_retry_s, self.timeout_s)
        while True:
            reply = self.call(method, route, body)
            if reply.success or time.monotonic() >= deadline:
                return reply
            time.sleep(1.0)

    def _forward(self, request: WeightRequest) -> Pending[EngineReply]:
        run = self._update_call if isinstance(request, UpdateRequest) else self.call
        return self._submit("POST", "/" + request.OP, request.to_json(), run)

    def pause_generation(self) -> Pending[EngineReply]:
        # The mode on purpose: SGLang's default ({}) is "abort" (SGLangProtocol says which one a version
        # can use); our own servers hold generation in place whatever the body says.
        body = {"mode": self.sglang.pause_mode} if self.sglang is not None else {}
        return self._submit("POST", "/pause_generation", body)

    def continue_generation(self) -> Pending[EngineReply]:
        return self._submit("POST", "/continue_generation", {})

    def flush_cache(self) -> Pending[EngineReply]:
        return self._submit("POST", "/flush_cache", None, self._flush_call)

    def begin_weight_update(self) -> Pending[EngineReply]:
        if self.sglang is None or not self.sglang.weight_update_session:
            return _NO_SESSION
        return self._submit("POST", "/begin_weight_update", {})

    def end_weight_update(self) -> Pending[EngineReply]:
        if self.sglang is None or not self.sglang.weight_update_session:
            return _NO_SESSION
        return self._submit("POST", "/end_weight_update", {})

    def get_weight_version(self) -> Pending[str | None]:
        # SGLang reports the version in /model_info (every version we support); /get_weight_version
        # answers 404 on 0.5.15.post1 and is gone on 0.5.23. Our own servers serve both.
        route = self.sglang.weight_version_route if self.sglang is not None else "/get_weight_version"
        future = self._executor().submit(self.request, "GET", route)
        return _Mapped(_FuturePending(future, self.name, "get_weight_version"), _weight_version_of)

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __repr__(self) -> str:
        return f"HttpEngineEndpoint({self.base_url!r}, num_gpus={self.num_gpus})"


def _endpoint(
    args: tuple[Any, ...], sglang: SGLangProtocol | None, flush_retry_s: float
) -> HttpEngineEndpoint:
    return HttpEngineEndpoint(*args, sglang=sglang, flush_retry_s=flush_retry_s)


def _weight_version_of(body: Any) -> str | None:
    version = body.get("weight_version") if isinstance(body, Mapping) else None
    return None if version is None else str(version)


class _Mapped(Generic[T, U]):
    def __init__(self, inner: Pending[T], fn: Callable[[T], U]) -> None:
        self._inner, self._fn = inner, fn

    def done(self) -> bool:
        return self._inner.done()

    def result(self, timeout_s: float) -> U:
        return self._fn(self._inner.result(timeout_s))
