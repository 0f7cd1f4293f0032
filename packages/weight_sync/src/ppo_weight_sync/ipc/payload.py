"""The bodies of ``update_weights_from_tensor``: SGLang's ``flattened_bucket`` payload and ours.

SGLang (0.5.15.post1 and 0.5.23 alike; ``srt/entrypoints/http_server.py`` route
``/update_weights_from_tensor``, ``srt/managers/io_struct.py`` ``UpdateWeightsFromTensorReqInput``)::

    {"serialized_named_tensors": [<one entry per TP rank>], "load_format": "flattened_bucket",
     "flush_cache": bool, "abort_all_requests": bool, "weight_version": str | None}

Entry ``i`` is read by TP rank ``i`` only (0.5.23 ``tp_worker.deserialize_own_rank``; 0.5.15.post1
``tp_worker.update_weights_from_tensor``): base64 of a ``ForkingPickler`` pickle
(``srt/utils/common.py`` ``MultiprocessingSerializer``) of ``{"flattened_tensor": <CUDA uint8 tensor>,
"metadata": [<objects with name, shape, dtype, start_idx, end_idx, numel>]}``, which
``model_runner._update_weights_from_flattened_bucket`` turns into ``FlattenedTensorBucket`` views
(``srt/weight_sync/tensor_bucket.py``). The CUDA tensor pickles as torch's
``reductions.rebuild_cuda_tensor`` call with the device given by its UUID at argument 6, as SGLang's
``patch_torch._reduce_tensor_modified`` writes it; SGLang patches ``rebuild_cuda_tensor`` to read the
UUID before it unpickles (``monkey_patch_torch_reductions``).

Every global in the pickle must pass SGLang's ``SafeUnpickler`` (0.5.23: an exact allow-list; 0.5.15.post1:
module prefixes). We write only: ``torch.multiprocessing.reductions.rebuild_cuda_tensor``,
``torch.Tensor``, ``torch.Size``, ``torch.storage.TypedStorage``, torch dtypes and
``types.SimpleNamespace`` for the metadata (SGLang reads the metadata by attribute), so the trainer needs
no SGLang installed. Torch's producer-side count is per export (see :mod:`.handles`) and SGLang drops its
mapping after every call, so each SGLang payload carries a fresh export of the buffer.

Ours (``load_format`` :data:`PPO_IPC_FORMAT`, for :class:`~ppo_weight_sync.WeightReceiver` engines): the
same request, each entry a JSON object ``{"session", "handle", "layout"}`` naming a buffer exported once
per connection; the engine keeps the mapping for the session, so a bucket costs one small message.

Ours, one request per update (``load_format`` :data:`PPO_IPC_STREAM`): one entry
``{"session", "handles": [two], "layouts": [every bucket], "signals": path}``; bucket *k* is in buffer
``k % 2``, and the two sides say which buckets are packed and copied out through the shared counters of
:mod:`.signals` instead of a message and a reply per bucket.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing import reductions

from ppo_weight_sync.ipc.handles import IpcHandle, device_index, device_uuid, export_buffer
from ppo_weight_sync.ipc.layout import BucketLayout
from ppo_weight_sync.requests import TensorRequest

__all__ = [
    "PPO_IPC_FORMAT",
    "PPO_IPC_STREAM",
    "FlattenedBucket",
    "IpcBucket",
    "IpcStream",
    "decode_flattened_bucket",
    "decode_ipc_bucket",
    "decode_ipc_stream",
    "encode_flattened_bucket",
    "encode_ipc_bucket",
    "encode_ipc_stream",
    "export_flattened_bucket",
    "tensor_request",
]

PPO_IPC_FORMAT = "ppo_ipc_bucket"
PPO_IPC_STREAM = "ppo_ipc_stream"

# rebuild_cuda_tensor's positional arguments (torch/multiprocessing/reductions.py, unchanged since torch
# 1.x); index 6 is the device, which SGLang's patch (and we) send as the GPU's UUID.
_DEVICE_ARG = 6


def tensor_request(
    serialized_named_tensors: Sequence[str],
    *,
    load_format: str,
    flush_cache: bool,
    weight_version: str | None,
) -> TensorRequest:
    """A colocated update's request for one engine: one entry per TP rank; ``abort_all_requests`` off
    (the sender paused generation first)."""
    if not serialized_named_tensors:
        raise ValueError("serialized_named_tensors needs one entry per TP rank of the engine, got none")
    return TensorRequest(
        serialized_named_tensors=list(serialized_named_tensors),
        load_format=load_format,
        flush_cache=flush_cache,
        abort_all_requests=False,
        weight_version=weight_version,
    )


# ------------------------------------------------------------------ ours: cached handles


@dataclass(frozen=True)
class IpcBucket:
    session: str
    handle: IpcHandle
    layout: BucketLayout


def encode_ipc_bucket(session: str, handle: IpcHandle, layout: BucketLayout) -> str:
    return json.dumps({"session": session, "handle": handle.to_wire(), "layout": layout.to_wire()})


def decode_ipc_bucket(entry: str) -> IpcBucket:
    try:
        wire = json.loads(entry)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{PPO_IPC_FORMAT} entry: not JSON ({exc})") from exc
    if not isinstance(wire, dict) or not {"session", "handle", "layout"} <= wire.keys():
        raise ValueError(f"{PPO_IPC_FORMAT} entry: expected an object with session, handle and layout")
    return IpcBucket(
        session=str(wire["session"]),
        handle=IpcHandle.from_wire(wire["handle"]),
        layout=BucketLayout.from_wire(wire["layout"]),
    )


@dataclass(frozen=True)
class IpcStream:
    session: str
    handles: tuple[IpcHandle, IpcHandle]
    layouts: tuple[BucketLayout, ...]
    signals: str


def encode_ipc_stream(
    session: str, handles: Sequence[IpcHandle], layouts: Sequence[BucketLayout], signals: str
) -> str:
    if len(handles) != 2:
        raise ValueError(f"{PPO_IPC_STREAM}: two buffers' handles, got {len(handles)}")
    return json.dumps(
        {
            "session": session,
            "handles": [h.to_wire() for h in handles],
            "layouts": [layout.to_wire() for layout in layouts],
            "signals": signals,
        }
    )


def decode_ipc_stream(entry: str) -> IpcStream:
    try:
        wire = json.loads(entry)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{PPO_IPC_STREAM} entry: not JSON ({exc})") from exc
    if not isinstance(wire, dict) or not {"session", "handles", "layouts", "signals"} <= wire.keys():
        raise ValueError(
            f"{PPO_IPC_STREAM} entry: expected an object with session, handles, layouts and signals"
        )
    handles, layouts = wire["handles"], wire["layouts"]
    if not isinstance(handles, list) or len(handles) != 2:
        raise ValueError(f"{PPO_IPC_STREAM} entry: handles must list the two buffers")
    if not isinstance(layouts, list) or not layouts:
        raise ValueError(f"{PPO_IPC_STREAM} entry: layouts must list at least one bucket")
    return IpcStream(
        session=str(wire["session"]),
        handles=(IpcHandle.from_wire(handles[0]), IpcHandle.from_wire(handles[1])),
        layouts=tuple(BucketLayout.from_wire(w) for w in layouts),
        signals=str(wire["signals"]),
    )


# ------------------------------------------------------------------ SGLang's flattened_bucket


class _CudaTensorRef:
    """Pickles as ``rebuild_cuda_tensor(...)`` of a 1-D uint8 view of an exported buffer."""

    def __init__(self, handle: IpcHandle, nbytes: int) -> None:
        self.handle, self.nbytes = handle, nbytes

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        h = self.handle
        return (
            _original_rebuild(),
            (
                torch.Tensor,
                torch.Size([self.nbytes]),
                (1,),
                0,  # element offset of the view in its storage
                torch.storage.TypedStorage,
                torch.uint8,
                h.device_uuid,  # SGLang's patch: the UUID in place of the device index
                h.handle,
                h.storage_size_bytes,
                h.storage_offset_bytes,
                False,  # requires_grad
                h.ref_counter_handle,
                h.ref_counter_offset,
                h.event_handle,
                h.event_sync_required,
            ),
        )


def _original_rebuild() -> Callable[..., torch.Tensor]:
    # When SGLang is imported in this process and has patched torch, the module attribute is SGLang's
    # wrapper; pickling torch's own function keeps the payload's global the same either way.
    original = vars(reductions).get("_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original


def encode_flattened_bucket(handle: IpcHandle, layout: BucketLayout) -> str:
    """One TP rank's entry for ``load_format: "flattened_bucket"`` (base64, as SGLang's HTTP expects)."""
    metadata = [
        types.SimpleNamespace(
            name=name,
            shape=torch.Size(shape),
            dtype=dtype,
            start_idx=offset,
            end_idx=offset + size,
            numel=size,
        )
        for name, dtype, shape, offset, size in zip(
            layout.names, layout.dtypes, layout.shapes, layout.offsets, layout.sizes(), strict=True
        )
    ]
    payload = {"flattened_tensor": _CudaTensorRef(handle, layout.nbytes), "metadata": metadata}
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def export_flattened_bucket(buffer: torch.Tensor, layout: BucketLayout) -> str:
    """A fresh export of ``buffer`` (one per SGLang call: SGLang maps, loads and unmaps each time)."""
    return encode_flattened_bucket(export_buffer(buffer), layout)


# The globals a flattened_bucket payload may name, and what each becomes when we read one.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): tuple,
}


@dataclass(frozen=True)
class _Rebuild:
    """What ``rebuild_cuda_tensor`` was called with in a payload, before anything is mapped."""

    args: tuple[Any, ...]

    @property
    def handle(self) -> IpcHandle:
        a = self.args
        device = a[_DEVICE_ARG]
        uuid = device if isinstance(device, str) else device_uuid(int(device))
        return IpcHandle(
            device_uuid=uuid,
            handle=bytes(a[7]),
            storage_size_bytes=int(a[8]),
            storage_offset_bytes=int(a[9]),
            ref_counter_handle=bytes(a[11]),
            ref_counter_offset=int(a[12]),
            event_handle=bytes(a[13] or b""),
            event_sync_required=bool(a[14]),
        )

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.args[1]).numel()) * self.args[5].itemsize


class _PayloadUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in (
            ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
            ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ):
            return lambda *args: _Rebuild(tuple(args))
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise ValueError(f"flattened_bucket payload: global {module}.{name} is not allowed")


@dataclass(frozen=True)
class FlattenedBucket:
    """A decoded ``flattened_bucket`` entry: the buffer's export and the tensors' layout in it."""

    handle: IpcHandle
    nbytes: int
    layout: BucketLayout
    rebuild_args: tuple[Any, ...]

    def open(self) -> torch.Tensor:
        """Map the buffer through torch's own ``rebuild_cuda_tensor``, the device resolved from its UUID
        (what SGLang's ``_rebuild_cuda_tensor_modified`` does): torch's per-process cache and producer
        count apply, so the mapping goes when the returned tensor and its views die."""
        args = self.rebuild_args
        index = device_index(self.handle.device_uuid)
        return _original_rebuild()(*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1 :])


def decode_flattened_bucket(entry: str | bytes) -> FlattenedBucket:
    """Read one TP rank's entry without mapping anything (ValueError for anything malformed)."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except ValueError as exc:
        raise ValueError(f"flattened_bucket entry: not base64 ({exc})") from exc
    try:
        obj = _PayloadUnpickler(io.BytesIO(raw)).load()
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(
            f"flattened_bucket entry: not a valid payload ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(obj, Mapping) or not {"flattened_tensor", "metadata"} <= obj.keys():
        raise ValueError("flattened_bucket entry: expected a dict with flattened_tensor and metadata")
    ref = obj["flattened_tensor"]
    if not isinstance(ref, _Rebuild):
        raise ValueError("flattened_bucket entry: flattened_tensor is not a shared CUDA tensor")
    metas = list(obj["metadata"])
    try:
        layout = BucketLayout(
            names=tuple(str(m.name) for m in metas),
            dtypes=tuple(m.dtype for m in metas),
            shapes=tuple(tuple(int(s) for s in m.shape) for m in metas),
            offsets=tuple(int(m.start_idx) for m in metas),
        )
    except AttributeError as exc:
        raise ValueError(f"flattened_bucket entry: metadata lacks a field ({exc})") from exc
    for m, size in zip(metas, layout.sizes(), strict=True):
        if int(m.end_idx) - int(m.start_idx) != size:
            raise ValueError(
                f"flattened_bucket entry: {m.name!r} spans {m.end_idx - m.start_idx} bytes, needs {size}"
            )
    if layout.nbytes > ref.nbytes:
        raise ValueError(
            f"flattened_bucket entry: tensors end at byte {layout.nbytes}, the buffer has {ref.nbytes}"
        )
    return FlattenedBucket(handle=ref.handle, nbytes=ref.nbytes, layout=layout, rebuild_args=ref.args)
