"""Fault injection for the end-to-end fault tests; never set in a real run.

``PPO_FAULT_ENGINE_EXIT=<n>`` makes a built-in engine's process exit (``os._exit``, as a kill would
end it) on its ``n``-th weight load, counted per engine process from 1 (the first is start-up's
update): the engine dies in the middle of a weight update, with the sender waiting on it, which a kill
from outside can hardly time on a short CPU run.
"""

from __future__ import annotations

import logging
import os

__all__ = ["ENGINE_EXIT", "before_weight_load"]

ENGINE_EXIT = "PPO_FAULT_ENGINE_EXIT"
_loads = 0

log = logging.getLogger(__name__)


def before_weight_load(engine: str) -> None:
    """Exit this process on its ``n``-th weight load when ``PPO_FAULT_ENGINE_EXIT=<n>``."""
    global _loads
    wanted = os.environ.get(ENGINE_EXIT, "")
    if not wanted:
        return
    _loads += 1
    if wanted == str(_loads):
        log.warning("%s=%s: engine %s exits during its weight load", ENGINE_EXIT, wanted, engine)
        os._exit(1)
