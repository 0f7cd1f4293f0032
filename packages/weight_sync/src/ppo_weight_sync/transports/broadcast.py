"""What the group-based transports share: a bucket pipeline over the weight group, bounded waits, and
attribution of a broken broadcast to the engine whose call failed."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from ppo_weight_sync.buckets import dtype_name, pack_into
from ppo_weight_sync.device_sync import wait_stream
from ppo_weight_sync.endpoints import EngineEndpoint, Pending
from ppo_weight_sync.errors import (
    EngineTimeoutError,
    EngineUnavailableError,
    WeightSyncError,
    check_reply,
)
from ppo_weight_sync.group import WeightGroup
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.requests import UpdateRequest
from ppo_weight_sync.transports.base import Sent
from ppo_weight_sync.waiting import wait_until

__all__ = ["GroupLink", "GroupTransport", "Metadata", "Pipeline", "Staging"]

_POLL_S = 0.0001
_OP = "update_weights_from_distributed"

Calls = list[tuple[EngineEndpoint, Pending[EngineReply]]]


@dataclass
class Staging:
    """Two staging buffers kept between updates (fresh host memory costs a page fault per page on first
    touch, which would dominate a CPU update); freed by ``release``."""

    device: torch.device
    buffers: list[torch.Tensor] = field(default_factory=list)

    def get(self, size: int) -> list[torch.Tensor]:
        if size == 0:
            return []
        if not self.buffers or self.buffers[0].numel() < size:
            self.buffers = []  # free the old pair before allocating the new one
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self.buffers

    def release(self) -> None:
        self.buffers = []


@dataclass(frozen=True)
class GroupLink:
    """A group-based transport's view of the connection: the group, its name, its engines, the limits."""

    group: WeightGroup
    group_name: str
    engines: tuple[EngineEndpoint, ...]
    device: torch.device
    timeout_s: float
    bucket_bytes: int

    def prepare(self, tensor: torch.Tensor) -> torch.Tensor:
        t = tensor.detach()
        if t.device != self.device:
            t = t.to(self.device)
        return t.contiguous()


class Pipeline:
    """Broadcasts planned buckets, as flat uint8 buffers through two staging buffers (bucket k+1 is
    packed while bucket k is on the wire) or as single tensors, and waits for them, bounded.

    ``calls`` are the engines' pending update calls of the bucket(s) in flight: a call that fails while
    a broadcast waits ends the wait with that engine's error.
    """

    def __init__(
        self,
        link: GroupLink,
        staging: Staging,
        tensors: Sequence[torch.Tensor],
        plan: Sequence[tuple[int, int]],
    ) -> None:
        self.link, self.tensors, self.plan = link, list(tensors), list(plan)
        self.cuda = link.device.type == "cuda"
        sizes = [sum(t.numel() * t.element_size() for t in self.tensors[a:b]) for a, b in plan]
        multi = [s for (a, b), s in zip(plan, sizes, strict=True) if b - a > 1]
        self.buffers = staging.get(max(multi, default=0))
        self.calls: Calls = []
        # (work, staging slot or None, the buffer it sends): the buffer stays referenced here until its
        # broadcast completed, so a one-tensor bucket's device copy is never freed while NCCL reads it.
        self.in_flight: list[tuple[Any, int | None, torch.Tensor]] = []
        self.slot_work: list[Any] = [None, None]
        self.packed: dict[int, tuple[torch.Tensor, int | None]] = {}
        self.completed = 0  # broadcasts that finished without error on this side

    # -- flat buckets -------------------------------------------------------------------------------
    def pack(self, k: int) -> tuple[torch.Tensor, int | None]:
        a, b = self.plan[k]
        if b - a == 1:
            # A bucket of one tensor goes as it is (a byte view), no staging copy.
            t = self.link.prepare(self.tensors[a])
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

    def send_flat(self, k: int) -> None:
        """Broadcast bucket ``k`` as one flat buffer; pack bucket ``k+1`` while it is on the wire."""
        buf, slot = self.packed.pop(k) if k in self.packed else self.pack(k)
        work = self.link.group.broadcast(buf)
        self.in_flight.append((work, slot, buf))
        if slot is not None:
            self.slot_work[slot] = work
        if k + 1 < len(self.plan):
            self.packed[k + 1] = self.pack(k + 1)

    def drain(self) -> None:
        """Wait for every broadcast in flight, in order."""
        while self.in_flight:
            work, slot, _buf = self.in_flight[0]
            self.wait(work)
            self.in_flight.pop(0)
            if slot is not None and self.slot_work[slot] is work:
                self.slot_work[slot] = None

    # -- waits --------------------------------------------------------------------------------------
    def settle(self) -> None:
        """After the last bucket: the host waits (bounded) until this device's stream has finished too,
        so nothing queued for the update (packing copies, stream waits) is still pending when it returns
        and the caller may free or overwrite the tensors it sent."""
        if not self.cuda:
            return
        try:
            wait_stream(self.link.device, self.link.timeout_s, "sending weights", check=self.check_calls)
        except WeightSyncError:
            raise
        except Exception as exc:
            self._blame(exc)

    def wait(self, work: Any) -> None:
        """Wait for one broadcast; bounded by the timeout; an engine call that fails meanwhile ends it."""
        timeout_s = self.link.timeout_s
        try:
            if not self.cuda:
                work.wait(timedelta(seconds=timeout_s))
            else:
                wait_until(
                    work.is_completed,
                    timeout_s,
                    lambda: f"broadcast not complete within {timeout_s:g} s",
                    poll_s=_POLL_S,
                    check=self.check_calls,
                )
                # is_completed() is also true for a work that failed: wait() raises its error, and orders
                # this stream after the broadcast (it returns at once, the kernel has finished).
                work.wait()
        except WeightSyncError:
            raise
        except Exception as exc:
            self._blame(exc)
        self.completed += 1

    def replies(self, calls: Calls) -> None:
        """The engines' answers for this update; a failed one also says how this side fared."""
        for engine, call in calls:
            try:
                check_reply(engine.name, _OP, call.result(self.link.timeout_s))
            except EngineUnavailableError as err:
                raise self._with_own_side(err) from None

    def check_calls(self) -> None:
        for engine, call in self.calls:
            if call.done():
                try:
                    # An engine that answered before the data arrived did not take it: its error is the
                    # cause, with this side's own error (if any) beside it.
                    check_reply(engine.name, _OP, call.result(self.link.timeout_s))
                except EngineUnavailableError as err:
                    raise self._with_own_side(err) from None

    # -- attribution --------------------------------------------------------------------------------
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

    def _blame(self, exc: BaseException) -> None:
        # A broken broadcast: find the engine whose call failed (a dead actor or server answers fast).
        for engine, call in self.calls:
            try:
                reply = call.result(2.0)
            except EngineTimeoutError:
                continue
            except EngineUnavailableError as err:
                raise EngineUnavailableError(engine.name, _OP, f"{err}; broadcast: {exc}") from exc
            if not reply.success:
                raise EngineUnavailableError(engine.name, _OP, f"{reply.message}; broadcast: {exc}") from exc
        names = ", ".join(e.name for e, _ in self.calls) or ", ".join(e.name for e in self.link.engines)
        raise EngineUnavailableError(names, "weight broadcast", str(exc)) from exc


@dataclass(frozen=True)
class Metadata:
    """Names, dtypes, shapes and byte sizes of one update's tensors, in order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    sizes: list[int]

    @classmethod
    def of(cls, items: Sequence[tuple[str, torch.Tensor]]) -> Metadata:
        return cls(
            names=[n for n, _ in items],
            dtypes=[dtype_name(t.dtype) for _, t in items],
            shapes=[list(t.shape) for _, t in items],
            sizes=[t.numel() * t.element_size() for _, t in items],
        )


class GroupTransport(abc.ABC):
    """Base of the group-based transports: the link, the staging buffers, one update call per engine."""

    def __init__(self, link: GroupLink, load_format: str | None) -> None:
        self.link = link
        self._load_format = load_format
        self.staging = Staging(link.device)
        self._prepared: tuple[Sequence[tuple[str, torch.Tensor]], Pipeline] | None = None

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return self.link.engines

    @property
    def load_format(self) -> str | None:
        return self._load_format

    def call_update(self, meta: Metadata, a: int, b: int, *, version: str | None, flush_cache: bool) -> Calls:
        """Every engine's ``update_weights_from_distributed`` call for tensors ``[a, b)``."""
        request = UpdateRequest(
            names=meta.names[a:b],
            dtypes=meta.dtypes[a:b],
            shapes=meta.shapes[a:b],
            group_name=self.link.group_name,
            weight_version=version,
            flush_cache=flush_cache,
            load_format=self._load_format,
        )
        return [
            (
                e,
                e.update_weights_from_distributed(request),
            )
            for e in self.link.engines
        ]

    def plan(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[int, int]] | None:
        """The flat buckets ``[a, b)`` of this format, or None when it sends tensor by tensor."""
        return None

    def prepare(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Pack bucket 0 into its staging buffer now, while the engines pause and flush: queued on the
        GPU (the host runs on), a host copy on CPU. Nothing reaches an engine before :meth:`send`."""
        self._prepared = None
        plan = self.plan(items)
        if not plan:
            return
        pipe = Pipeline(self.link, self.staging, [t for _, t in items], plan)
        pipe.packed[0] = pipe.pack(0)
        self._prepared = (items, pipe)

    def pipeline(self, items: Sequence[tuple[str, torch.Tensor]], plan: list[tuple[int, int]]) -> Pipeline:
        """The pipeline of ``plan``, the one :meth:`prepare` started when it was given these ``items``."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared[0] is items:
            return prepared[1]
        return Pipeline(self.link, self.staging, [t for _, t in items], plan)

    @abc.abstractmethod
    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent: ...

    def close(self) -> None:
        self._prepared = None
        self.staging.release()
