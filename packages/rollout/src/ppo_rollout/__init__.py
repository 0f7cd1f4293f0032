"""Rollout engines (built-in and SGLang), the rollout manager, tasks and rewards.

The names here are the package's public interface (the README's "Stable interface"); everything else
(the generation core, batch packing, prompt sources, the task table) is imported from its module.
"""

# Names load on first use (PEP 562): `ppo-driver validate` reads this package's configs and task
# names without paying for torch, transformers and Ray, which the modules behind the rest import.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import RolloutConfig, RolloutSettings, SamplingConfig, SamplingSettings, SGLangOptions
    from .engine.builtin import BuiltinEngine, BuiltinEngineActor
    from .engine.core import GenerationOutput
    from .engine.sglang import SGLangClient, SGLangError, SGLangServer, SGLangServerSpec
    from .manager import RolloutBatch, RolloutManager
    from .rewards import RewardError, RewardFn, RewardInput, register_reward
    from .slots import EngineSlots
    from .tasks import make_tiny_model

_LAZY = {
    "RolloutConfig": ".config",
    "RolloutSettings": ".config",
    "SamplingConfig": ".config",
    "SamplingSettings": ".config",
    "SGLangOptions": ".config",
    "BuiltinEngine": ".engine.builtin",
    "BuiltinEngineActor": ".engine.builtin",
    "GenerationOutput": ".engine.core",
    "SGLangClient": ".engine.sglang",
    "SGLangError": ".engine.sglang",
    "SGLangServer": ".engine.sglang",
    "SGLangServerSpec": ".engine.sglang",
    "RolloutBatch": ".manager",
    "RolloutManager": ".manager",
    "RewardError": ".rewards",
    "RewardFn": ".rewards",
    "RewardInput": ".rewards",
    "register_reward": ".rewards",
    "EngineSlots": ".slots",
    "make_tiny_model": ".tasks",
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
    "BuiltinEngine",
    "BuiltinEngineActor",
    "EngineSlots",
    "GenerationOutput",
    "RewardError",
    "RewardFn",
    "RewardInput",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutManager",
    "RolloutSettings",
    "SGLangClient",
    "SGLangError",
    "SGLangOptions",
    "SGLangServer",
    "SGLangServerSpec",
    "SamplingConfig",
    "SamplingSettings",
    "make_tiny_model",
    "register_reward",
]
