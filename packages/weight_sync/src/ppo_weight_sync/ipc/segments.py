"""Bucket buffers in ordinary CUDA segments, whatever the process's allocator setting.

A trainer may run torch's caching allocator with expandable segments (ppo-lifecycle turns them on so
a sleep frees memory while its copies run). Memory in an expandable segment is not exported with
``cudaIpcGetMemHandle``: torch exports it as a file descriptor that the consumer takes with
``pidfd_getfd``, which the kernel allows only with ptrace access to the sender (refused between
sibling processes under Yama's ``ptrace_scope=1``, the default of many distributions: Ray workers and
an SGLang server are such siblings). An ordinary segment's handle opens in any process on the host.
So the packer allocates its two buffers with expandable segments off for that moment, in a private
memory pool (a fresh segment, never a free block of an expandable one).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_EXPANDABLE_ON = re.compile(r"expandable_segments\s*:\s*true", re.IGNORECASE)


def allocator_settings() -> str | None:
    """The settings string torch's CUDA allocator last parsed (environment or runtime), or None when
    this torch cannot say. torch has no public getter: newer versions have the private
    ``_accelerator_getAllocatorSettings``; older ones (2.11 has only the setter) carry the string in
    the allocator snapshot, read only when CUDA is already initialised (never initialised here)."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        return str(getter())
    if not torch.cuda.is_initialized():
        return None
    # About 2 ms with 2,000 blocks on an H200; the packer asks once per buffer allocation.
    settings = torch.cuda.memory._snapshot().get("allocator_settings", {})
    value = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    return str(value) if value is not None else None


def set_allocator_settings(settings: str) -> None:
    """Hand torch's allocator a whole settings string (every key it leaves out is reset)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(settings)
    else:  # torch < 2.9; 2.11 deprecates this name for the private call above
        torch.cuda.memory._set_allocator_settings(settings)


@contextmanager
def ordinary_segments(device: torch.device) -> Iterator[torch.cuda.MemPool | None]:
    """Allocations on ``device`` inside are in ordinary segments; yields the private pool (keep it as
    long as the tensors: its segments return to the device once both are gone), or None when the
    allocator does not use expandable segments (nothing to do)."""
    settings = allocator_settings()
    if settings is None or not _EXPANDABLE_ON.search(settings):
        yield None
        return
    pool = torch.cuda.MemPool()
    # torch resets every key a settings string leaves out: pass the others again, expandable ones off
    set_allocator_settings(_EXPANDABLE_ON.sub("expandable_segments:False", settings, count=1))
    try:
        with torch.cuda.use_mem_pool(pool, device=device):
            yield pool
    finally:
        set_allocator_settings(settings)
