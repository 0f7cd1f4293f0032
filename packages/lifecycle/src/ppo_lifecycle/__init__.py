"""Idempotent sleep/wake for training and inference workers:
memory backends, reloadable process groups, the offload plan."""

# Names load on first use (PEP 562): `ppo-driver validate` reads this package's configs and task
# names without paying for torch, transformers and Ray, which the modules behind the rest import.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ppo_lifecycle.lifecycle import Lifecycle, State, StepObserver
    from ppo_lifecycle.memory import (
        HostCopies,
        HostMemoryBackend,
        MemoryBackend,
        PinnedHostBackend,
        TensorSource,
        TorchMemorySaverBackend,
        default_backend,
        enable_expandable_segments,
        expandable_segments_enabled,
        set_expandable_segments,
    )
    from ppo_lifecycle.plan import PHASES, OffloadPlan, Phase, ResidentSharedCriticWarning, Transition
    from ppo_lifecycle.process_groups import (
        GroupHandle,
        ProcessGroupSet,
        ReloadableProcessGroups,
        group_timeout,
    )
    from ppo_lifecycle.stats import TransferStats

_LAZY = {
    "Lifecycle": "ppo_lifecycle.lifecycle",
    "State": "ppo_lifecycle.lifecycle",
    "StepObserver": "ppo_lifecycle.lifecycle",
    "HostCopies": "ppo_lifecycle.memory",
    "HostMemoryBackend": "ppo_lifecycle.memory",
    "MemoryBackend": "ppo_lifecycle.memory",
    "PinnedHostBackend": "ppo_lifecycle.memory",
    "TensorSource": "ppo_lifecycle.memory",
    "TorchMemorySaverBackend": "ppo_lifecycle.memory",
    "default_backend": "ppo_lifecycle.memory",
    "enable_expandable_segments": "ppo_lifecycle.memory",
    "expandable_segments_enabled": "ppo_lifecycle.memory",
    "set_expandable_segments": "ppo_lifecycle.memory",
    "PHASES": "ppo_lifecycle.plan",
    "OffloadPlan": "ppo_lifecycle.plan",
    "Phase": "ppo_lifecycle.plan",
    "ResidentSharedCriticWarning": "ppo_lifecycle.plan",
    "Transition": "ppo_lifecycle.plan",
    "GroupHandle": "ppo_lifecycle.process_groups",
    "ProcessGroupSet": "ppo_lifecycle.process_groups",
    "ReloadableProcessGroups": "ppo_lifecycle.process_groups",
    "group_timeout": "ppo_lifecycle.process_groups",
    "TransferStats": "ppo_lifecycle.stats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "PHASES",
    "GroupHandle",
    "HostCopies",
    "HostMemoryBackend",
    "Lifecycle",
    "MemoryBackend",
    "OffloadPlan",
    "Phase",
    "PinnedHostBackend",
    "ProcessGroupSet",
    "ReloadableProcessGroups",
    "ResidentSharedCriticWarning",
    "State",
    "StepObserver",
    "TensorSource",
    "TorchMemorySaverBackend",
    "TransferStats",
    "Transition",
    "default_backend",
    "enable_expandable_segments",
    "expandable_segments_enabled",
    "group_timeout",
    "set_expandable_segments",
]
