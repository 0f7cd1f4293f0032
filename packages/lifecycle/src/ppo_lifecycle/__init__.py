"""Idempotent sleep/wake for training and inference workers:
memory backends, reloadable process groups, the offload plan.

The public interface (the README's "Stable interface") is imported from the module that defines it,
so that the offload plan costs no torch (``ppo-driver validate`` reads it):

- ``ppo_lifecycle.plan``: ``OffloadPlan``, ``Phase``, ``PHASES``, ``Transition``,
  ``ResidentSharedCriticWarning`` (torch-free)
- ``ppo_lifecycle.stats``: ``TransferStats`` (torch-free)
- ``ppo_lifecycle.lifecycle``: ``Lifecycle``, ``State``, ``StepObserver``
- ``ppo_lifecycle.memory``: ``MemoryBackend``, ``HostMemoryBackend``, ``PinnedHostBackend``,
  ``TorchMemorySaverBackend``, ``HostCopies``, ``TensorSource``, ``default_backend``,
  ``enable_expandable_segments``, ``expandable_segments_enabled``, ``set_expandable_segments``
- ``ppo_lifecycle.process_groups``: ``ReloadableProcessGroups``, ``ProcessGroupSet``, ``GroupHandle``,
  ``group_timeout``
"""

__version__ = "0.2.0"
