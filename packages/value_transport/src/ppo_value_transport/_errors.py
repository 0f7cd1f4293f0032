"""The transport's own errors (a module of their own: both the routing and the pairing raise them)."""

from __future__ import annotations


class MissingValuesError(RuntimeError):
    """A rank that needs values has none: an error, never a silent skip."""
