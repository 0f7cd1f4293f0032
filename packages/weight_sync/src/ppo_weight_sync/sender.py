"""WeightSender: the trainer side. connect(engines) -> update(named_tensors, version)* -> disconnect().

The sender is rank 0 of its own group (see :mod:`ppo_weight_sync.group`); engine ``i`` joins at
``rank_offset = 1 + sum(num_gpus of engines before i)``. An update pauses generation, flushes the cache,
sends metadata then data in buckets (the next bucket is packed while the current one is on the wire),
continues generation and records the version on the engines. A sender is not thread-safe; updates of
several senders that share engines are serialised by an :class:`~ppo_weight_sync.lock.UpdateLock`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch

from ppo_weight_sync.buckets import (
    FLATTENED_BUCKET,
    STREAM_FORMAT_PREFIX,
    dtype_name,
    pack_into,
    plan_buckets,
    stream_format,
)
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.endpoints import EngineEndpoint, Pending
from ppo_weight_sync.errors import (
    RECEIVE_FAILED,
    EngineRejectedError,
    EngineTimeoutError,
    EngineUnavailableError,
    WeightSyncError,
)
from ppo_weight_sync.group import WeightGroup, free_port, local_address
from ppo_weight_sync.lock import PROCESS_LOCK, UpdateLock

__all__ = ["LOAD_FORMATS", "WeightSender"]

log = logging.getLogger(__name__)

# "auto" picks the best format every engine accepts: stream > flattened_bucket > per-tensor (None).
LOAD_FORMATS = ("auto", "stream", FLATTENED_BUCKET, "per_tensor")
_POLL_S = 0.0001


class WeightSender:
    """Sends a trainer's weights to rollout engines over a dedicated process group.

    ``timeout_s`` bounds every wait: each remote call's answer, each bucket's broadcast, the group's
    rendezvous (and it is the group's collective timeout). ``lock`` defaults to one lock shared by every
    sender of this process; pass a :class:`~ppo_weight_sync.lock.RayUpdateLock` when senders in several
    processes share engines.
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
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self._group: WeightGroup | None = None
        self._engines: list[EngineEndpoint] = []
        # (engine, group name) pairs that may still hold a group from a connection that failed; those
        # engines are asked to drop it when they are connected again.
        self._stale: list[tuple[EngineEndpoint, str]] = []
        self._group_name = ""  # the current connection's group (group_name-<random>)
        self._staging: list[torch.Tensor] = []
        self._load_format: str | None = None
        self._metrics = {"bytes": 0.0, "seconds": 0.0, "buckets": 0.0, "updates": 0.0}
        self.last_disconnect_errors: list[str] = []

    # ------------------------------------------------------------ state

    @property
    def is_connected(self) -> bool:
        return self._group is not None

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return tuple(self._engines)

    @property
    def group(self) -> WeightGroup | None:
        """The connection's group (rank 0 is this sender), for callers that add their own collectives."""
        return self._group

    @property
    def active_group_name(self) -> str:
        """The current connection's group name (``group_name-<random>``), '' when disconnected."""
        return self._group_name if self._group is not None else ""

    @property
    def load_format(self) -> str | None:
        """The load_format used with the connected engines (None: per-tensor broadcast)."""
        return self._load_format

    def pop_metrics(self) -> dict[str, float]:
        """Totals since the last call: ``weight_sync/{bytes,seconds,gb_per_s,buckets,updates}``."""
        m, self._metrics = self._metrics, {"bytes": 0.0, "seconds": 0.0, "buckets": 0.0, "updates": 0.0}
        rate = m["bytes"] / m["seconds"] / 1e9 if m["seconds"] > 0 else 0.0
        return {
            "weight_sync/bytes": m["bytes"],
            "weight_sync/seconds": m["seconds"],
            "weight_sync/gb_per_s": rate,
            "weight_sync/buckets": m["buckets"],
            "weight_sync/updates": m["updates"],
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
            self._disconnect_unlocked()
            self._reset_stale(engines)
            self._connect_unlocked(engines)
        finally:
            self.lock.release()

    def _choose_format(self, engines: Sequence[EngineEndpoint]) -> str | None:
        def all_accept(fmt: str) -> bool:
            return all(fmt in e.load_formats for e in engines)

        wanted = self.requested_load_format
        if wanted == "per_tensor":
            return None
        if wanted in ("auto", "stream") and all_accept(STREAM_FORMAT_PREFIX):
            return stream_format(self.bucket_bytes)
        if wanted in ("auto", FLATTENED_BUCKET) and all_accept(FLATTENED_BUCKET):
            return FLATTENED_BUCKET
        if wanted != "auto":
            refusing = [
                e.name
                for e in engines
                if (wanted if wanted != "stream" else STREAM_FORMAT_PREFIX) not in e.load_formats
            ]
            raise ValueError(
                f"load_format={wanted!r}: engines {refusing} do not accept it (their load_formats)"
            )
        return None

    def _connect_unlocked(self, engines: list[EngineEndpoint]) -> None:
        load_format = self._choose_format(engines)
        address = self.master_address or local_address()
        port = free_port(address if self.master_address else "")
        world_size = 1 + sum(e.num_gpus for e in engines)
        # Each connection is its own group, named group_name-<random>: a half-built group left behind
        # by a failed connection (on either side) can never collide with the next one.
        group_name = f"{self.group_name}-{uuid.uuid4().hex[:8]}"
        box: dict[str, Any] = {}
        handoff = threading.Lock()

        def join() -> None:
            try:
                group = WeightGroup(
                    master_address=address,
                    master_port=port,
                    rank=0,
                    world_size=world_size,
                    group_name=group_name,
                    backend=self.backend,
                    timeout_s=self.timeout_s,
                )
            except BaseException as exc:
                box["error"] = exc
                return
            with handoff:
                if box.get("abandoned"):
                    group.destroy(abort=True)  # connect gave up before the group formed
                else:
                    box["group"] = group

        # The engines' init calls and our own join block until every rank is in; ours runs on a side
        # thread so that an engine that fails or dies surfaces at once instead of after the timeout.
        joiner = threading.Thread(target=join, name=f"join-{self.group_name}", daemon=True)
        joiner.start()
        pending: list[tuple[EngineEndpoint, Pending]] = []
        try:
            offset = 1
            for engine in engines:
                pending.append(
                    (
                        engine,
                        engine.init_weights_update_group(
                            master_address=address,
                            master_port=port,
                            rank_offset=offset,
                            world_size=world_size,
                            group_name=group_name,
                            backend=self.backend,
                        ),
                    )
                )
                offset += engine.num_gpus
            deadline = time.monotonic() + self.timeout_s
            waiting = list(pending)
            while waiting or joiner.is_alive():
                for item in list(waiting):
                    engine, call = item
                    if call.done():
                        _check_reply(engine, "init_weights_update_group", call.result(self.timeout_s))
                        waiting.remove(item)
                if not joiner.is_alive() and "error" in box:
                    suspects = [e.name for e, _ in waiting] or [e.name for e in engines]
                    raise EngineUnavailableError(
                        ", ".join(suspects),
                        "init_weights_update_group",
                        f"the group did not form: {box['error']}",
                    )
                if time.monotonic() > deadline:
                    suspects = [e.name for e, _ in waiting] or [e.name for e in engines]
                    raise EngineTimeoutError(", ".join(suspects), "init_weights_update_group", self.timeout_s)
                time.sleep(0.01)
        except BaseException:
            with handoff:
                box["abandoned"] = True
                group = box.pop("group", None)
            if group is not None:
                group.destroy(abort=True)
            self._stale = [(e, group_name) for e in engines]
            raise
        self._group = box["group"]
        self._group_name = group_name
        self._engines = engines
        self._load_format = load_format

    def _reset_stale(self, engines: Sequence[EngineEndpoint]) -> None:
        """Ask engines that may hold a group from a failed connection to drop it (best effort)."""
        wanted = {id(e) for e in engines}
        calls = []
        for engine, name in self._stale:
            if id(engine) in wanted:
                try:
                    calls.append(engine.destroy_weights_update_group(group_name=name))
                except WeightSyncError:
                    continue
        for call in calls:
            try:
                call.result(min(self.timeout_s, 30.0))
            except WeightSyncError as exc:
                log.info("dropping a stale group on an engine failed (it is replaced anyway): %s", exc)
        self._stale = []

    def disconnect(self) -> None:
        """Engines destroy their side, then the sender destroys its group. Idempotent; never raises for a dead
        engine (its error goes to ``last_disconnect_errors`` and the log)."""
        self.lock.acquire(self.timeout_s)
        try:
            self._disconnect_unlocked()
        finally:
            self.lock.release()

    def _disconnect_unlocked(self) -> None:
        group, engines, name = self._group, self._engines, self._group_name
        self._group, self._engines, self._load_format = None, [], None
        self._staging = []
        if group is None:
            return
        errors: list[str] = []
        calls: list[tuple[EngineEndpoint, Pending]] = []
        for engine in engines:
            try:
                calls.append((engine, engine.destroy_weights_update_group(group_name=name)))
            except WeightSyncError as exc:
                errors.append(str(exc))
        # Our side is destroyed while the engines destroy theirs, not after their answers: with NCCL the
        # destroy (ncclCommFinalize + ncclCommDestroy) waits for every rank of the node to destroy too,
        # so waiting for the engines' replies first would leave each side waiting for the other.
        destroyer = threading.Thread(target=_quietly(group.destroy), name=f"destroy-{name}", daemon=True)
        destroyer.start()
        for engine, call in calls:
            try:
                _check_reply(engine, "destroy_weights_update_group", call.result(self.timeout_s))
            except WeightSyncError as exc:
                errors.append(str(exc))
        # An engine that failed to destroy its side may never do so: give ours a short grace, then abort.
        destroyer.join(min(self.timeout_s, 10.0) if errors else self.timeout_s)
        if destroyer.is_alive():
            group.abort_stuck()
            destroyer.join(min(self.timeout_s, 10.0))
            errors.append(
                f"destroying this sender's group {name!r} did not finish; its communicators were aborted"
            )
        if errors:
            self._stale = [(e, name) for e in engines]
            log.warning("disconnect: %s", "; ".join(errors))
        self.last_disconnect_errors = errors

    def _fail(self) -> None:
        """After a broken update: drop our group without waiting on peers, leave engines for next connect."""
        group, engines = self._group, self._engines
        self._group, self._engines, self._load_format = None, [], None
        self._stale = [(e, self._group_name) for e in engines]
        self._staging = []
        if group is not None:
            group.destroy(abort=True)

    # ------------------------------------------------------------ update

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str) -> None:
        """Send every ``(name, tensor)`` to every engine and set their weight version to ``version``."""
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
        if self._group is None:
            raise WeightSyncError("the sender is not connected: call connect(engines) first")
        self.lock.acquire(self.timeout_s)
        try:
            self._update_unlocked(items, version)
        finally:
            self.lock.release()

    def _update_unlocked(self, items: list[tuple[str, torch.Tensor]], version: str) -> None:
        if self._group is None:
            raise WeightSyncError("the sender was disconnected while waiting for the update lock")
        engines = list(self._engines)
        failure: BaseException | None = None
        paused = False
        try:
            self._all(engines, "pause_generation", lambda e: e.pause_generation())
            paused = True
            self._all(engines, "flush_cache", lambda e: e.flush_cache())
            start = time.perf_counter()
            with on_device(self.device):
                nbytes, buckets = self._send(engines, items, version)
            seconds = time.perf_counter() - start
            self._metrics["bytes"] += nbytes
            self._metrics["seconds"] += seconds
            self._metrics["buckets"] += buckets
            self._metrics["updates"] += 1
        except EngineRejectedError as exc:
            failure = exc
            raise
        except BaseException as exc:
            # A dead, unreachable or stuck engine, or a broken collective: the group is unusable.
            failure = exc
            self._fail()
            raise
        finally:
            if paused:
                self._continue(engines, failure)

    def _continue(self, engines: list[EngineEndpoint], failure: BaseException | None) -> None:
        try:
            self._all(engines, "continue_generation", lambda e: e.continue_generation())
        except WeightSyncError as exc:
            if failure is None:
                if isinstance(exc, EngineUnavailableError):
                    self._fail()
                raise
            log.warning("continue_generation after a failed update: %s", exc)

    def _all(self, engines: Sequence[EngineEndpoint], op: str, call: Any) -> list[Any]:
        pending = [(e, call(e)) for e in engines]
        return [_check_reply(e, op, p.result(self.timeout_s)) for e, p in pending]

    def _prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.detach()
        if t.device != self.device:
            t = t.to(self.device)
        return t.contiguous()

    def _send(
        self, engines: list[EngineEndpoint], items: list[tuple[str, torch.Tensor]], version: str
    ) -> tuple[int, int]:
        names = [n for n, _ in items]
        dtypes = [dtype_name(t.dtype) for _, t in items]
        shapes = [list(t.shape) for _, t in items]
        sizes = [t.numel() * t.element_size() for _, t in items]
        plan = plan_buckets(sizes, self.bucket_bytes)
        fmt = self._load_format
        group = self._group
        if group is None:
            raise WeightSyncError("the sender is not connected: call connect(engines) first")

        if fmt is not None and fmt.startswith(STREAM_FORMAT_PREFIX):
            calls = [
                (
                    e,
                    e.update_weights_from_distributed(
                        names=names,
                        dtypes=dtypes,
                        shapes=shapes,
                        group_name=self._group_name,
                        weight_version=version,
                        flush_cache=True,
                        load_format=fmt,
                    ),
                )
                for e in engines
            ]
            sender = _FlatSender(self, group, [t for _, t in items], plan, calls)
            for k in range(len(plan)):
                sender.send(k)
            sender.drain()
            sender.settle()
            sender.replies(calls)
            return sum(sizes), len(plan)

        flat = fmt == FLATTENED_BUCKET
        sender = _FlatSender(self, group, [t for _, t in items], plan, [])
        per_tensor: list[torch.Tensor] = []
        if not flat:
            a, b = plan[0]
            per_tensor = [self._prepare(t) for _, t in items[a:b]]
        for k, (a, b) in enumerate(plan):
            last = k == len(plan) - 1
            calls = [
                (
                    e,
                    e.update_weights_from_distributed(
                        names=names[a:b],
                        dtypes=dtypes[a:b],
                        shapes=shapes[a:b],
                        group_name=self._group_name,
                        weight_version=version if last else None,
                        flush_cache=last,
                        load_format=fmt,
                    ),
                )
                for e in engines
            ]
            sender.calls = calls
            if flat:
                sender.send(k)  # packs bucket k+1 while bucket k is on the wire
                sender.drain()
                if last:
                    sender.settle()
            else:
                works = [group.broadcast(t) for t in per_tensor]
                # Prepare the next bucket's tensors (device copies) while this one is on the wire.
                nxt = (
                    [self._prepare(t) for _, t in items[plan[k + 1][0] : plan[k + 1][1]]] if not last else []
                )
                for work in works:
                    sender.wait(work)
                if last:
                    sender.settle()
                del works  # the tensors they sent are complete (waited above) and may be freed
                per_tensor = nxt
            sender.replies(calls)
        return sum(sizes), len(plan)

    def _staging_buffers(self, size: int) -> list[torch.Tensor]:
        """Two staging buffers of at least ``size`` bytes, kept between updates: fresh host memory costs a
        page fault per page on first touch, which would dominate a CPU update."""
        if size == 0:
            return []
        if not self._staging or self._staging[0].numel() < size:
            self._staging = []  # free the old pair before allocating the new one
            self._staging = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._staging


class _FlatSender:
    """Sends planned buckets as flat uint8 buffers through two staging buffers (pack k+1 while k flies)."""

    def __init__(
        self,
        owner: WeightSender,
        group: WeightGroup,
        tensors: list[torch.Tensor],
        plan: list[tuple[int, int]],
        calls: list[tuple[EngineEndpoint, Pending]],
    ) -> None:
        self.owner, self.group, self.tensors, self.plan, self.calls = owner, group, tensors, plan, calls
        self.device = owner.device
        self.cuda = self.device.type == "cuda"
        sizes = [sum(t.numel() * t.element_size() for t in tensors[a:b]) for a, b in plan]
        self.sizes = sizes
        multi = [s for (a, b), s in zip(plan, sizes, strict=True) if b - a > 1]
        self.buffers = owner._staging_buffers(max(multi, default=0))
        # (work, staging slot or None, the buffer it sends): the buffer stays referenced here until its
        # broadcast completed, so a one-tensor bucket's device copy is never freed while NCCL reads it.
        self.in_flight: list[tuple[Any, int | None, torch.Tensor]] = []
        self.slot_work: list[Any] = [None, None]
        self.packed: dict[int, tuple[torch.Tensor, int | None]] = {}
        self.completed = 0  # broadcasts that finished without error on this side

    def _pack(self, k: int) -> tuple[torch.Tensor, int | None]:
        a, b = self.plan[k]
        if b - a == 1:
            # A bucket of one tensor goes as it is (a byte view), no staging copy.
            t = self.owner._prepare(self.tensors[a])
            return t.reshape(-1).view(torch.uint8), None
        slot = k % 2
        previous = self.slot_work[slot]
        if previous is not None:
            # The buffer's previous bucket must be off the wire before it is overwritten. On the GPU the
            # stream waits for it (the CPU runs on); elsewhere this thread waits, within the timeout.
            if self.cuda:
                previous.wait()
            else:
                self.wait(previous)
            self.slot_work[slot] = None
        return pack_into(self.buffers[slot], self.tensors[a:b]), slot

    def send(self, k: int) -> None:
        buf, slot = self.packed.pop(k) if k in self.packed else self._pack(k)
        work = self.group.broadcast(buf)
        self.in_flight.append((work, slot, buf))
        if slot is not None:
            self.slot_work[slot] = work
        if k + 1 < len(self.plan):
            self.packed[k + 1] = self._pack(k + 1)

    def drain(self) -> None:
        while self.in_flight:
            work, slot, _buf = self.in_flight[0]
            self.wait(work)
            self.in_flight.pop(0)
            if slot is not None and self.slot_work[slot] is work:
                self.slot_work[slot] = None

    def settle(self) -> None:
        """After the last bucket: the host waits (bounded) until this device's stream has finished too,
        so nothing queued for the update (packing copies, stream waits) is still pending when it returns
        and the caller may free or overwrite the tensors it sent."""
        if not self.cuda:
            return
        try:
            wait_stream(self.device, self.owner.timeout_s, "sending weights", check=self._check_calls)
        except WeightSyncError:
            raise
        except Exception as exc:
            self._blame(exc)

    def wait(self, work: Any) -> None:
        """Wait for one broadcast; bounded by the timeout; an engine call that fails meanwhile ends it."""
        timeout_s = self.owner.timeout_s
        try:
            if not self.cuda:
                work.wait(timedelta(seconds=timeout_s))
                return
            deadline = time.monotonic() + timeout_s
            while not work.is_completed():
                self._check_calls()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"broadcast not complete within {timeout_s:g} s")
                time.sleep(_POLL_S)
            # is_completed() is also true for a work that failed: wait() raises its error, and orders
            # this stream after the broadcast (it returns at once, the kernel has finished).
            work.wait()
        except WeightSyncError:
            raise
        except Exception as exc:
            self._blame(exc)
        self.completed += 1

    def replies(self, calls: list[tuple[EngineEndpoint, Pending]]) -> None:
        """The engines' answers for this update; a failed one also says how this side fared."""
        for engine, call in calls:
            try:
                _check_reply(engine, "update_weights_from_distributed", call.result(self.owner.timeout_s))
            except EngineUnavailableError as err:
                raise self._with_own_side(err) from None

    def _own_failure(self) -> str:
        """This side's own error, when a broadcast still listed in flight already failed here."""
        for work, _slot, _buf in self.in_flight:
            try:
                if work.is_completed():
                    work.wait()  # returns at once for a finished work; raises its error for a failed one
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
        return ""

    def _with_own_side(self, err: EngineUnavailableError) -> EngineUnavailableError:
        # An engine's failure reply alone hides whether the sender's side failed (its error is then the
        # cause) or completed (then its communicator never reached the engine: e.g. a group that is not
        # the one the engine joined). Say which, in the same exception.
        own = self._own_failure()
        side = (
            f"this sender's side failed too: {own}"
            if own
            else f"this sender's side reported no error ({self.completed} broadcast(s) complete here)"
        )
        err.args = (f"{err.args[0] if err.args else err}; {side}",)
        return err

    def _check_calls(self) -> None:
        for engine, call in self.calls:
            if call.done():
                try:
                    reply = call.result(self.owner.timeout_s)
                    # An engine that answered before the data arrived did not take it: its error is the
                    # cause, with this side's own error (if any) beside it.
                    _check_reply(engine, "update_weights_from_distributed", reply)
                except EngineUnavailableError as err:
                    raise self._with_own_side(err) from None

    def _blame(self, exc: BaseException) -> None:
        # A broken broadcast: find the engine whose call failed (a dead actor or server answers fast).
        for engine, call in self.calls:
            try:
                reply = call.result(2.0)
            except EngineTimeoutError:
                continue
            except EngineUnavailableError as err:
                raise EngineUnavailableError(
                    engine.name, "update_weights_from_distributed", f"{err}; broadcast: {exc}"
                ) from exc
            if isinstance(reply, dict) and reply.get("success") is False:
                raise EngineUnavailableError(
                    engine.name,
                    "update_weights_from_distributed",
                    f"{reply.get('message')}; broadcast: {exc}",
                ) from exc
        names = ", ".join(e.name for e, _ in self.calls) or ", ".join(e.name for e in self.owner.engines)
        raise EngineUnavailableError(names, "weight broadcast", str(exc)) from exc


def _quietly(fn: Any) -> Any:
    def run() -> None:
        try:
            fn()
        except Exception as exc:  # a side thread: log, do not crash the process's excepthook
            log.warning("destroying a weight group failed: %s", exc)

    return run


def _check_reply(engine: EngineEndpoint, op: str, reply: Any) -> Any:
    if isinstance(reply, dict) and reply.get("success") is False:
        message = str(reply.get("message", ""))
        if message.startswith(RECEIVE_FAILED):
            # The engine dropped its side of the group (the data did not arrive): not a rejection that
            # leaves the group usable, so the update fails as unavailable and the sender disconnects.
            raise EngineUnavailableError(engine.name, op, message)
        raise EngineRejectedError(engine.name, op, message)
    return reply
