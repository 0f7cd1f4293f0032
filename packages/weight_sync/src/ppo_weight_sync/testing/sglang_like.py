"""The receiving side of an SGLang server, rebuilt from SGLang's source for the versions we support, so
that tests drive our sender and adapter against what a real server does, not against our own receiver.

:class:`SGLangReceiver` (``sglang_receiver``, re-exported here) follows the model runner's weight
updater: one TP rank's side of the weight group, with SGLang's messages.

:class:`SGLangServerState` is the server around it (``entrypoints/http_server.py``,
``managers/tokenizer_manager.py``, ``managers/scheduler.py``, 0.5.23
``managers/scheduler_components/weight_updater.py``): ``/server_info`` with the version,
``/model_info`` with ``weight_version``, ``/get_weight_version`` answering 404, the weight-update session
of >= 0.5.21, pause modes, a flush refused (400) while requests are pending, memory tags that are not
idempotent (a resume of a tag not released, or a release while busy, takes the server down as the
scheduler's ``KeyError`` / ``AssertionError`` does), 400 ``{"object": "error"}`` validation replies.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.requests import (
    DestroyRequest,
    InitRequest,
    TensorRequest,
    UpdateRequest,
    ValidationError,
)
from ppo_weight_sync.routes import RouteResult, validation_error, weight_reply
from ppo_weight_sync.sglang import SGLANG_MEMORY_TAGS, SGLangProtocol
from ppo_weight_sync.testing.sglang_receiver import SchedulerCrash, SGLangReceiver
from ppo_weight_sync.testing.sglang_tp import TPRanks

__all__ = ["SGLangReceiver", "SGLangServerState", "SchedulerCrash", "ServerHooks"]

log = logging.getLogger(__name__)


class ServerHooks(Protocol):
    """What the server state asks of the engine it serves (generation and memory)."""

    def pause(self, mode: str) -> None: ...  # abort: in-flight requests end with finish_reason abort
    def resume(self) -> None: ...
    def running_requests(self) -> int: ...  # in the scheduler's running batch (in_place keeps them there)
    def waiting_requests(self) -> int: ...  # in the scheduler's waiting queue (retract puts them there)
    def flush(self) -> None: ...
    def release(self, tags: Sequence[str]) -> None: ...
    def restore(self, tags: Sequence[str]) -> None: ...


class SGLangServerState:
    """The routes of one SGLang server of ``version`` around its TP ranks' receivers and an engine's hooks.

    ``receiver``: TP rank 0's receiver alone (TP 1), or :class:`~.sglang_tp.TPRanks` (every rank).
    ``on_fatal(message)`` is called where SGLang's scheduler would raise and take the server down (the
    stand-in exits before it answers: the client's connection drops, as SGLang's kill of its process tree
    does).
    """

    def __init__(
        self,
        version: str,
        receiver: SGLangReceiver | TPRanks,
        hooks: ServerHooks,
        on_fatal: Callable[[str], None],
    ) -> None:
        self.protocol = SGLangProtocol.for_version(version)
        self.version = version
        self.ranks = receiver if isinstance(receiver, TPRanks) else TPRanks(receiver)
        self.receiver = self.ranks.local
        self.hooks = hooks
        self.on_fatal = on_fatal
        self.session_open = False
        self.paused: str | None = None  # the pause mode while paused
        self.released: set[str] = set()
        self._lock = threading.Lock()

    # -- the engine operations, as the server's tokenizer manager and scheduler run them ----------------
    def pause_generation(self, mode: str) -> None:
        self.paused = mode
        self.hooks.pause(mode)

    def continue_generation(self) -> None:
        self.paused = None
        self.hooks.resume()

    def is_fully_idle(self) -> bool:
        """The scheduler's idle check of ``flush_cache`` and ``release_memory_occupation``: 0.5.15.post1 to
        0.5.20 ``is_fully_idle()`` (running batch and waiting queue empty); from 0.5.21
        ``is_fully_idle(ignore_waiting=self._engine_paused)``, where ``_engine_paused`` is set by the
        ``retract`` and ``in_place`` pauses only (``abort`` ends requests in the tokenizer manager)."""
        if self.hooks.running_requests():
            return False
        scheduler_paused = self.paused in ("retract", "in_place")
        ignore_waiting = self.protocol.idle_ignores_waiting_when_paused and scheduler_paused
        return ignore_waiting or not self.hooks.waiting_requests()

    def flush_cache(self) -> bool:
        if not self.is_fully_idle():
            log.warning(
                "Cache not flushed because there are pending requests. #running: %d, #waiting: %d",
                self.hooks.running_requests(),
                self.hooks.waiting_requests(),
            )
            return False
        self.hooks.flush()
        return True

    def handle(self, method: str, path: str, body: Mapping[str, Any] | None) -> RouteResult | None:
        data: Mapping[str, Any] = body or {}
        try:
            return self._handle(method, path, data)
        except ValidationError as exc:
            return validation_error(str(exc))

    def _handle(self, method: str, path: str, data: Mapping[str, Any]) -> RouteResult | None:
        if method == "GET" and path in ("/server_info", "/get_server_info"):
            # server_args' fields (dataclasses.asdict, with the control-plane updates on top: the weight
            # version in effect, 0.5.17 tokenizer_manager.resolved_config_dict) and the version
            info = {"version": self.version, "tp_size": self.ranks.tp_size, "dp_size": 1, "pp_size": 1}
            return RouteResult(200, {**info, "weight_version": self.ranks.weight_version})
        if method == "GET" and path in ("/model_info", "/get_model_info"):
            return RouteResult(200, {"weight_version": self.ranks.weight_version, "is_generation": True})
        if path in ("/get_weight_version", "/weight_version"):
            if not self.protocol.weight_update_session:  # to 0.5.20: an HTTPException(404) with a message
                return RouteResult(
                    404,
                    {
                        "object": "error",
                        "message": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                        "Please use '/model_info' instead.",
                        "type": "404",
                        "param": None,
                        "code": 404,
                    },
                )
            return RouteResult(404, {"detail": "Not Found"})  # 0.5.23: no such route
        if path in ("/begin_weight_update", "/end_weight_update"):
            if not self.protocol.weight_update_session:
                return RouteResult(404, {"detail": "Not Found"})
            return self._session(path == "/begin_weight_update")
        if path == "/pause_generation" and method == "POST":
            mode = data.get("mode", "abort")
            if mode not in ("abort", "retract", "in_place"):
                raise ValidationError(
                    f"body.mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}"
                )
            self.pause_generation(str(mode))
            return RouteResult(200, {"message": "Generation paused successfully.", "status": "ok"})
        if path == "/continue_generation" and method == "POST":
            self.continue_generation()
            return RouteResult(200, {"message": "Generation continued successfully.", "status": "ok"})
        if path == "/update_weight_version" and method == "POST":
            return self._weight_version(data)
        if path == "/flush_cache" and method in ("GET", "POST"):
            if self.flush_cache():
                return RouteResult(
                    200,
                    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                    "waiting requests, the operation will not be performed.)\n",
                )
            return RouteResult(400, "Flush cache failed.\n")
        if path in ("/release_memory_occupation", "/resume_memory_occupation") and method in ("GET", "POST"):
            return self._memory(path == "/release_memory_occupation", data)
        if path == "/" + UpdateRequest.OP and method == "POST":
            return self._update(UpdateRequest, data)
        if path == "/" + TensorRequest.OP and method == "POST":
            return self._update(TensorRequest, data)
        if path == "/init_weights_update_group" and method == "POST":
            return weight_reply(self._fatal_on_crash(InitRequest.parse(data).send_to, self.ranks))
        if path == "/destroy_weights_update_group" and method == "POST":
            return weight_reply(DestroyRequest.parse(data).send_to(self.ranks))
        return None

    def _fatal_on_crash(self, op: Callable[[TPRanks], EngineReply], ranks: TPRanks) -> EngineReply:
        try:
            return op(ranks)
        except (AssertionError, SchedulerCrash) as exc:  # raised in SGLang's scheduler: the server goes down
            self.on_fatal(f"{type(exc).__name__}: {exc}")
            raise

    def _update(
        self, kind: type[UpdateRequest] | type[TensorRequest], data: Mapping[str, Any]
    ) -> RouteResult:
        """Both update routes: http_server -> tokenizer manager -> every TP rank's scheduler (0.5.23
        ``scheduler_components/weight_updater.py``, 0.5.15.post1 scheduler -> tp_worker); 400 on failure.
        From 0.5.21 only inside a weight-update session; 0.5.23 ``flush_cache_after_weight_update``: a
        refused flush fails the update call; the version is recorded once the update loaded."""
        if self.protocol.weight_update_session and not self.session_open:
            return weight_reply(
                EngineReply.refused(
                    f"{kind.OP} must run between begin_weight_update() and end_weight_update()"
                )
            )
        request = kind.parse(data)
        reply = self._fatal_on_crash(request.send_to, self.ranks)
        if not reply.success:
            return weight_reply(reply)
        if request.flush_cache and not self.flush_cache():
            return weight_reply(
                EngineReply.refused(
                    "Weights were updated, but the cache was not flushed because requests are still "
                    "running or queued. Retract or finish them, then call /flush_cache."
                )
            )
        message = reply.message
        if request.weight_version is not None:
            self.ranks.weight_version = request.weight_version
            message = f"{message} Weight version updated to {request.weight_version}."
        return weight_reply(EngineReply.ok(message))

    def _weight_version(self, data: Mapping[str, Any]) -> RouteResult:
        """``POST /update_weight_version`` (0.5.15.post1 and 0.5.23 ``http_server.py``): the version alone,
        the weights untouched; ``abort_all_requests`` (default true) aborts the requests in flight first."""
        version = data.get("new_version")
        if not isinstance(version, str):
            raise ValidationError("body.new_version: Input should be a valid string")
        if data.get("abort_all_requests", True) and self.paused is None:
            self.hooks.pause("abort")  # tokenizer_manager.abort_request(abort_all=True)
            self.hooks.resume()
        self.ranks.weight_version = version
        return RouteResult(
            200, {"success": True, "message": f"Weight version updated to {version}", "new_version": version}
        )

    def _session(self, begin: bool) -> RouteResult:
        with self._lock:
            if begin and self.session_open:
                reply = EngineReply.refused(
                    "a weight-update session is already open; call end_weight_update() first"
                )
            elif not begin and not self.session_open:
                reply = EngineReply.refused(
                    "no weight-update session is open; call begin_weight_update() first"
                )
            else:
                self.session_open = begin
                reply = EngineReply.ok("Success")
        return RouteResult(200 if reply.success else 400, reply.to_json())

    def _memory(self, release: bool, data: Mapping[str, Any]) -> RouteResult:
        tags = data.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise ValidationError("body.tags: Input should be a valid list of strings")
        chosen = list(tags) if tags else list(SGLANG_MEMORY_TAGS)
        with self._lock:
            if release:
                # scheduler_components/weight_updater.py (0.5.15.post1 ~185, 0.5.23 ~339): an assert in the
                # scheduler process; it sends SIGQUIT to the server, which kills its process tree before
                # the tokenizer manager answers: the client sees its connection drop.
                if not self.is_fully_idle():
                    self.on_fatal(
                        "AssertionError: release_memory_occupation should be called only when server is idle."
                    )
                    return RouteResult(500, {"error": {"message": "scheduler died"}})
                self.released.update(chosen)
                self.hooks.release(chosen)
            else:
                missing = [t for t in chosen if t not in self.released]
                if missing:
                    # self.offload_tags.remove(tag) in the scheduler
                    self.on_fatal(
                        f"KeyError: {missing[0]!r} (resume_memory_occupation of a tag not released)"
                    )
                    return RouteResult(500, {"error": {"message": "scheduler died"}})
                self.released.difference_update(chosen)
                self.hooks.restore(chosen)
        return RouteResult(200, None)
