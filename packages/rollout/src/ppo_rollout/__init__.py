"""Rollout engines (built-in and SGLang), the rollout manager, tasks and rewards."""

from .batch import FIELDS, Sample, balanced_split, rank_fields, split_samples
from .config import RolloutConfig, RolloutSettings, SamplingConfig, SamplingSettings, SGLangOptions
from .data import JsonlPrompts, PromptSource, TaskPrompts
from .engine.builtin import MEMORY_TAGS, BuiltinEngine, BuiltinEngineActor
from .engine.core import GenerationCore, GenerationOutput, sample_tokens
from .engine.sglang import SGLangClient, SGLangError, SGLangServer, SGLangServerSpec
from .manager import RolloutBatch, RolloutManager
from .rewards import (
    RewardError,
    RewardFn,
    RewardInput,
    check_rewards,
    compute_rewards,
    register_reward,
    registered_rewards,
    resolve_reward,
)
from .slots import EngineSlots
from .tasks import TASKS, Task, get_task, make_tiny_model
from .tokenizer import build_char_tokenizer

__version__ = "0.1.0"

__all__ = [
    "FIELDS",
    "MEMORY_TAGS",
    "TASKS",
    "BuiltinEngine",
    "BuiltinEngineActor",
    "EngineSlots",
    "GenerationCore",
    "GenerationOutput",
    "JsonlPrompts",
    "PromptSource",
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
    "Sample",
    "SamplingConfig",
    "SamplingSettings",
    "Task",
    "TaskPrompts",
    "balanced_split",
    "build_char_tokenizer",
    "check_rewards",
    "compute_rewards",
    "get_task",
    "make_tiny_model",
    "rank_fields",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "sample_tokens",
    "split_samples",
]
