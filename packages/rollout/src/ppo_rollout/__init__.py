"""Rollout engines (built-in and SGLang), the rollout manager, tasks and rewards.

The names here are the package's public interface (the README's "Stable interface"); everything else
(the generation core, batch packing, prompt sources, the task table) is imported from its module.
"""

from .config import RolloutConfig, RolloutSettings, SamplingConfig, SamplingSettings, SGLangOptions
from .engine.builtin import BuiltinEngine, BuiltinEngineActor
from .engine.core import GenerationOutput
from .engine.sglang import SGLangClient, SGLangError, SGLangServer, SGLangServerSpec
from .manager import RolloutBatch, RolloutManager
from .rewards import RewardError, RewardFn, RewardInput, register_reward
from .slots import EngineSlots
from .tasks import make_tiny_model

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
