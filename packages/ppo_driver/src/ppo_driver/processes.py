"""``processes.json`` in the run folder: the process id of every role's Ray worker, by role and rank.

What an operator needs to watch a run (``top -p``), and what a fault drill kills. Written once the
roles exist; roles made by another factory than ``create_roles`` are listed as far as they are known.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import ray

from ppo_driver.roles import Roles

PROCESSES_FILE = "processes.json"
log = logging.getLogger(__name__)


def _pid(_instance: Any) -> int:
    return os.getpid()


def _handles(roles: Roles) -> dict[str, list[Any]]:
    from ppo_rollout.engine.handles import BuiltinEngineHandle
    from ppo_rollout.manager import RolloutManager
    from ppo_trainer.group import TrainGroup

    found: dict[str, list[Any]] = {}
    for name, group in (("actor", roles.actor), ("critic", roles.critic)):
        if isinstance(group, TrainGroup):
            found[name] = list(group.workers)
    if isinstance(roles.rollout, RolloutManager):
        engines = [e.actor for e in roles.rollout.engines if isinstance(e, BuiltinEngineHandle)]
        if engines:
            found["rollout"] = engines
    return found


def record(roles: Roles, run_dir: Path, timeout_s: float) -> dict[str, list[int]]:
    """Ask each worker for its pid (Ray's ``__ray_call__``) and write them to ``processes.json``."""
    handles = _handles(roles)
    pids: dict[str, list[int]] = {"driver": [os.getpid()]}
    for role, actors in handles.items():
        try:
            refs = [a.__ray_call__.remote(_pid) for a in actors]
            pids[role] = [int(p) for p in ray.get(refs, timeout=timeout_s)]
        except Exception as exc:  # a diagnostic: the run's own calls report a dead worker properly
            log.warning("processes.json: no pids for %s (%s)", role, exc)
    (run_dir / PROCESSES_FILE).write_text(json.dumps(pids, indent=1) + "\n")
    return pids
