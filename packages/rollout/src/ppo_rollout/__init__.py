"""Rollout engines (built-in and SGLang), the rollout manager, tasks and rewards."""

__version__ = "0.1.0"
