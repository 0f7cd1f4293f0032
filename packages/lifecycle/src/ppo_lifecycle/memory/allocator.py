"""Whether torch's CUDA caching allocator uses expandable segments, and switching them on.

Why a sleep cares: with ordinary segments every ``cudaFree`` that ``torch.cuda.empty_cache()`` makes
synchronizes the whole device, so freeing a released storage waits for every copy still in flight
and the frees add to the copy time (measured on an H200: 339 segments of a 9.87 GB state, 23 ms on
top of a 183 ms copy). With expandable segments, freeing unmaps pages after synchronizing only the
stream the memory was allocated on, so storages whose bytes already reached the host are freed
while later copies run on the side stream (``benchmarks/sleep_breakdown.py``).

The setting is process-wide and applies to segments created after it: switch it on before the
model and optimizer are allocated. torch offers no public getter, so this module remembers what it
set, else asks the allocator for the last settings string it parsed (torch's private
``_accelerator_getAllocatorSettings`` where it exists; torch 2.11 lacks it, and then the allocator
snapshot's copy once CUDA is initialised), else reads ``PYTORCH_CUDA_ALLOC_CONF`` /
``PYTORCH_ALLOC_CONF``.
"""

from __future__ import annotations

import os
import re

import torch

_ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_SETTING = re.compile(r"expandable_segments\s*:\s*(\w+)", re.IGNORECASE)

_set_here: bool | None = None  # what enable_expandable_segments() / disable set, None: never called
_last_applied: str | None = None  # the whole settings string this module handed torch last


def _from_environment() -> bool | None:
    for var in _ENV_VARS:
        match = _SETTING.search(os.environ.get(var, ""))
        if match:
            return match.group(1).lower() == "true"
    return None


def _allocator_settings() -> str | None:
    """The settings string the allocator last parsed, or None when this torch cannot say."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # private, newer torch
    if getter is not None:
        return str(getter())
    if not torch.cuda.is_initialized():  # reading the snapshot would initialise CUDA
        return _last_applied
    # torch 2.11 has the setter only; its allocator snapshot carries the last string (checked on an H200)
    value = torch.cuda.memory._snapshot().get("allocator_settings", {}).get("PYTORCH_CUDA_ALLOC_CONF")
    return str(value) if value is not None else _last_applied


def _from_allocator() -> bool | None:
    settings = _allocator_settings()
    match = _SETTING.search(settings) if settings is not None else None
    return match.group(1).lower() == "true" if match else None


def expandable_segments_enabled() -> bool:
    """True when new CUDA segments are expandable (set here, in the allocator, or in its environment)."""
    for source in (lambda: _set_here, _from_allocator, _from_environment):
        chosen = source()
        if chosen is not None:
            return chosen
    return False


def enable_expandable_segments() -> bool:
    """Switch expandable segments on, unless the environment already chose either way.

    Returns whether they are on afterwards. A user's explicit ``expandable_segments:False`` in
    ``PYTORCH_CUDA_ALLOC_CONF`` wins (their reason is theirs: e.g. memory shared with another
    process by a path that does not handle expandable segments).
    """
    global _set_here
    chosen = _from_environment()
    if chosen is not None:
        _set_here = chosen
        return chosen
    _apply(True)
    _set_here = True
    return True


def set_expandable_segments(on: bool) -> None:
    """Set the allocator's expandable segments for segments created from now on (process-wide)."""
    global _set_here
    _apply(on)
    _set_here = on


def _apply(on: bool) -> None:
    # torch parses a settings string whole and resets the keys it leaves out (max_split_size_mb,
    # roundup_power2_divisions, garbage_collection_threshold), so the user's other settings are
    # passed again, only expandable_segments replaced.
    current = _allocator_settings()
    if current is None:
        current = next((os.environ[var] for var in _ENV_VARS if os.environ.get(var)), "")
    setting = f"expandable_segments:{'True' if on else 'False'}"
    if _SETTING.search(current):
        setting = _SETTING.sub(setting, current, count=1)
    elif current.strip():
        setting = f"{current},{setting}"
    # torch 2.11 deprecates torch.cuda.memory._set_allocator_settings for this private accelerator call.
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)
    global _last_applied
    _last_applied = setting
