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


def _allocator_settings() -> str | None:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # private; torch >= 2.9
    return str(getter()) if getter is not None else None


@contextmanager
def ordinary_segments(device: torch.device) -> Iterator[torch.cuda.MemPool | None]:
    """Allocations on ``device`` inside are in ordinary segments; yields the private pool (keep it as
    long as the tensors: its segments return to the device once both are gone), or None when the
    allocator does not use expandable segments (nothing to do)."""
    settings = _allocator_settings()
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if settings is None or setter is None or not _EXPANDABLE_ON.search(settings):
        yield None
        return
    pool = torch.cuda.MemPool()
    # torch resets every key a settings string leaves out: pass the others again, expandable ones off
    setter(_EXPANDABLE_ON.sub("expandable_segments:False", settings, count=1))
    try:
        with torch.cuda.use_mem_pool(pool, device=device):
            yield pool
    finally:
        setter(settings)
