"""The colocated transport: updates to engines on the sender's own GPU, by ``update_weights_from_tensor``.

Which rank sends what: every trainer rank holds a :class:`~ppo_weight_sync.WeightSender`; the engines on
that rank's GPU are its colocated engines, and it packs the full weights (gathered, in Hugging Face names)
into its own two buffers and sends each of those engines one message per bucket. An engine of one GPU
(TP 1) needs one entry; an engine of TP *T* over GPUs *g0..gT-1* needs entry *i* from the rank on *gi*
(SGLang reads ``serialized_named_tensors[tp_rank]``), which slime gathers over the trainer ranks of
those GPUs before rank *g0* posts. That gather is not built here: :meth:`IpcTransport.connect` refuses
colocated engines of more than one GPU with a ValueError that names the fix (the group transport).

Engines that list ``ppo_ipc_bucket`` in their ``load_formats`` get our format (buffers exported once per
connection, mapped once, released on disconnect); any other engine (SGLang) gets ``flattened_bucket``
with a fresh export per call, as SGLang unmaps after each call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ppo_weight_sync.buckets import FLATTENED_BUCKET
from ppo_weight_sync.endpoints import EngineEndpoint, Pending
from ppo_weight_sync.errors import EngineTimeoutError, EngineUnavailableError, WeightSyncError
from ppo_weight_sync.ipc.handles import export_buffer
from ppo_weight_sync.ipc.layout import BucketLayout
from ppo_weight_sync.ipc.packer import BucketPacker, PipelineStats, send_buckets
from ppo_weight_sync.ipc.payload import PPO_IPC_FORMAT, encode_flattened_bucket, encode_ipc_bucket

__all__ = ["IpcTransport"]

log = logging.getLogger(__name__)

UPDATE_OP = "update_weights_from_tensor"


CheckReply = Callable[[Any, str, Any], Any]


class IpcTransport:
    """Colocated engines of one sender. ``session`` names the connection on the engines (its mappings)."""

    def __init__(self, *, device: torch.device, bucket_bytes: int, timeout_s: float) -> None:
        self.packer = BucketPacker(device, bucket_bytes, timeout_s)
        self.timeout_s = timeout_s
        self._engines: list[EngineEndpoint] = []
        self._formats: dict[str, str] = {}
        self.session = ""

    @property
    def engines(self) -> tuple[EngineEndpoint, ...]:
        return tuple(self._engines)

    def connect(self, engines: Sequence[EngineEndpoint], session: str) -> None:
        wide = [f"{e.name} ({e.num_gpus} GPUs)" for e in engines if e.num_gpus != 1]
        if wide:
            raise ValueError(
                f"colocated engines {wide}: CUDA IPC updates are built for engines of one GPU (TP 1) per "
                "trainer rank; give those engines the group transport (NCCL) or one GPU each"
            )
        self._engines = list(engines)
        self._formats = {
            e.name: PPO_IPC_FORMAT if PPO_IPC_FORMAT in e.load_formats else FLATTENED_BUCKET for e in engines
        }
        self.session = session

    def load_format(self, engine: EngineEndpoint) -> str:
        return self._formats[engine.name]

    def send(
        self, items: Sequence[tuple[str, torch.Tensor]], version: str, check: CheckReply
    ) -> PipelineStats:
        """Every bucket to every colocated engine; the version and the cache flush go with the last one."""
        layouts = self.packer.plan(items)
        engines = list(self._engines)

        def post(slot: int, layout: BucketLayout, last: bool) -> list[Callable[[float], None]]:
            waiters: list[Callable[[float], None]] = []
            for engine in engines:
                fmt = self._formats[engine.name]
                if fmt == PPO_IPC_FORMAT:
                    entry = encode_ipc_bucket(self.session, self.packer.handle(engine.name, slot), layout)
                else:
                    entry = encode_flattened_bucket(export_buffer(self.packer.buffer(slot)), layout)
                pending = engine.update_weights_from_tensor(
                    serialized_named_tensors=[entry],
                    load_format=fmt,
                    flush_cache=last,
                    abort_all_requests=False,
                    weight_version=version if last else None,
                )
                waiters.append(_waiter(engine, pending, check))
            return waiters

        return send_buckets(self.packer, items, layouts, post, self.timeout_s)

    def disconnect(self, check: CheckReply, timeout_s: float) -> list[str]:
        """Engines release their mappings, then the buffers are freed. Never raises for a dead engine:
        returns the errors. A dead engine's counts are dropped on its behalf; a stuck one's are not (it
        may still release later), so a stuck engine can keep up to two buckets' memory held."""
        errors: list[str] = []
        engines, self._engines = self._engines, []
        calls: list[tuple[EngineEndpoint, Pending | None, str]] = []
        for engine in engines:
            if self._formats.get(engine.name) != PPO_IPC_FORMAT:
                continue  # SGLang unmapped after each call
            try:
                calls.append((engine, engine.destroy_weights_update_group(group_name=self.session), ""))
            except WeightSyncError as exc:
                calls.append((engine, None, str(exc)))
        for engine, call, error in calls:
            released = False
            dead = bool(error)
            if call is not None:
                try:
                    check(engine, "destroy_weights_update_group", call.result(timeout_s))
                    released = True
                except EngineTimeoutError as exc:
                    error = str(exc)
                except EngineUnavailableError as exc:
                    error, dead = str(exc), True
                except WeightSyncError as exc:
                    error = str(exc)
            if error:
                errors.append(error)
            if released or dead:
                self.packer.forget(engine.name, released=released)
            else:
                log.warning("engine %s did not release its colocated buffers: %s", engine.name, error)
        self._formats = {}
        self.packer.free()
        return errors


def _waiter(engine: EngineEndpoint, pending: Pending, check: CheckReply) -> Callable[[float], None]:
    def wait(timeout_s: float) -> None:
        check(engine, UPDATE_OP, pending.result(timeout_s))

    return wait
