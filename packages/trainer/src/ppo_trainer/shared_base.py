"""``train.lora.share_base``: one copy of the frozen base weights for a LoRA actor and a LoRA critic that
share devices.

Under ``train.lora`` the decoder's weights, the embeddings and the norms are frozen in both roles and
hold the same values (both load ``model_path``), so the actor (the owner) moves its frozen parameters
into one flat buffer that another process can map, and the critic of the same bundle (the user) maps
it and points its frozen backbone parameters (and, with reward-level KL, its reference model's) at
views into it. Each role keeps its own adapters, value head, gradients and AdamW state.

How the buffer is shared, by device:

- CPU: a file in POSIX shared memory (``/dev/shm``) that both processes map with
  ``torch.from_file(shared=True)`` (``MAP_SHARED``): the same physical pages, no copy. A file rather than
  torch's ``share_memory_()``: its name travels through Ray as a string, and the owner decides when it
  disappears (``SharedBase.unlink``: once the user mapped it, and at shutdown, so a file outlives a
  crashed owner only while the user has not mapped it yet). The mapping stays valid after the unlink.
- CUDA: a CUDA IPC handle of the buffer (``ppo_weight_sync.ipc.export_buffer`` / ``open_handle``, the
  handles the weight update already sends colocated engines), allocated outside the memory backend's
  regions: a torch_memory_saver allocation cannot be exported, and a region is unmapped by a sleep.

The buffer is never tracked by the lifecycle's memory backend (``holds`` tells the trainer which tensors
to leave out): it stays resident while either role sleeps; a sleep moves the adapters, the value
head and the optimizer state only. The owner keeps the buffer until its process ends; the user's
mapping keeps the pages (CPU) or torch's IPC reference count keeps the allocation (CUDA) while it lives.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import hashlib
import os
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ppo_weight_sync.ipc import IpcHandle, export_buffer, open_handle
from ppo_weight_sync.ipc.segments import ordinary_segments

__all__ = [
    "SHM_PREFIX",
    "BaseTensor",
    "SharedBase",
    "SharedBaseHandle",
    "frozen_parameters",
    "mapping_report",
    "return_freed_host_memory",
]

SHM_PREFIX = "ppo-lora-base"  # /dev/shm/ppo-lora-base-<owner pid>-<random>
_ALIGN = 64  # bytes: every tensor starts on a cache line (and on any dtype's alignment)


@dataclass(frozen=True)
class BaseTensor:
    """One frozen tensor in the buffer, under the owner's (the causal LM's) name."""

    name: str
    dtype: str  # torch dtype name without the prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start


@dataclass(frozen=True)
class SharedBaseHandle:
    """What the user needs to map the owner's base (picklable: it travels through Ray)."""

    nbytes: int
    tensors: tuple[BaseTensor, ...]
    path: str | None = None  # CPU: the shared-memory file
    ipc: IpcHandle | None = None  # CUDA: the buffer's IPC handle


def frozen_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model``'s frozen parameters by name, a tied parameter once (under its first name)."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            yield name, p


class SharedBase:
    """The flat buffer holding the base, in the owner (``publish``) or the user (``attach``)."""

    def __init__(self, buffer: torch.Tensor, handle: SharedBaseHandle, *, owner: bool) -> None:
        self.buffer = buffer
        self.handle = handle
        self.owner = owner
        self._storage_ptr = buffer.untyped_storage().data_ptr()
        self._pool: torch.cuda.MemPool | None = None  # the owner's CUDA buffer's pool, kept with it

    # ------------------------------------------------------------------ owner
    @classmethod
    def publish(cls, model: nn.Module) -> SharedBase:
        """Move ``model``'s frozen parameters into a shareable buffer (their values unchanged)."""
        params = list(frozen_parameters(model))
        if not params:
            raise ValueError("share_base: the model has no frozen parameters to share (is train.lora on?)")
        device = params[0][1].device
        entries: list[BaseTensor] = []
        offset = 0
        for name, p in params:
            entries.append(BaseTensor(name, str(p.dtype).removeprefix("torch."), tuple(p.shape), offset))
            offset += -(-p.numel() * p.element_size() // _ALIGN) * _ALIGN
        path: str | None = None
        pool: torch.cuda.MemPool | None = None
        if device.type == "cpu":
            path = _new_shm_file(offset)
            buffer = torch.from_file(path, shared=True, size=offset, dtype=torch.uint8)
        else:
            # An ordinary segment: memory in an expandable one (the pinned memory backend turns them on)
            # exports as a file descriptor that a sibling process may not take (see
            # ppo_weight_sync.ipc.segments); the private pool is kept as long as the buffer.
            with ordinary_segments(device) as pool:
                buffer = torch.empty(offset, dtype=torch.uint8, device=device)
        with torch.no_grad():
            for entry, (_, p) in zip(entries, params, strict=True):
                view = _view(buffer, entry)
                view.copy_(p.data)
                p.data = view
        ipc = export_buffer(buffer) if device.type == "cuda" else None
        shared = cls(buffer, SharedBaseHandle(offset, tuple(entries), path, ipc), owner=True)
        shared._pool = pool
        return shared

    def unlink(self) -> None:
        """Remove the shared-memory file (owner, CPU): the mappings stay; no process can map it again."""
        path = self.handle.path
        if self.owner and path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # ------------------------------------------------------------------ user
    @classmethod
    def attach(cls, handle: SharedBaseHandle) -> SharedBase:
        """Map the owner's buffer in this process."""
        if handle.path is not None:
            if not os.path.exists(handle.path):
                raise ValueError(
                    f"share_base: the actor's shared base {handle.path} is gone (the actor unlinks it once "
                    "mapped, and at shutdown); set the critic up before the actor's base_mapped()"
                )
            buffer = torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
        elif handle.ipc is not None:
            buffer = open_handle(handle.ipc)[: handle.nbytes]
        else:
            raise ValueError("SharedBaseHandle: neither a file path nor a CUDA IPC handle")
        return cls(buffer, handle, owner=False)

    def bind(self, model: nn.Module, names: Mapping[str, str]) -> int:
        """Point ``model``'s parameters at the buffer: ``names`` maps each of the model's parameter
        names to the owner's name of the tensor it takes. Returns the bytes each parameter held before
        (freed now). ValueError when a shape or dtype differs (another model or compute dtype)."""
        by_name = {t.name: t for t in self.handle.tensors}
        own = dict(model.named_parameters(remove_duplicate=False))
        freed = 0
        with torch.no_grad():
            for mine, theirs in names.items():
                entry = by_name[theirs]
                p = own[mine]
                view = _view(self.buffer, entry)
                if view.shape != p.shape or view.dtype != p.dtype:
                    raise ValueError(
                        f"train.lora.share_base: the critic's {mine} is {p.dtype} {tuple(p.shape)} but the "
                        f"actor's {theirs} is {view.dtype} {tuple(view.shape)}; both roles must load the "
                        "same model_path with the same dtype, or set train.lora.share_base=false"
                    )
                if p.requires_grad:
                    raise ValueError(f"share_base: {mine} trains; only frozen tensors can be shared")
                if p.data.untyped_storage().data_ptr() != self._storage_ptr:
                    freed += p.numel() * p.element_size()
                p.data = view
        return freed

    # ------------------------------------------------------------------ both
    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a view into the shared buffer (the memory backend must leave it)."""
        return tensor.untyped_storage().data_ptr() == self._storage_ptr

    def digest(self) -> str:
        """SHA-256 of the buffer's bytes as this process reads them (checks, tests)."""
        return hashlib.sha256(self.buffer.cpu().numpy().tobytes()).hexdigest()


def mapping_report(handle: SharedBaseHandle) -> dict[str, int]:
    """On Linux, for a CPU base: the mapped file's ``inode`` (equal in every process that maps the same
    pages, also after the unlink), the mapping's resident and proportional bytes in this process
    (``base_rss``, ``base_pss``: PSS splits shared pages over the processes mapping them) and the
    process's (``process_rss``, ``process_pss``), from ``/proc/self/smaps``. Empty elsewhere."""
    if handle.path is None or not os.path.exists("/proc/self/smaps"):
        return {}
    out = {"base_rss": 0, "base_pss": 0, "process_rss": 0, "process_pss": 0}
    in_base = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: address perms offset dev inode path
                in_base = len(fields) >= 6 and fields[5] == handle.path
                if in_base:
                    out["inode"] = int(fields[4])
            elif fields[0] in ("Rss:", "Pss:"):
                key = fields[0][:-1].lower()
                kib = int(fields[1]) * 1024
                out[f"process_{key}"] += kib
                if in_base:
                    out[f"base_{key}"] += kib
    return out


def return_freed_host_memory() -> None:
    """Give the heap the replaced copies of the base lived in back to the OS (glibc's ``malloc_trim``;
    a no-op elsewhere): freed, glibc keeps them for later allocations, so the process would look as
    large as if it still held its own base until other allocations reuse them."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _view(buffer: torch.Tensor, entry: BaseTensor) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    n = 1
    for d in entry.shape:
        n *= d
    nbytes = n * dtype.itemsize
    return buffer[entry.offset : entry.offset + nbytes].view(dtype).view(entry.shape)


def _new_shm_file(nbytes: int) -> str:
    """A fresh file of ``nbytes`` (sparse: pages are taken as they are written) in ``/dev/shm``, only for
    this user, named ``<SHM_PREFIX>-<pid>-<random>``."""
    folder = "/dev/shm"
    if not os.path.isdir(folder):
        raise ValueError(
            "train.lora.share_base on CPU maps the base from /dev/shm, which this machine lacks; "
            "set train.lora.share_base=false"
        )
    path = os.path.join(folder, f"{SHM_PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return path
