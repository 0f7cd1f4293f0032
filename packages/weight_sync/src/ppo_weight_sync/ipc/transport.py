"""The colocated transport: updates to engines on the sender's own GPU, by ``update_weights_from_tensor``.

:class:`ColocatedIpc` is a :class:`~ppo_weight_sync.transports.TransportFactory`: given to
``WeightSender(transports=[ColocatedIpc(names)])`` it claims the engines it names (those on this
process's GPU); they never join the weight group, and one ``update()`` serves them and the group's
engines in the same pause / flush / continue sequence, under the same lock, version and timeout.

Which rank sends what: every trainer rank that holds a sender packs the full weights (gathered, in
Hugging Face names) into its own two buffers and sends each engine on its GPU one message per bucket.
The body carries one entry per TP rank of the engine (SGLang's TP rank *i* reads
``serialized_named_tensors[i]`` only). An engine of TP 1 gets entries naming this rank's buffer. An
engine of TP *T* over GPUs *g0..gT-1* (given a :class:`~ppo_weight_sync.ipc.tp.TpLink` per engine in
``ColocatedIpc(tp=...)``) gets entry *i* naming the buffer of the trainer rank on *gi*: this rank is
the lead (on *g0*) and posts; the others run :class:`~ppo_weight_sync.ipc.tp.IpcExporter` and hand their
handles over (:mod:`.tp`). Such engines get one request per bucket (``ppo_ipc_bucket`` or
``flattened_bucket``), not the one-request stream.

Engines that list ``ppo_ipc_bucket`` in their ``load_formats`` get our format (buffers exported once per
connection, mapped once, unmapped at close); any other engine (SGLang) gets ``flattened_bucket`` with a
fresh export per call, as SGLang unmaps after each call.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from ppo_weight_sync.buckets import FLATTENED_BUCKET
from ppo_weight_sync.endpoints import EngineEndpoint, Pending
from ppo_weight_sync.errors import EngineTimeoutError, EngineUnavailableError, WeightSyncError, check_reply
from ppo_weight_sync.ipc.handles import export_buffer
from ppo_weight_sync.ipc.layout import BucketLayout
from ppo_weight_sync.ipc.packer import (
    MAX_AUTO_BUCKET,
    BucketPacker,
    PipelineStats,
    auto_bucket_bytes,
    pack_first,
    send_buckets,
    send_stream,
)
from ppo_weight_sync.ipc.payload import (
    PPO_IPC_FORMAT,
    PPO_IPC_STREAM,
    encode_flattened_bucket,
    encode_ipc_bucket,
    encode_ipc_stream,
    tensor_request,
)
from ppo_weight_sync.ipc.signals import BucketSignals
from ppo_weight_sync.ipc.tp import TpLead, TpLink
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.requests import DestroyRequest
from ppo_weight_sync.transports.base import Sent

__all__ = ["ColocatedIpc", "IpcTransport"]

log = logging.getLogger(__name__)

UPDATE_OP = "update_weights_from_tensor"


class ColocatedIpc:
    """Claims the engines named in ``engines`` (on this process's GPU) for CUDA IPC updates.

    ``bucket_bytes``: the size of each of the two GPU buffers (a tensor bigger than that gets a buffer of
    its size); None (default): :func:`~ppo_weight_sync.ipc.auto_bucket_bytes` of each update's total
    (an eighth of it, rounded to a power of two, 64 MiB to 1 GiB); ``device``: this process's GPU
    (default: the current CUDA device when the transport opens); ``stream``: one request per update
    (``ppo_ipc_stream``, buckets announced through shared counters) to engines that accept it, rather
    than one request per bucket (``ppo_ipc_bucket``); ``tp``: for each engine of several GPUs (by name),
    this rank's :class:`~ppo_weight_sync.ipc.tp.TpLink` as its lead (TP rank 0), whose ranks feed the
    other TP ranks (see :mod:`.tp`).
    """

    def __init__(
        self,
        engines: Collection[str],
        *,
        bucket_bytes: int | None = None,
        device: torch.device | None = None,
        stream: bool = True,
        tp: Mapping[str, TpLink] | None = None,
    ) -> None:
        if isinstance(engines, str):
            raise ValueError(f"engines must be a collection of engine names, got the string {engines!r}")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, int) or bucket_bytes <= 0):
            raise ValueError(f"bucket_bytes must be a positive int or None (auto), got {bucket_bytes!r}")
        self.names = frozenset(engines)
        self.tp = dict(tp or {})
        for name, link in self.tp.items():
            if name not in self.names or link.engine != name:
                raise ValueError(
                    f"tp[{name!r}] (engine {link.engine!r}) must name one of the engines {sorted(self.names)}"
                )
            if link.tp_rank != 0:
                raise ValueError(
                    f"tp[{name!r}]: this rank feeds TP rank {link.tp_rank}; only TP rank 0's rank (the lead) "
                    "posts, the others run an IpcExporter"
                )
        self.bucket_bytes = bucket_bytes
        self.device = device
        self.stream = stream

    def serves(self, engine: EngineEndpoint) -> bool:
        return engine.name in self.names

    def open(self, engines: Sequence[EngineEndpoint], timeout_s: float) -> IpcTransport:
        if not torch.cuda.is_available():
            raise ValueError("colocated engines need CUDA (CUDA IPC); on CPU give no ColocatedIpc factory")
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        transport = IpcTransport(
            device=device, bucket_bytes=self.bucket_bytes, timeout_s=timeout_s, stream=self.stream
        )
        transport.connect(engines, session=f"ppo_ipc-{uuid.uuid4().hex[:8]}", tp=self.tp)
        return transport


class IpcTransport:
    """A :class:`~ppo_weight_sync.transports.Transport` for colocated engines; ``session`` names the
    connection on the engines (their mappings); :attr:`last` holds the last send's pipeline figures."""

    def __init__(
        self, *, device: torch.device, bucket_bytes: int | None, timeout_s: float, stream: bool = True
    ) -> None:
        self.stream = stream
        self._signals: dict[str, BucketSignals] = {}
        # None: sized per update from its total (auto_bucket_bytes); the packer's own size is then unused.
        self.bucket_bytes = bucket_bytes
        self.packer = BucketPacker(device, bucket_bytes or MAX_AUTO_BUCKET, timeout_s)
        self.timeout_s = timeout_s
        self._engines: list[EngineEndpoint] = []
        self._formats: dict[str, str] = {}
        self.session = ""
        self.last: PipelineStats | None = None
        # Kept between updates of the same tensors (names, dtypes, shapes): the layouts, and each
        # engine's message per bucket (our format names the same buffer and layout every update).
        self._plan_key: tuple[object, ...] = ()
        self._layouts: list[BucketLayout] = []
        self._entries: dict[tuple[str, int], str] = {}
        self._entries_key: tuple[object, ...] = ()
        self._prepared: Sequence[tuple[str, torch.Tensor]] | None = None
        self._leads: dict[str, TpLead] = {}

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return tuple(self._engines)

    @property
    def load_format(self) -> str | None:
        formats = set(self._formats.values())
        return formats.pop() if len(formats) == 1 else None

    def format_of(self, engine: EngineEndpoint) -> str:
        return self._formats[engine.name]

    def connect(
        self, engines: Sequence[EngineEndpoint], session: str, tp: Mapping[str, TpLink] | None = None
    ) -> None:
        """Choose each engine's format; for an engine of several GPUs, exchange with the trainer ranks that
        feed its other TP ranks (they connect at the same time; bounded by their exchange's timeout)."""
        tp = dict(tp or {})
        wide = [f"{e.name} ({e.num_gpus} GPUs)" for e in engines if e.num_gpus != 1 and e.name not in tp]
        if wide:
            raise ValueError(
                f"colocated engines {wide}: an engine of several GPUs needs every TP rank's trainer rank "
                "(ColocatedIpc(tp={name: TpLink}) on the lead, an IpcExporter on the others: "
                "ppo_weight_sync.plan_senders says which); else give it the group transport"
            )
        for e in engines:
            link = tp.get(e.name)
            if link is not None and link.tp_size != e.num_gpus:
                raise ValueError(
                    f"engine {e.name!r} has {e.num_gpus} GPUs, its TpLink {link.tp_size} TP ranks"
                )
        self._engines = list(engines)
        # One request per update when every engine here takes it (the buckets are announced to all of
        # them at once); else one per bucket: ours, or SGLang's for an engine without ours. TP engines
        # take a request per bucket (the lead gathers the other ranks' handles per bucket, tp.py).
        streaming = self.stream and not tp and all(PPO_IPC_STREAM in e.load_formats for e in engines)
        self._formats = {
            e.name: PPO_IPC_STREAM
            if streaming
            else PPO_IPC_FORMAT
            if PPO_IPC_FORMAT in e.load_formats
            else FLATTENED_BUCKET
            for e in engines
        }
        self.session = session
        if streaming:
            self._signals = {e.name: BucketSignals.create() for e in engines}
        try:
            for e in engines:
                if e.name in tp:
                    self._leads[e.name] = TpLead(tp[e.name], session, self._formats[e.name], self.timeout_s)
        except BaseException:
            for lead in self._leads.values():
                lead.close(released=False)
            self._leads = {}
            raise

    def layouts(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[BucketLayout]:
        """The update's buckets (cached while the tensors' names, dtypes and shapes stay the same)."""
        key = tuple((n, t.dtype, tuple(t.shape)) for n, t in items)
        if key != self._plan_key:
            total = sum(t.numel() * t.element_size() for _, t in items)
            bucket_bytes = self.bucket_bytes or auto_bucket_bytes(total)
            self._layouts = self.packer.plan(items, bucket_bytes)
            self._plan_key = key
            self._entries = {}
        return self._layouts

    def prepare(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Queue bucket 0's copies now, while the engines pause and flush (no engine sees it before
        :meth:`send`)."""
        self._prepared = None
        pack_first(self.packer, items, self.layouts(items))
        self._prepared = items

    def _entry(self, engine: EngineEndpoint, k: int, slot: int, layout: BucketLayout) -> str:
        key = (self.session, self.packer.generation)
        if key != self._entries_key:
            self._entries, self._entries_key = {}, key
        entry = self._entries.get((engine.name, k))
        if entry is None:
            entry = encode_ipc_bucket(self.session, self.packer.handle(engine.name, slot), layout)
            self._entries[(engine.name, k)] = entry
        return entry

    def _serialized(
        self, engine: EngineEndpoint, fmt: str, k: int, slot: int, layout: BucketLayout
    ) -> list[str]:
        """``serialized_named_tensors``: one entry per TP rank of ``engine``, entry ``i`` for rank ``i``.

        SGLang's rank ``i`` reads entry ``i`` only (0.5.23 ``tp_worker.deserialize_own_rank``: "deserializing
        another rank's copy would break producer-side CUDA-IPC refcounting"), and a list shorter than its TP
        size takes the server down (an IndexError in the scheduler). Each SGLang entry is a fresh export,
        because torch counts the consumers of each export; ours names the connection's export, which each
        rank maps once per session."""
        lead = self._leads.get(engine.name)
        if fmt == PPO_IPC_FORMAT:
            own = self._entry(engine, k, slot, layout)
            return lead.entries(k, slot, layout, lambda: own) if lead else [own] * engine.num_gpus
        buffer = self.packer.buffer(slot)
        if lead is not None:  # entry i: TP rank i's trainer rank's buffer (tp.py)
            return lead.entries(
                k, slot, layout, lambda: encode_flattened_bucket(export_buffer(buffer), layout)
            )
        return [encode_flattened_bucket(export_buffer(buffer), layout) for _ in range(engine.num_gpus)]

    def send(self, items: Sequence[tuple[str, torch.Tensor]], version: str) -> Sent:
        """Every bucket to every colocated engine; the version and the cache flush go with the last one."""
        first_packed, self._prepared = self._prepared is items, None
        layouts = self.layouts(items)
        index = {id(layout): k for k, layout in enumerate(layouts)}
        engines = list(self._engines)

        def post(slot: int, layout: BucketLayout, last: bool) -> list[Callable[[float], None]]:
            waiters: list[Callable[[float], None]] = []
            k = index[id(layout)]
            for engine in engines:
                fmt = self._formats[engine.name]
                request = tensor_request(
                    self._serialized(engine, fmt, k, slot, layout),
                    load_format=fmt,
                    flush_cache=last,
                    weight_version=version if last else None,
                )
                pending = engine.update_weights_from_tensor(request)
                waiters.append(_waiter(engine, pending, self._leads.get(engine.name), k))
            return waiters

        start = time.perf_counter()
        try:
            for lead in self._leads.values():
                lead.start()
            if self._signals:
                stats = self._send_stream(items, layouts, version, first_packed)
            else:
                stats = send_buckets(
                    self.packer, items, layouts, post, self.timeout_s, first_packed=first_packed
                )
        except BaseException:
            for lead in self._leads.values():
                lead.abort()  # the feeding ranks stop waiting now, and reconnect with this rank
            raise
        self.last = stats
        log.debug("colocated update: %s in %.1f ms", stats, (time.perf_counter() - start) * 1e3)
        return Sent(nbytes=stats.nbytes, buckets=stats.buckets)

    def _send_stream(
        self,
        items: Sequence[tuple[str, torch.Tensor]],
        layouts: list[BucketLayout],
        version: str,
        first_packed: bool,
    ) -> PipelineStats:
        """One ``ppo_ipc_stream`` request per engine for the whole update (see :func:`send_stream`)."""
        engines = list(self._engines)
        self.packer.reserve(layouts)
        calls: list[tuple[EngineEndpoint, Pending[EngineReply]]] = []

        def post() -> list[Callable[[float], None]]:
            for engine in engines:
                calls.append(
                    (
                        engine,
                        engine.update_weights_from_tensor(
                            tensor_request(
                                [self._stream_entry(engine, layouts)],
                                load_format=PPO_IPC_STREAM,
                                flush_cache=True,
                                weight_version=version,
                            )
                        ),
                    )
                )
            return [_waiter(engine, pending) for engine, pending in calls]

        def check() -> None:
            # An engine answers only after its last bucket: an answer now is a failure or a refusal.
            for engine, pending in calls:
                if pending.done():
                    reply = check_reply(engine.name, UPDATE_OP, pending.result(self.timeout_s))
                    raise EngineUnavailableError(
                        engine.name, UPDATE_OP, f"answered before the last bucket was sent: {reply.message}"
                    )

        signals = [self._signals[e.name] for e in engines]
        return send_stream(
            self.packer, items, layouts, signals, post, check, self.timeout_s, first_packed=first_packed
        )

    def _stream_entry(self, engine: EngineEndpoint, layouts: list[BucketLayout]) -> str:
        key = (self.session, self.packer.generation)
        if key != self._entries_key:
            self._entries, self._entries_key = {}, key
        entry = self._entries.get((engine.name, -1))
        if entry is None:
            handles = [self.packer.handle(engine.name, slot) for slot in (0, 1)]
            entry = encode_ipc_stream(self.session, handles, layouts, self._signals[engine.name].path)
            self._entries[(engine.name, -1)] = entry
        return entry

    def close(self) -> None:
        """Engines unmap the buffers, then they are freed (before the actor sleeps). Never raises."""
        for error in self.release(min(self.timeout_s, 30.0)):
            log.warning("closing the colocated transport: %s", error)

    def release(self, timeout_s: float) -> list[str]:
        """Engines unmap their buffers, then the buffers are freed; returns the errors. A dead engine's
        counts are dropped on its behalf; a stuck one's are not (it may still unmap later), so a stuck
        engine can keep up to two buckets' memory held."""
        errors: list[str] = []
        engines, self._engines = self._engines, []
        calls: list[tuple[EngineEndpoint, Pending[EngineReply] | None, str]] = []
        for engine in engines:
            if self._formats.get(engine.name) not in (PPO_IPC_FORMAT, PPO_IPC_STREAM):
                continue  # SGLang unmapped after each call
            try:
                release = DestroyRequest(group_name=self.session)
                calls.append((engine, engine.destroy_weights_update_group(release), ""))
            except WeightSyncError as exc:
                calls.append((engine, None, str(exc)))
        for engine in engines:
            if self._formats.get(engine.name) == FLATTENED_BUCKET and engine.name in self._leads:
                self._leads.pop(engine.name).close(released=True)  # SGLang unmapped after each call
        for engine, call, error in calls:
            released = False
            dead = bool(error)
            if call is not None:
                try:
                    check_reply(engine.name, "destroy_weights_update_group", call.result(timeout_s))
                    released = True
                except EngineTimeoutError as exc:
                    error = str(exc)
                except EngineUnavailableError as exc:
                    error, dead = str(exc), True
                except WeightSyncError as exc:
                    error = str(exc)
            if error:
                errors.append(error)
            lead = self._leads.pop(engine.name, None)
            if lead is not None:
                lead.close(released=released)  # the feeding ranks free their buffers once released
            if released or dead:
                self.packer.forget(engine.name, released=released)
            else:
                log.warning("engine %s did not release its colocated buffers: %s", engine.name, error)
        for lead in self._leads.values():
            lead.close(released=False)
        self._leads = {}
        self._formats = {}
        self._entries, self._entries_key, self._prepared = {}, (), None
        signals, self._signals = self._signals, {}
        for signal in signals.values():
            signal.close()
        try:
            self.packer.free()
        except Exception as exc:  # close() never raises
            errors.append(f"freeing the colocated buffers failed: {exc}")
        return errors


def _waiter(
    engine: EngineEndpoint, pending: Pending[EngineReply], lead: TpLead | None = None, k: int = 0
) -> Callable[[float], None]:
    def wait(timeout_s: float) -> None:
        check_reply(engine.name, UPDATE_OP, pending.result(timeout_s))
        if lead is not None:
            lead.loaded(k)  # every TP rank copied bucket k out: its feeding ranks may pack that buffer

    return wait
