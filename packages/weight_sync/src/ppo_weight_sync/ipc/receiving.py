"""The engine side of ``update_weights_from_tensor`` for engines we write (one TP rank each).

Accepts both bodies of :mod:`.payload`: ours (``ppo_ipc_bucket``: the sender's buffers are mapped once
per session and kept until :meth:`IpcTensorReceiver.release`) and SGLang's ``flattened_bucket`` (mapped
for the call, as SGLang does). Names, dtypes and shapes are checked against what the engine holds before
anything is copied; a reply means the copies finished (the sender may overwrite its buffer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

import torch

from ppo_weight_sync.buckets import FLATTENED_BUCKET
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.ipc.layout import BucketLayout
from ppo_weight_sync.ipc.mapping import IPC_POLL_S, IpcMappings
from ppo_weight_sync.ipc.payload import (
    PPO_IPC_FORMAT,
    PPO_IPC_STREAM,
    IpcBucket,
    IpcStream,
    decode_flattened_bucket,
    decode_ipc_bucket,
    decode_ipc_stream,
)
from ppo_weight_sync.ipc.signals import BucketSignals
from ppo_weight_sync.ops import EngineReply
from ppo_weight_sync.requests import TensorRequest

__all__ = ["IPC_LOAD_FORMATS", "IpcTensorReceiver", "check_layout"]

log = logging.getLogger(__name__)

IPC_LOAD_FORMATS: tuple[str, ...] = (PPO_IPC_FORMAT, PPO_IPC_STREAM, FLATTENED_BUCKET)
_DECODED_MAX = 4096  # decoded bucket messages kept (a few per bucket per sender)

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], None]
Expected = Callable[[], Mapping[str, tuple[torch.dtype, tuple[int, ...]]]]


def check_layout(layout: BucketLayout, held: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> str | None:
    """What is wrong with ``layout`` for an engine holding ``held``, or None."""
    seen: set[str] = set()
    for name, dtype, shape in zip(layout.names, layout.dtypes, layout.shapes, strict=True):
        if name in seen:
            return f"tensor {name!r} appears twice in one bucket"
        seen.add(name)
        if name not in held:
            return f"tensor {name!r} is not a weight of this engine"
        want_dtype, want_shape = held[name]
        if dtype != want_dtype:
            return f"tensor {name!r}: dtype {dtype} does not match the engine's {want_dtype}"
        if tuple(shape) != tuple(want_shape):
            return f"tensor {name!r}: shape {list(shape)} does not match the engine's {list(want_shape)}"
    return None


class IpcTensorReceiver:
    """One TP rank's colocated receiver; ``tp_rank`` picks its entry of ``serialized_named_tensors``."""

    def __init__(
        self,
        load_weights: LoadWeights,
        expected: Expected,
        device: torch.device,
        *,
        tp_rank: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        self._load = load_weights
        self._expected = expected
        self.device = torch.device(device)
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self.mappings = IpcMappings()
        # A sender repeats the same message for the same bucket every update (same buffer, same layout):
        # decode each once. Bounded; emptied when a session is released.
        self._decoded: dict[str, IpcBucket] = {}
        self._decoded_streams: dict[str, IpcStream] = {}

    def update_weights_from_tensor(self, request: TensorRequest) -> EngineReply:
        """Load one bucket; the caller records the version and flushes on success."""
        load_format = request.load_format
        if self.device.type != "cuda":
            return EngineReply.refused(
                f"update_weights_from_tensor needs an engine on a GPU, not {self.device}."
            )
        if load_format not in IPC_LOAD_FORMATS:
            return EngineReply.refused(
                f"Unsupported load_format {load_format!r} for update_weights_from_tensor: expected one of "
                f"{list(IPC_LOAD_FORMATS)}.",
            )
        entries = request.serialized_named_tensors
        if len(entries) <= self.tp_rank:
            return EngineReply.refused(
                f"serialized_named_tensors has {len(entries)} entries; TP rank {self.tp_rank} reads entry "
                f"{self.tp_rank} (one entry per TP rank of the engine).",
            )
        entry = entries[self.tp_rank]
        try:
            if load_format == PPO_IPC_FORMAT:
                return self._ours(entry)
            if load_format == PPO_IPC_STREAM:
                return self._stream(entry)
            return self._flattened(entry)
        except ValueError as exc:
            return EngineReply.refused(f"Bad update request: {exc}")

    def _ours(self, entry: str) -> EngineReply:
        bucket = self._decoded.get(entry)
        if bucket is None:
            bucket = decode_ipc_bucket(entry)
            if len(self._decoded) >= _DECODED_MAX:
                self._decoded.clear()
            self._decoded[entry] = bucket
        try:
            with on_device(self.device):
                # Mapped before the check: the export's count is taken over even when the bucket is
                # refused, so the sender's memory can still return when this session is released.
                buffer = self.mappings.buffer(bucket.session, bucket.handle)
        except Exception as exc:
            log.warning("mapping a colocated weight buffer failed: %s", exc)
            return EngineReply.lost(
                f"Failed to receive weights over CUDA IPC: mapping the sender's buffer failed: {exc}"
            )
        return self._load_from(buffer, bucket.layout)

    def _stream(self, entry: str) -> EngineReply:
        """A whole update in one request: every bucket checked first, then each copied out as soon as the
        sender announces it, and announced back once copied (see :mod:`.signals`)."""
        update = self._decoded_streams.get(entry)
        if update is None:
            update = decode_ipc_stream(entry)
            if len(self._decoded_streams) >= 64:
                self._decoded_streams.clear()
            self._decoded_streams[entry] = update
        held = self._expected()
        for k, layout in enumerate(update.layouts):
            problem = check_layout(layout, held)
            if problem is not None:
                return EngineReply.refused(f"Rejected update, nothing loaded: bucket {k}: {problem}")
        try:
            with on_device(self.device):
                buffers = [self.mappings.buffer(update.session, h) for h in update.handles]
        except Exception as exc:
            log.warning("mapping a colocated weight buffer failed: %s", exc)
            return EngineReply.lost(
                f"Failed to receive weights over CUDA IPC: mapping the sender's buffer failed: {exc}"
            )
        biggest = max(layout.nbytes for layout in update.layouts)
        if min(b.numel() for b in buffers) < biggest:
            return EngineReply.refused(
                f"Rejected update, nothing loaded: a bucket ends at byte {biggest}, the shared buffers hold "
                f"{min(b.numel() for b in buffers)}",
            )
        signals = BucketSignals.attach(update.signals)
        try:
            return self._stream_buckets(update, buffers, signals)
        finally:
            signals.close()

    def _stream_buckets(
        self, update: IpcStream, buffers: list[torch.Tensor], signals: BucketSignals
    ) -> EngineReply:
        def aborted() -> None:
            if signals.get("abort"):
                raise _SenderAborted

        k = 0
        try:
            with on_device(self.device):
                for k, layout in enumerate(update.layouts):
                    signals.wait_at_least(
                        "packed",
                        k + 1,
                        self.timeout_s,
                        f"waiting for weight bucket {k} from the sender",
                        aborted,
                    )
                    self._load(layout.views(buffers[k % 2]))
                    wait_stream(
                        self.device,
                        self.timeout_s,
                        "copying a weight bucket out of the sender's buffer",
                        poll_s=IPC_POLL_S,
                    )
                    signals.set("loaded", k + 1)
        except _SenderAborted:
            return EngineReply.lost(
                f"Failed to receive weights over CUDA IPC: the sender gave up at bucket {k} of "
                f"{len(update.layouts)}"
            )
        except Exception as exc:
            return EngineReply.lost(
                f"Failed to receive weights over CUDA IPC: bucket {k} of {len(update.layouts)}: {exc}"
            )
        return EngineReply.ok("Succeeded to update parameter online.")

    def _flattened(self, entry: str) -> EngineReply:
        decoded = decode_flattened_bucket(entry)
        try:
            with on_device(self.device):
                buffer = decoded.open()
        except Exception as exc:
            log.warning("mapping a flattened bucket failed: %s", exc)
            return EngineReply.lost(
                f"Failed to receive weights over CUDA IPC: mapping the sender's buffer failed: {exc}"
            )
        try:
            return self._load_from(buffer, decoded.layout)
        finally:
            del buffer  # SGLang's semantics: the mapping lives for this call only

    def _load_from(self, buffer: torch.Tensor, layout: BucketLayout) -> EngineReply:
        problem = check_layout(layout, self._expected())
        if problem is not None:
            return EngineReply.refused(f"Rejected update, nothing loaded: {problem}")
        if buffer.numel() < layout.nbytes:
            return EngineReply.refused(
                f"Rejected update, nothing loaded: the bucket ends at byte {layout.nbytes}, "
                f"the shared buffer has {buffer.numel()}",
            )
        try:
            with on_device(self.device):
                self._load(layout.views(buffer))
                wait_stream(
                    self.device,
                    self.timeout_s,
                    "copying a weight bucket out of the sender's buffer",
                    poll_s=IPC_POLL_S,
                )
        except Exception as exc:
            return EngineReply.lost(
                f"Failed to receive weights over CUDA IPC: copying the bucket failed: {exc}"
            )
        return EngineReply.ok("Succeeded to update parameter online.")

    def release(self, session: str) -> int:
        """Unmap ``session``'s buffers (the sender disconnects, or is about to free them)."""
        self._decoded = {k: v for k, v in self._decoded.items() if v.session != session}
        self._decoded_streams = {k: v for k, v in self._decoded_streams.items() if v.session != session}
        return self.mappings.release(session)


class _SenderAborted(Exception):
    """The sender set ``abort``: it gave up on this update."""
