"""``package.module:name`` settings: the named object, or a ``ValueError`` that names the setting."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

__all__ = ["import_named"]


def import_named(setting: str, spec: str, form: str, builtins: Sequence[str]) -> Any:
    """The object ``spec`` (``package.module:name``) names; ``setting`` and ``form`` (for example
    ``'package.module:factory'``) word the error, ``builtins`` lists the built-in names it could be."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"{setting}={spec!r}: write {form!r} or a built-in name ({', '.join(sorted(builtins))})"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{setting}={spec!r}: cannot import {module_name!r}: {exc}") from exc
    found = getattr(module, attr, None)
    if found is None:
        raise ValueError(f"{setting}={spec!r}: {module_name!r} has no {attr!r}")
    return found
