"""Lists of tensors <-> one contiguous byte buffer in the Ray object store.

A payload is ``ray.put((header, buffer))``: ``buffer`` is one uint8 numpy array holding every
tensor's bytes back to back (each field's segment aligned to 64 bytes so that it can be viewed as
its dtype in place), ``header`` a small dict of dtype names, byte offsets and shapes. Ray stores a
numpy array out of band, so on the same node ``ray.get`` maps the buffer without copying it; the
receiver then builds every tensor as a view of that one buffer. Putting a Python list of tensors
instead costs one pickle and one object-store buffer per tensor, which is what makes it slow.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError

from ppo_value_transport._box import Box
from ppo_value_transport._dtypes import TORCH_DTYPES, dtype_name

FORMAT = 1
_ALIGN = 64
_LIST = "list"
_FIELDS = "fields"
DEFAULT_TIMEOUT_S = 600.0

TensorLike = torch.Tensor | np.ndarray


@dataclass(frozen=True)
class _Plan:
    """Where one named list of tensors goes in the buffer."""

    name: str
    dtype: str
    tensors: tuple[torch.Tensor, ...]
    shapes: np.ndarray  # int64 [n, ndim]
    offset: int
    nbytes: int


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_tensor(x: object, where: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        # detach() only where needed: cat(out=...) refuses inputs that require grad.
        return x.detach() if x.requires_grad else x
    if isinstance(x, np.ndarray):
        dtype_name(x.dtype, where)
        # from_numpy shares memory but rejects negative strides: copy only arrays that are not
        # C-contiguous (np.ascontiguousarray would also turn a 0-d array into a 1-d one).
        array = x if x.flags.c_contiguous else x.copy(order="C")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only arrays: we only read them
            return torch.from_numpy(array)
    raise ValueError(f"{where}: expected a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _plan_field(name: str, items: Sequence[TensorLike], offset: int, label: str) -> _Plan:
    if isinstance(items, torch.Tensor | np.ndarray) or not isinstance(items, Sequence):
        raise ValueError(
            f"{label}: expected a sequence (list or tuple) of tensors, one per sample, "
            f"got {type(items).__name__}; wrap a single tensor as [tensor]"
        )
    tensors = tuple(_as_tensor(x, f"{label}[{i}]") for i, x in enumerate(items))
    if not tensors:
        return _Plan(name, "float32", (), np.zeros((0, 1), dtype=np.int64), offset, 0)
    first = tensors[0]
    name_of_dtype = dtype_name(first.dtype, f"{label}[0]")
    for i, t in enumerate(tensors):
        if t.dtype != first.dtype:
            raise ValueError(
                f"{label}[{i}]: dtype {t.dtype} differs from element 0 ({first.dtype}); "
                "one list carries one dtype, convert the tensors to a common dtype"
            )
        if t.dim() != first.dim():
            raise ValueError(
                f"{label}[{i}]: {t.dim()} dimensions where element 0 has {first.dim()}; "
                "one list carries tensors of one rank (reshape them alike)"
            )
    if first.dim() == 1:  # the common case, one length per sequence: fromiter is ~5x faster
        shapes = np.fromiter((t.shape[0] for t in tensors), dtype=np.int64, count=len(tensors))[:, None]
    else:
        dims = [tuple(t.shape) for t in tensors]
        shapes = np.array(dims, dtype=np.int64).reshape(len(tensors), first.dim())
    nbytes = int(shapes.prod(axis=1).sum()) * first.element_size()
    return _Plan(name, name_of_dtype, tensors, shapes, offset, nbytes)


def _payload_device(plans: Sequence[_Plan]) -> torch.device:
    # get_device() is an int (-1 for CPU): much cheaper than building a torch.device per tensor.
    indices = {t.get_device() for p in plans for t in p.tensors}
    if len(indices) > 1:
        listed = ", ".join(sorted("cpu" if i < 0 else f"cuda:{i}" for i in indices))
        raise ValueError(f"pack: tensors on several devices ({listed}); move them to one device first")
    index = indices.pop() if indices else -1
    return torch.device("cpu") if index < 0 else torch.device("cuda", index)


def _fill(buffer: torch.Tensor, plan: _Plan) -> None:
    if plan.nbytes == 0:
        return
    out = buffer[plan.offset : plan.offset + plan.nbytes].view(TORCH_DTYPES[plan.dtype])
    # One kernel writes every tensor into its place. 1-D tensors (the common case) go in as they
    # are: a reshape per tensor costs more than the copy for thousands of short sequences.
    flat = plan.tensors if plan.shapes.shape[1] == 1 else [t.reshape(-1) for t in plan.tensors]
    torch.cat(flat, out=out)


class _Staging:
    """One host buffer per process, reused by every ``pack``.

    A fresh buffer of tens of MiB costs a page fault per 4 KiB on first write (the allocator maps
    new pages for every large allocation), which took longer than the copy itself. ``ray.put``
    has copied the bytes into the object store by the time it returns, so the buffer is free again
    right after; the lock keeps two threads of one actor from sharing it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer = np.empty(0, dtype=np.uint8)

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[np.ndarray]:
        with self._lock:
            if self._buffer.size < nbytes:
                self._buffer = np.empty(nbytes, dtype=np.uint8)
            yield self._buffer[:nbytes]


_staging = _Staging()


def _put(kind: str, plans: Sequence[_Plan]) -> Box:
    total = _align(plans[-1].offset + plans[-1].nbytes) if plans else 0
    header: dict[str, Any] = {
        "format": FORMAT,
        "kind": kind,
        "fields": [
            {"name": p.name, "dtype": p.dtype, "offset": p.offset, "nbytes": p.nbytes, "shapes": p.shapes}
            for p in plans
        ],
    }
    device = _payload_device(plans)
    if device.type == "cpu":
        with _staging.hold(total) as host:
            staging = torch.from_numpy(host)
            for plan in plans:
                _fill(staging, plan)
            return Box(ray.put((header, host)), nbytes=total)
    else:
        # Gather on the device (one kernel per field), then one device-to-host copy into pinned
        # memory, instead of one small transfer per tensor.
        on_device = torch.empty(total, dtype=torch.uint8, device=device)
        for plan in plans:
            _fill(on_device, plan)
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(on_device, non_blocking=True)
        torch.cuda.current_stream(device).synchronize()
        return Box(ray.put((header, pinned.numpy())), nbytes=total)


def pack(tensors: Sequence[TensorLike]) -> Box:
    """Put a list of tensors (one per sequence, any lengths, one dtype) into the object store.

    Accepts torch tensors (CPU or one CUDA device) and numpy arrays; the receiver always gets torch
    tensors from :func:`unpack`. Supported dtypes: bool, uint8, int8, int16, int32, int64,
    float16, bfloat16, float32, float64. An empty list and zero-length tensors are fine.
    """
    return _put(_LIST, [_plan_field("", tensors, 0, "pack: tensors")])


def pack_fields(fields: Mapping[str, Sequence[TensorLike]]) -> Box:
    """Put several named lists of tensors (each list one dtype) into the object store as one buffer.

    Every list may have its own dtype and length; all share one contiguous byte buffer, each
    list's segment aligned to 64 bytes. :func:`unpack_fields` returns them by name.
    """
    if not isinstance(fields, Mapping):
        raise ValueError(
            f"pack_fields: expected a mapping of field name to list of tensors, got {type(fields).__name__}"
        )
    plans: list[_Plan] = []
    offset = 0
    for name, items in fields.items():
        if not isinstance(name, str):
            raise ValueError(f"pack_fields: field names must be str, got {name!r}")
        plan = _plan_field(name, items, offset, f"pack_fields: field {name!r}")
        plans.append(plan)
        offset = _align(plan.offset + plan.nbytes)
    return _put(_FIELDS, plans)


def _fetch(box: Box, timeout_s: float, caller: str) -> tuple[dict[str, Any], np.ndarray]:
    if not isinstance(box, Box):
        raise ValueError(f"{caller}: expected a ppo_value_transport.Box, got {type(box).__name__}")
    try:
        payload = ray.get(box.ref, timeout=timeout_s)
    except GetTimeoutError as exc:
        raise TimeoutError(
            f"{caller}: waited {timeout_s:g} s for payload {box.ref.hex()} from the object store; "
            "the producer has not finished putting it (or its node is gone)"
        ) from exc
    if not (
        isinstance(payload, tuple)
        and len(payload) == 2
        and isinstance(payload[0], dict)
        and payload[0].get("format") == FORMAT
    ):
        raise ValueError(
            f"{caller}: Box {box.ref.hex()} does not hold a ppo_value_transport payload "
            "(build it with pack() or pack_fields())"
        )
    return payload[0], payload[1]


def _to_torch(buffer: np.ndarray, device: torch.device, copy: bool) -> torch.Tensor:
    with warnings.catch_warnings():
        # The object store hands back a read-only array; the tensors we build are views of it.
        warnings.simplefilter("ignore", UserWarning)
        base = torch.from_numpy(buffer)
    if device.type == "cpu":
        return base.clone() if copy else base
    # Host -> pinned staging (one memcpy) -> device with a non-blocking copy. The caching host
    # allocator keeps the staging block alive until the copy has finished on its stream, and work
    # queued later on that stream sees the data, so no synchronisation is needed here.
    staging = torch.empty(base.numel(), dtype=torch.uint8, pin_memory=True)
    staging.copy_(base)
    return staging.to(device, non_blocking=True)


def _split(base: torch.Tensor, field: Mapping[str, Any]) -> list[torch.Tensor]:
    shapes: np.ndarray = field["shapes"]
    if shapes.shape[0] == 0:
        return []
    offset, nbytes = int(field["offset"]), int(field["nbytes"])
    flat = base[offset : offset + nbytes].view(TORCH_DTYPES[field["dtype"]])
    numels = shapes.prod(axis=1) if shapes.shape[1] else np.ones(shapes.shape[0], dtype=np.int64)
    parts = torch.split(flat, numels.tolist())
    if shapes.shape[1] == 1:
        return list(parts)
    return [p.view(tuple(s)) for p, s in zip(parts, shapes.tolist(), strict=True)]


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unpack: device {device!r} is not a torch device (use 'cpu' or 'cuda:N')") from exc


def unpack(
    box: Box,
    device: str | torch.device = "cpu",
    *,
    copy: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[torch.Tensor]:
    """Fetch a :func:`pack` payload and return its tensors, always as torch tensors on ``device``.

    On CPU without ``copy`` the tensors are views of the object-store buffer (no copy on the same
    node); that memory is read-only, so ``clone()`` a tensor before writing to it in place, or pass
    ``copy=True`` for one writable copy of the whole buffer. On CUDA the buffer goes through a
    pinned staging buffer with a non-blocking copy, and the tensors are views of one device buffer.
    """
    dev = _device(device)
    header, buffer = _fetch(box, timeout_s, "unpack")
    if header["kind"] != _LIST:
        raise ValueError("unpack: this Box holds named fields (made by pack_fields); use unpack_fields")
    base = _to_torch(buffer, dev, copy)
    return _split(base, header["fields"][0])


def unpack_fields(
    box: Box,
    device: str | torch.device = "cpu",
    *,
    copy: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, list[torch.Tensor]]:
    """Fetch a :func:`pack_fields` payload: field name -> list of torch tensors on ``device``.

    Same memory rules as :func:`unpack` (read-only views on CPU unless ``copy=True``).
    """
    dev = _device(device)
    header, buffer = _fetch(box, timeout_s, "unpack_fields")
    if header["kind"] != _FIELDS:
        raise ValueError("unpack_fields: this Box holds one list (made by pack); use unpack")
    base = _to_torch(buffer, dev, copy)
    return {field["name"]: _split(base, field) for field in header["fields"]}
