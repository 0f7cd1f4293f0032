"""WeightSender: the trainer side. connect(engines) -> update(named_tensors, version)* -> disconnect().

An update pauses generation, flushes the cache, opens the engines' weight-update session (SGLang >= 0.5.21;
a no-op elsewhere), has every transport send the weights (metadata, then data in buckets), closes the
session and continues generation; the engines record the version with the last bucket. The non-finite
scan of the weights and the packing of the first bucket run while the pause and the flush are in flight
(they involve no engine); nothing reaches an engine's weights before the scan found every tensor finite.
The connection's state machine is :mod:`ppo_weight_sync.connection`; the wire formats are
:mod:`ppo_weight_sync.transports`.
A sender is not thread-safe; updates of several senders that share engines are serialised by an
:class:`~ppo_weight_sync.lock.UpdateLock`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from ppo_weight_sync.connection import Connection, ConnectionSettings
from ppo_weight_sync.device_sync import on_device
from ppo_weight_sync.endpoints import EngineEndpoint, Pending
from ppo_weight_sync.errors import (
    EngineRejectedError,
    EngineUnavailableError,
    NonFiniteTensorsError,
    WeightSyncError,
    check_reply,
)
from ppo_weight_sync.finite import FiniteCheck, start_finite_check
from ppo_weight_sync.group import WeightGroup
from ppo_weight_sync.ipc.transport import IpcTransport
from ppo_weight_sync.lock import PROCESS_LOCK, UpdateLock
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.transports import LOAD_FORMATS, TransportFactory

__all__ = ["LOAD_FORMATS", "WeightSender"]

_NO_METRICS = {
    "bytes": 0.0,
    "seconds": 0.0,
    "buckets": 0.0,
    "updates": 0.0,
    "ipc_bytes": 0.0,
    "ipc_seconds": 0.0,
    "ipc_buckets": 0.0,
    "check_seconds": 0.0,
    "control_before_seconds": 0.0,
    "control_after_seconds": 0.0,
    "update_seconds": 0.0,
}

log = logging.getLogger(__name__)

T = TypeVar("T")


class WeightSender:
    """Sends a trainer's weights to rollout engines over a dedicated process group.

    ``timeout_s`` bounds every wait: each remote call's answer, each bucket's broadcast, the group's
    rendezvous (and it is the group's collective timeout). ``lock`` defaults to one lock shared by every
    sender of this process; pass a :class:`~ppo_weight_sync.lock.RayUpdateLock` when senders in several
    processes share engines. ``transports``: factories that claim engines for a transport of their own
    (e.g. CUDA IPC for engines on this GPU); every other engine joins the weight group.
    ``check_finite`` (default): ``update`` refuses tensors holding NaN or infinite values with
    :class:`~ppo_weight_sync.errors.NonFiniteTensorsError` before any engine receives a byte (one extra
    read of the weights, while the pause and flush are in flight; the engines are then continued with
    their previous weights; see :mod:`ppo_weight_sync.finite`).
    """

    def __init__(
        self,
        *,
        backend: str = "gloo",
        bucket_bytes: int = 512 << 20,
        group_name: str = "ppo_weights",
        master_address: str | None = None,
        timeout_s: float = 300.0,
        lock: UpdateLock | None = None,
        load_format: str = "auto",
        transports: Sequence[TransportFactory] = (),
        check_finite: bool = True,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
        if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        if not group_name:
            raise ValueError("group_name must be a non-empty string")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.lock: UpdateLock = lock if lock is not None else PROCESS_LOCK
        self.requested_load_format = load_format
        self.check_finite = check_finite
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self._conn = Connection(
            ConnectionSettings(
                backend=backend,
                group_name=group_name,
                master_address=master_address,
                timeout_s=timeout_s,
                bucket_bytes=bucket_bytes,
                load_format=load_format,
                device=self.device,
                factories=tuple(transports),
            )
        )
        self._metrics = dict(_NO_METRICS)

    # ------------------------------------------------------------ state

    @property
    def is_connected(self) -> bool:
        return self._conn.is_connected

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return tuple(self._conn.engines)

    @property
    def group(self) -> WeightGroup | None:
        """The connection's group (rank 0 is this sender), for callers that add their own collectives."""
        return self._conn.group

    @property
    def active_group_name(self) -> str:
        """The current connection's group name (``group_name-<random>``), '' when disconnected."""
        return self._conn.group_name if self._conn.group is not None else ""

    @property
    def load_format(self) -> str | None:
        """The group's load_format with the connected engines (None: per-tensor broadcast or none)."""
        transport = self._conn.group_transport
        return transport.load_format if transport is not None else None

    @property
    def last_disconnect_errors(self) -> list[str]:
        return self._conn.last_disconnect_errors

    def pop_metrics(self) -> dict[str, float]:
        """Totals since the last call: ``weight_sync/{bytes,seconds,gb_per_s,buckets,updates}`` over every
        transport; ``weight_sync/ipc_{bytes,seconds,buckets}``, the colocated (CUDA IPC) engines' share;
        ``weight_sync/control_seconds``, the pause, flush and continue calls.

        Where each update's time went, as parts of the host's time that never overlap:
        ``weight_sync/update_seconds`` is the whole ``update()`` call of the updates that succeeded;
        ``weight_sync/check_seconds`` the host's time in the non-finite scan (issuing its reductions and
        waiting for its verdict; the pause and flush are in flight meanwhile, so the scan's time hidden
        under them is in neither part); ``weight_sync/control_before_seconds`` the rest of the time from
        the pause to the first byte (pause, flush, begin_weight_update, the first bucket's packing);
        ``weight_sync/seconds`` the transfer; ``weight_sync/control_after_seconds`` end_weight_update and
        continue_generation. ``control_seconds`` is ``control_before_seconds + control_after_seconds``;
        what ``update_seconds`` holds beyond the four parts is argument checks and the lock."""
        m, self._metrics = self._metrics, dict(_NO_METRICS)
        rate = m["bytes"] / m["seconds"] / 1e9 if m["seconds"] > 0 else 0.0
        return {
            "weight_sync/bytes": m["bytes"],
            "weight_sync/seconds": m["seconds"],
            "weight_sync/gb_per_s": rate,
            "weight_sync/buckets": m["buckets"],
            "weight_sync/updates": m["updates"],
            "weight_sync/ipc_bytes": m["ipc_bytes"],
            "weight_sync/ipc_seconds": m["ipc_seconds"],
            "weight_sync/ipc_buckets": m["ipc_buckets"],
            "weight_sync/control_seconds": m["control_before_seconds"] + m["control_after_seconds"],
            "weight_sync/check_seconds": m["check_seconds"],
            "weight_sync/control_before_seconds": m["control_before_seconds"],
            "weight_sync/control_after_seconds": m["control_after_seconds"],
            "weight_sync/update_seconds": m["update_seconds"],
        }

    # ------------------------------------------------------------ connect / disconnect

    def connect(self, engines: Sequence[EngineEndpoint]) -> None:
        """Join ``engines`` into a fresh group; a connected sender disconnects first."""
        engines = list(engines)
        if not engines:
            raise ValueError("engines must hold at least one EngineEndpoint")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique (they name engines in errors), got {names}")
        self.lock.acquire(self.timeout_s)
        try:
            self._conn.teardown()
            self._conn.join(engines)
        finally:
            self.lock.release()

    def disconnect(self) -> None:
        """Engines destroy their side while the sender destroys its group. Idempotent; never raises for a
        dead engine (its error goes to ``last_disconnect_errors`` and the log)."""
        self.lock.acquire(self.timeout_s)
        try:
            self._conn.teardown()
        finally:
            self.lock.release()

    # ------------------------------------------------------------ update

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Send every ``(name, tensor)`` to every engine and set their weight version to ``version``.

        Raises :class:`~ppo_weight_sync.errors.NonFiniteTensorsError` (nothing sent, still connected)
        when ``check_finite`` and a tensor holds NaN or infinite values: the engines were paused and
        flushed meanwhile and are continued with their previous weights."""
        started = time.perf_counter()
        if not isinstance(version, str) or not version:
            raise ValueError(f"version must be a non-empty str, got {version!r}")
        items = list(named_tensors)
        if not items:
            raise ValueError("named_tensors is empty: there is nothing to send")
        seen: set[str] = set()
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(
                    f"named_tensors[{name!r}] must be a torch.Tensor, got {type(tensor).__name__}"
                )
            if name in seen:
                raise ValueError(f"named_tensors holds {name!r} twice; names must be unique")
            seen.add(name)
        if not self._conn.is_connected:
            raise WeightSyncError("the sender is not connected: call connect(engines) first")
        self.lock.acquire(self.timeout_s)
        try:
            self._update_unlocked(items, version)
            self._metrics["update_seconds"] += time.perf_counter() - started
        finally:
            self.lock.release()

    def _update_unlocked(self, items: list[tuple[str, torch.Tensor]], version: str) -> None:
        if not self._conn.is_connected:
            raise WeightSyncError("the sender was disconnected while waiting for the update lock")
        engines = list(self._conn.engines)
        failure: BaseException | None = None
        paused = False
        in_session: list[EngineEndpoint] = []
        try:
            t0 = time.perf_counter()
            # The non-finite scan involves no engine, so it runs while the pause and the flush are in
            # flight: on the GPU its sums are queued now, just before the pause is sent, and their verdict
            # read once the flush was sent. Queued before, not after: the pause goes out on an HTTP thread,
            # which would take the interpreter lock from the hundreds of launches in the middle of them
            # (measured on an H200: the scan of 16 GB inside the update took 9 ms queued after the pause,
            # against 5 ms alone). Safety needs only that no byte reaches an engine before the verdict: for
            # a bad tensor the engines, paused and flushed, are continued with their previous weights, and
            # nothing is sent.
            check = self._start_check(items)
            scan_s = time.perf_counter() - t0 if check is not None else 0.0
            pausing = self._issue(engines, lambda e: e.pause_generation())
            paused = True
            self._replies(pausing, "pause_generation")
            # The flush must follow a completed pause (SGLang answers it with 400 while requests run: its
            # success says the engine is idle), and the data a completed flush.
            flushing = self._issue(engines, lambda e: e.flush_cache())
            # While the flush is in flight: the scan's verdict, then the first bucket is packed (queued on
            # the GPU; work that involves no engine, so it needs no pause; the transports send it once they
            # are told). Packed only after the verdict, so that a refused update leaves no packed bucket,
            # and no reference to its tensors, in a transport.
            t_scan = time.perf_counter()
            self._while_in_flight(flushing, self._finish_check, check)
            scan_s += time.perf_counter() - t_scan if check is not None else 0.0
            self._metrics["check_seconds"] += scan_s
            self._while_in_flight(flushing, self._prepare, items)
            self._replies(flushing, "flush_cache")
            in_session = engines
            self._all(engines, "begin_weight_update", lambda e: e.begin_weight_update())
            self._metrics["control_before_seconds"] += time.perf_counter() - t0 - scan_s
            start = time.perf_counter()
            nbytes = buckets = 0
            with on_device(self.device):
                for transport in self._conn.transports:
                    t0 = time.perf_counter()
                    sent = transport.send(items, version)
                    # bytes of the model (each transport sends all of it to its own engines)
                    nbytes, buckets = sent.nbytes, buckets + sent.buckets
                    if isinstance(transport, IpcTransport):  # colocated engines' share, on its own
                        self._metrics["ipc_bytes"] += sent.nbytes
                        self._metrics["ipc_seconds"] += time.perf_counter() - t0
                        self._metrics["ipc_buckets"] += sent.buckets
            self._metrics["seconds"] += time.perf_counter() - start
            t0 = time.perf_counter()
            in_session = []
            self._all(engines, "end_weight_update", lambda e: e.end_weight_update())
            self._metrics["control_after_seconds"] += time.perf_counter() - t0
            self._metrics["bytes"] += nbytes
            self._metrics["buckets"] += buckets
            self._metrics["updates"] += 1
        except (EngineRejectedError, NonFiniteTensorsError) as exc:
            failure = exc  # a refusal: the group is still in step (a refused scan sent nothing at all)
            raise
        except BaseException as exc:
            # A dead, unreachable or stuck engine, or a broken collective: the connection is unusable.
            failure = exc
            self._conn.reset()
            raise
        finally:
            try:
                if in_session:
                    self._end_after_failure(in_session)
                if paused:
                    self._continue(engines, failure)
            finally:
                # The exception's traceback holds this frame, whose local would hold the exception: a
                # cycle that keeps every tensor of the update (a whole gathered model on the GPU) until
                # the cyclic collector runs. Break it.
                failure = None

    def _while_in_flight(
        self, pending: list[tuple[EngineEndpoint, Pending[EngineReply]]], work: Callable[[Any], T], arg: Any
    ) -> T:
        """``work(arg)`` while ``pending`` calls are in flight. When it raises, every one of them is
        answered first (bounded; whatever the answer): the continue that follows the failure must not be
        overtaken by a late pause or flush (HTTP calls run on several threads)."""
        try:
            return work(arg)
        except BaseException:
            for _, call in pending:
                with contextlib.suppress(Exception):
                    call.result(self.timeout_s)
            raise

    def _start_check(self, items: list[tuple[str, torch.Tensor]]) -> FiniteCheck | None:
        return start_finite_check(items) if self.check_finite else None

    def _finish_check(self, check: FiniteCheck | None) -> None:
        """Raise :class:`NonFiniteTensorsError` when the scan found a bad tensor (nothing is sent)."""
        bad = check.result(self.timeout_s) if check is not None else []
        if bad:
            raise NonFiniteTensorsError(bad)

    def _prepare(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with on_device(self.device):
            for transport in self._conn.transports:
                transport.prepare(items)

    def _end_after_failure(self, engines: list[EngineEndpoint]) -> None:
        """Close the weight-update sessions a failed update left open (an open session refuses the next
        begin), best effort: the failure is what the caller hears about."""
        for engine in engines:
            try:
                check_reply(
                    engine.name, "end_weight_update", engine.end_weight_update().result(self.timeout_s)
                )
            except WeightSyncError as exc:
                # The text, not the exception: a kept log record must not keep the update's frames.
                log.warning("end_weight_update after a failed update: %s", str(exc))

    def _continue(self, engines: list[EngineEndpoint], failure: BaseException | None) -> None:
        t0 = time.perf_counter()
        try:
            self._all(engines, "continue_generation", lambda e: e.continue_generation())
            self._metrics["control_after_seconds"] += time.perf_counter() - t0
        except WeightSyncError as exc:
            if failure is None:
                if isinstance(exc, EngineUnavailableError):
                    self._conn.reset()
                raise
            log.warning("continue_generation after a failed update: %s", str(exc))

    def _all(self, engines: Sequence[EngineEndpoint], op: str, call: Any) -> list[EngineReply]:
        return self._replies(self._issue(engines, call), op)

    @staticmethod
    def _issue(
        engines: Sequence[EngineEndpoint], call: Any
    ) -> list[tuple[EngineEndpoint, Pending[EngineReply]]]:
        return [(e, call(e)) for e in engines]

    def _replies(
        self, pending: list[tuple[EngineEndpoint, Pending[EngineReply]]], op: str
    ) -> list[EngineReply]:
        return [check_reply(e.name, op, p.result(self.timeout_s)) for e, p in pending]
