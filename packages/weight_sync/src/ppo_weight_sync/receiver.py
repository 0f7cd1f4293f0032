"""WeightReceiver: the engine side of a weight update, for engines we write.

An engine holds one receiver per rank it puts in the group and forwards the SGLang-named operations to
it. The receiver joins the group, receives each bucket (tensor by tensor, one flattened buffer, or a
stream of flattened buffers), checks names/dtypes/shapes against what the engine holds, and hands
``(name, tensor)`` pairs to the engine's own loader. It satisfies :class:`~ppo_weight_sync.ops.WeightOps`;
every operation answers an :class:`~ppo_weight_sync.ops.EngineReply`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ppo_weight_sync.buckets import (
    FLATTENED_BUCKET,
    STREAM_FORMAT_PREFIX,
    TensorMeta,
    metas_from_request,
    parse_stream_format,
    plan_buckets,
    unpack,
)
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.group import WeightGroup
from ppo_weight_sync.ipc.receiving import IpcTensorReceiver
from ppo_weight_sync.ops import EngineReply, TensorOps, WeightOps
from ppo_weight_sync.requests import DestroyRequest, InitRequest, TensorRequest, UpdateRequest

__all__ = ["WeightReceiver"]

log = logging.getLogger(__name__)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
Expected = Callable[[], Mapping[str, tuple[torch.dtype, tuple[int, ...]]]]


class WeightReceiver:
    """Receives weight updates for one rank of an engine.

    ``load_weights`` is the engine's loader (it must copy what it keeps: buffers are reused);
    ``expected`` returns what the engine holds, ``{name: (dtype, shape)}``, to check requests against;
    ``local_rank`` is this rank's index inside the engine (its group rank is ``rank_offset + local_rank``);
    ``timeout_s`` bounds every receive when the request does not come with a group of its own.
    """

    def __init__(
        self,
        load_weights: LoadWeights,
        expected: Expected,
        device: torch.device,
        *,
        local_rank: int = 0,
        on_flush_cache: Callable[[], None] | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self._load = load_weights
        self._expected = expected
        self.device = torch.device(device)
        self.local_rank = local_rank
        self._on_flush = on_flush_cache
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup] = {}
        self._building: set[str] = set()
        self._busy: set[str] = set()  # groups with an update in progress
        self._buffers: dict[str, list[torch.Tensor]] = {}  # receive buffers per group, kept between updates
        # Guards the group tables only. An update holds no lock while it receives, so that an update stuck
        # on a group whose sender is gone (until the group's timeout) never blocks a new group's update.
        self._lock = threading.Lock()
        self.weight_version: str | None = None
        # Colocated updates (CUDA IPC, update_weights_from_tensor): one session per sender connection,
        # released by destroy_weights_update_group of its name.
        self._ipc = IpcTensorReceiver(
            load_weights, expected, self.device, tp_rank=local_rank, timeout_s=timeout_s
        )

    # ------------------------------------------------------------ group lifecycle

    def init_weights_update_group(self, request: InitRequest) -> EngineReply:
        group_name = request.group_name
        rank = request.rank_offset + self.local_rank
        with self._lock:
            if group_name in self._building:
                return EngineReply.refused(f"Group {group_name!r} is already being joined.")
            stale = self._groups.pop(group_name, None)
            self._building.add(group_name)
        # The rendezvous runs outside the lock: a join that waits for a peer that never comes (bounded by
        # the timeout) must not hold up joining a new group meanwhile.
        try:
            with self._on_device():
                if stale is not None:
                    # A sender that failed and reconnects under the same name: our old side is dead too.
                    stale.destroy(abort=True)
                group = WeightGroup.join(request, rank, self.timeout_s)
        except Exception as exc:
            log.warning("init_weights_update_group %s failed: %s", group_name, exc)
            return EngineReply.refused(f"Failed to init group {group_name!r} as rank {rank}: {exc}")
        finally:
            with self._lock:
                self._building.discard(group_name)
        with self._lock:
            self._groups[group_name] = group
        return EngineReply.ok(f"Joined group {group_name!r} as rank {rank}.")

    def destroy_weights_update_group(self, request: DestroyRequest) -> EngineReply:
        group_name = request.group_name
        unmapped = self._ipc.release(group_name)
        if unmapped:
            return EngineReply.ok(f"Released {unmapped} colocated buffer(s) of {group_name!r}.")
        with self._lock:
            group = self._groups.pop(group_name, None)
            busy = group_name in self._busy
            if not busy:
                self._buffers.pop(group_name, None)
        if group is None:
            return EngineReply.ok(f"Group {group_name!r} is not joined; nothing to destroy.")
        if busy:
            # Its update is waiting on a sender that gave up; that update destroys the group when it ends.
            return EngineReply.ok(f"Group {group_name!r} will be destroyed when its update ends.")
        # Bounded: with NCCL the destroy waits for the sender to destroy its side too.
        if not group.destroy_within(self.timeout_s):
            return EngineReply.ok(
                f"Destroyed group {group_name!r} (aborted: the peers did not destroy theirs)."
            )
        return EngineReply.ok(f"Destroyed group {group_name!r}.")

    def get_weight_version(self) -> str | None:
        return self.weight_version

    @property
    def ipc_mappings(self) -> int:
        """Sender buffers mapped for colocated updates, over every session (0 once all released)."""
        return self._ipc.mappings.count()

    def update_weights_from_tensor(self, request: TensorRequest) -> EngineReply:
        """One bucket of a colocated update (``ppo_ipc_bucket``, or SGLang's ``flattened_bucket``); the
        version is recorded and the cache flushed only when it loaded. ``abort_all_requests`` has no
        meaning here: the sender paused generation first."""
        reply = self._ipc.update_weights_from_tensor(request)
        if reply.success:
            if request.weight_version is not None:
                self.weight_version = request.weight_version
            if request.flush_cache and self._on_flush is not None:
                self._on_flush()
        return reply

    def group(self, group_name: str) -> WeightGroup | None:
        """The joined group of that name, if any (for engines that run their own collectives on it)."""
        with self._lock:
            return self._groups.get(group_name)

    # ------------------------------------------------------------ updates

    def _check(self, metas: Sequence[TensorMeta]) -> str | None:
        held = self._expected()
        seen: set[str] = set()
        for meta in metas:
            if meta.name in seen:
                return f"tensor {meta.name!r} appears twice in one update"
            seen.add(meta.name)
            if meta.name not in held:
                return f"tensor {meta.name!r} is not a weight of this engine"
            dtype, shape = held[meta.name]
            if meta.dtype != dtype:
                return f"tensor {meta.name!r}: dtype {meta.dtype} does not match the engine's {dtype}"
            if tuple(meta.shape) != tuple(shape):
                theirs, ours = list(meta.shape), list(shape)
                return f"tensor {meta.name!r}: shape {theirs} does not match the engine's {ours}"
        return None

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        # Engines call in from server or actor threads, whose current CUDA device is not set: make ours
        # current so streams, syncs and the engine's loader all act on the right GPU.
        return on_device(self.device)

    def update_weights_from_distributed(self, request: UpdateRequest) -> EngineReply:
        group_name = request.group_name
        try:
            metas = metas_from_request(request.names, request.dtypes, request.shapes)
            buckets = self._buckets(metas, request.load_format)
        except ValueError as exc:
            return EngineReply.refused(f"Bad update request: {exc}")
        with self._lock:
            group = self._groups.get(group_name)
            if group is None:
                return EngineReply.refused(
                    f"Group {group_name!r} is not joined; call init_weights_update_group first."
                )
            if group_name in self._busy:
                return EngineReply.refused(f"An update over group {group_name!r} is already running.")
            self._busy.add(group_name)
        try:
            # A mismatch is found before any byte moves; the data is still drained so the group stays in
            # step with the sender, and nothing is loaded.
            problem = self._check(metas)
            try:
                with self._on_device():
                    if buckets is None:
                        self._receive_per_tensor(group, metas, load=problem is None)
                    else:
                        self._receive_flat(group_name, group, buckets, load=problem is None)
                    # On the GPU everything above was only queued: the broadcasts, then the loads on this
                    # stream. The reply must mean "loaded", so the host waits (bounded) for the stream;
                    # a broadcast that never completes fails this update (and aborts the group) instead
                    # of leaving the engine's next read of its weights blocked forever.
                    wait_stream(
                        self.device,
                        group.timeout.total_seconds(),
                        f"receiving weights over group {group_name!r}",
                    )
            except Exception as exc:
                # The group is out of step with the sender now (a peer died or timed out): drop it.
                with self._lock:
                    if self._groups.get(group_name) is group:
                        del self._groups[group_name]
                group.destroy(abort=True)
                return EngineReply.lost(f"Failed to receive weights over group {group_name!r}: {exc}")
            if problem is not None:
                return EngineReply.refused(f"Rejected update, nothing loaded: {problem}")
            if request.weight_version is not None:
                self.weight_version = request.weight_version
        finally:
            with self._lock:
                self._busy.discard(group_name)
                orphaned = self._groups.get(group_name) is not group
                if orphaned:
                    self._buffers.pop(group_name, None)
            if orphaned:
                group.destroy(abort=True)  # destroyed while this update ran (idempotent if already)
        if request.flush_cache and self._on_flush is not None:
            self._on_flush()
        return EngineReply.ok("Succeeded to update parameter online.")

    @staticmethod
    def _buckets(metas: list[TensorMeta], load_format: str | None) -> list[list[TensorMeta]] | None:
        """How the data arrives: None per tensor, else the flat buffers' tensors in order."""
        if load_format is None:
            return None
        if load_format == FLATTENED_BUCKET:
            return [metas]
        if load_format.startswith(STREAM_FORMAT_PREFIX):
            plan = plan_buckets([m.nbytes for m in metas], parse_stream_format(load_format))
            return [metas[a:b] for a, b in plan]
        raise ValueError(
            f"Unsupported load_format {load_format!r}: expected None, {FLATTENED_BUCKET!r} or "
            f"'{STREAM_FORMAT_PREFIX}<bucket bytes>'."
        )

    def _wait(self, work: Any, group: WeightGroup) -> None:
        if self.device.type == "cuda":
            work.wait()  # orders the current stream after the broadcast; bounded by NCCL's watchdog
        else:
            work.wait(timedelta(seconds=group.timeout.total_seconds()))

    def _receive_per_tensor(self, group: WeightGroup, metas: Sequence[TensorMeta], load: bool) -> None:
        tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
        works = [group.broadcast(t) for t in tensors]
        for work in works:
            self._wait(work, group)
        if load:
            self._load([(m.name, t) for m, t in zip(metas, tensors, strict=True)])

    def _receive_flat(
        self, group_name: str, group: WeightGroup, buckets: Sequence[Sequence[TensorMeta]], load: bool
    ) -> None:
        # Two buffers: bucket k+1 is on the wire while bucket k is unpacked and loaded.
        sizes = [sum(m.nbytes for m in b) for b in buckets]
        if not sizes:
            return
        biggest = max(sizes)
        with self._lock:
            kept = self._buffers.pop(group_name, [])
        if not kept or kept[0].numel() < biggest:
            # Kept between updates (freed when the group goes): fresh host memory faults on first touch.
            kept = []
            kept = [torch.empty(biggest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        with self._lock:
            if group_name in self._groups:
                self._buffers[group_name] = kept
        buffers = kept[: min(2, len(sizes))]

        def post(k: int) -> Any:
            return group.broadcast(buffers[k % len(buffers)][: sizes[k]])

        work = post(0)
        for k, bucket in enumerate(buckets):
            self._wait(work, group)
            if k + 1 < len(buckets):
                # Reuses the buffer bucket k-1 was loaded from: on CPU that load has returned; on GPU it
                # was queued on this stream, which the broadcast waits for.
                work = post(k + 1)
            if load:
                self._load(unpack(buffers[k % len(buffers)][: sizes[k]], bucket))


if TYPE_CHECKING:  # mypy checks that the receiver has the weight operations' exact signatures

    def _is_weight_ops(receiver: WeightReceiver) -> WeightOps:
        return receiver

    def _is_tensor_ops(receiver: WeightReceiver) -> TensorOps:
        return receiver
