"""The receiving side of an SGLang server, rebuilt from SGLang's source for the versions we support, so
that tests drive our sender and adapter against what a real server does, not against our own receiver.

:class:`SGLangReceiver` follows the model runner's weight updater (0.5.15.post1
``model_executor/model_runner.py``; 0.5.23 ``model_executor/model_runner_components/weight_updater.py``):
the group is joined exactly as ``init_custom_process_group`` does (``ppo_weight_sync.group``, no warm-up
broadcast); nothing is checked before the data arrives; per-tensor receives are async broadcasts waited in
order, a ``flattened_bucket`` is one broadcast viewed in place (unaligned tensors refused, 0.5.23
``weight_sync/tensor_bucket.py``); the replies carry SGLang's messages.

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ppo_weight_sync.buckets import dtype_from_name
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.group import WeightGroup
from ppo_weight_sync.ops import EngineReply, TensorOps, WeightOps
from ppo_weight_sync.requests import (
    DestroyRequest,
    InitRequest,
    TensorRequest,
    UpdateRequest,
    ValidationError,
)
from ppo_weight_sync.routes import RouteResult, validation_error, weight_reply
from ppo_weight_sync.sglang import SGLANG_MEMORY_TAGS, SGLangProtocol
from ppo_weight_sync.testing.sglang_tp import SchedulerCrash, TPRanks

__all__ = ["SGLangReceiver", "SGLangServerState", "SchedulerCrash", "ServerHooks"]

log = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class SGLangReceiver:
    """One TP rank's weight updater, as SGLang's. ``load_weights`` raises on a tensor it cannot load."""

    def __init__(
        self,
        load_weights: LoadWeights,
        device: torch.device,
        *,
        version: str,
        tp_rank: int = 0,
        timeout_s: float = 1800.0,  # SGLang passes no timeout: torch's default_pg_timeout, 30 min
    ) -> None:
        self._load = load_weights
        self.device = torch.device(device)
        self.protocol = SGLangProtocol.for_version(version)
        # < 0.5.21: the update's assert on the group is fatal and its failures read "Failed to update
        # parameter online"; from 0.5.21 the scheduler catches both ("Failed to receive weights").
        self.legacy = self.protocol.missing_group_is_fatal
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()
        self.weight_version: str | None = None  # the tokenizer manager's copy in SGLang

    def init_weights_update_group(self, request: InitRequest) -> EngineReply:
        if not request.group_name:
            raise AssertionError("Group name cannot be empty")  # an assert in SGLang: a 500, not a reply
        rank = request.rank_offset + self.tp_rank
        try:
            with on_device(self.device):
                # SGLang's init_custom_process_group binds nothing (torch's defaults): joining as it does
                # also checks that our bound sender meets a group torch's helper built.
                group = WeightGroup.join(request, rank, self.timeout_s, bind=False)
        except Exception as exc:
            return EngineReply.refused(f"Failed to initialize custom process group: {exc}.")
        with self._lock:
            self._groups[request.group_name] = group
        return EngineReply.ok("Succeeded to initialize custom process group.")

    def destroy_weights_update_group(self, request: DestroyRequest) -> EngineReply:
        with self._lock:
            group = self._groups.pop(request.group_name, None)
        if group is None:
            return EngineReply.refused("The group to be destroyed does not exist.")
        try:
            group.destroy_within(min(self.timeout_s, 60.0))
        except Exception as exc:
            return EngineReply.refused(f"Failed to destroy custom process group: {exc}.")
        return EngineReply.ok("Succeeded to destroy custom process group.")

    def get_weight_version(self) -> str | None:
        return self.weight_version

    def update_weights_from_tensor(self, request: TensorRequest) -> EngineReply:
        """This TP rank's part of ``update_weights_from_tensor``: it reads entry ``tp_rank`` only (0.5.23
        ``tp_worker.deserialize_own_rank``; 0.5.15.post1 ``tp_worker.update_weights_from_tensor``). The
        read and the load run outside any ``try`` in SGLang: a list too short for this rank (IndexError),
        an entry that does not unpickle, or a load that raises takes the server down. The flush and the
        version are the server's (:class:`SGLangServerState`)."""
        from ppo_weight_sync.ipc.payload import decode_flattened_bucket

        serialized_named_tensors, load_format = request.serialized_named_tensors, request.load_format

        if self.tp_rank >= len(serialized_named_tensors):
            raise SchedulerCrash(
                f"IndexError: list index out of range (TP rank {self.tp_rank} reads "
                f"serialized_named_tensors[{self.tp_rank}] of {len(serialized_named_tensors)} entries: "
                "the list needs one entry per TP rank)"
            )
        if load_format != "flattened_bucket":
            raise SchedulerCrash(f"NotImplementedError: Unknown load_format={load_format}")
        try:
            decoded = decode_flattened_bucket(serialized_named_tensors[self.tp_rank])
        except ValueError as exc:
            raise SchedulerCrash(f"deserializing TP rank {self.tp_rank}'s entry failed: {exc}") from exc
        if self.device.type != "cuda":
            raise SchedulerCrash(f"a CUDA IPC tensor cannot be rebuilt on {self.device}")
        try:
            with on_device(self.device):
                buffer = decoded.open()
                self._load(decoded.layout.views(buffer))
                wait_stream(self.device, self.timeout_s, "loading weights")
        except Exception as exc:
            raise SchedulerCrash(f"loading TP rank {self.tp_rank}'s tensors failed: {exc}") from exc
        return EngineReply.ok("Success")

    def _receive(self, group: WeightGroup, request: UpdateRequest) -> list[tuple[str, torch.Tensor]]:
        names, dtypes, shapes = request.names, request.dtypes, request.shapes
        if request.load_format == "flattened_bucket":
            metas, offset = [], 0
            for name, dtype_text, shape in zip(names, dtypes, shapes, strict=True):
                dtype = dtype_from_name(dtype_text)
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
                size = int(torch.Size(shape).numel()) * dtype.itemsize
                metas.append((name, dtype, tuple(shape), offset, size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8, device=self.device)
            group.broadcast(flat).wait()
            return [(n, flat[o : o + s].view(d).reshape(sh)) for n, d, sh, o, s in metas]
        weights, works = [], []
        for name, dtype_text, shape in zip(names, dtypes, shapes, strict=True):
            weight = torch.empty(shape, dtype=dtype_from_name(dtype_text), device=self.device)
            works.append(group.broadcast(weight))
            weights.append((name, weight))
        for work in works:
            work.wait()
        return weights

    def update_weights_from_distributed(self, request: UpdateRequest) -> EngineReply:
        group_name = request.group_name
        with self._lock:
            group = self._groups.get(group_name)
        missing = (
            f"Group {group_name} not in {list(self._groups)}. Please call `init_weights_update_group` first."
        )
        if group is None and self.legacy:
            # 0.5.15.post1: an assert outside the try, in the scheduler process: the server goes down.
            raise AssertionError(missing)
        try:
            if group is None:
                raise AssertionError(missing)
            with on_device(self.device):
                weights = self._receive(group, request)
                if not self.legacy:
                    wait_stream(self.device, self.timeout_s, "receiving weights")
        except Exception as exc:
            return self._failed(exc, "Failed to receive weights")
        try:
            with on_device(self.device):
                self._load(weights)
                wait_stream(self.device, self.timeout_s, "loading weights")
        except Exception as exc:
            return self._failed(exc, "Failed to update weights")
        if request.weight_version is not None:
            self.weight_version = request.weight_version
        return EngineReply.ok("Succeeded to update parameter online.")

    def _failed(self, exc: Exception, what: str) -> EngineReply:
        """A failed update's reply: ``what`` from 0.5.21 (the scheduler catches receive and load failures
        apart); before, one message for both."""
        if self.legacy:
            return EngineReply.refused(
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                "partially updated. Please discard the whole weights."
            )
        return EngineReply.refused(f"{what}: {exc}")


if TYPE_CHECKING:

    def _is_weight_ops(receiver: SGLangReceiver) -> WeightOps:
        return receiver

    def _is_tensor_ops(receiver: SGLangReceiver) -> TensorOps:
        return receiver


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
            # server_args' fields (dataclasses.asdict / resolved_dict) and the version, every version
            return RouteResult(
                200, {"version": self.version, "tp_size": self.ranks.tp_size, "dp_size": 1, "pp_size": 1}
            )
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
