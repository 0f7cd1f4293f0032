"""Idempotent sleep/wake for training and inference workers:
memory backends, reloadable process groups, the offload plan."""

__version__ = "0.1.0"
