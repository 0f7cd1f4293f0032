"""Idempotent sleep/wake for training and inference workers:
memory backends, reloadable process groups, the offload plan."""

from ppo_lifecycle.lifecycle import Lifecycle, State, StepObserver
from ppo_lifecycle.memory import (
    HostMemoryBackend,
    MemoryBackend,
    PinnedHostBackend,
    TensorSource,
    TorchMemorySaverBackend,
    default_backend,
)
from ppo_lifecycle.plan import PHASES, OffloadPlan, Phase, ResidentSharedCriticWarning, Transition
from ppo_lifecycle.process_groups import GroupHandle, ProcessGroupSet, ReloadableProcessGroups, group_timeout
from ppo_lifecycle.stats import TransferStats

__version__ = "0.1.0"

__all__ = [
    "PHASES",
    "GroupHandle",
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
    "group_timeout",
]
