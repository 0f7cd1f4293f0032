"""Critic values to actor ranks through the Ray object store, as one flat buffer per payload."""

__version__ = "0.1.0"
