"""Frozen, validated configuration for sampling and rollout."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["RolloutConfig", "SGLangOptions", "SamplingConfig"]


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling for one generate call.

    ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` turn those filters off.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    n_samples_per_prompt: int = 1
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos token(s)
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"sampling.temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"sampling.n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"sampling.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}"
            )
        # Accept lists from YAML/JSON but store a tuple (hashable, immutable).
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclass(frozen=True)
class SGLangOptions:
    """How the SGLang adapter launches servers. ``command`` replaces ``python -m sglang.launch_server``."""

    command: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()  # appended verbatim, e.g. ("--mem-fraction-static", "0.7")
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    stop_grace_s: float = 15.0


@dataclass(frozen=True)
class RolloutConfig:
    """What the rollout manager runs. Exactly one of ``task`` and ``dataset`` is set."""

    model_path: str
    engine: Literal["builtin", "sglang"] = "builtin"
    num_engines: int = 1
    gpus_per_engine: int = 0  # 0 on CPU runs
    task: str | None = None
    dataset: str | None = None  # JSONL path
    prompt_field: str = "prompt"
    reward: str | None = None  # registered name or "module:function"; None: the task's reward
    prompts_per_step: int = 8
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    eval_prompts: int = 0
    eval_sampling: SamplingConfig | None = None  # None: greedy with the training max_new_tokens
    max_prompt_length: int = 256  # in tokens, including <bos>
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    seed: int = 0
    sglang: SGLangOptions = field(default_factory=SGLangOptions)
    timeout_s: float = 600.0  # any single wait on an engine

    def __post_init__(self) -> None:
        if self.engine not in ("builtin", "sglang"):
            raise ValueError(f"rollout.engine must be 'builtin' or 'sglang', got {self.engine!r}")
        if (self.task is None) == (self.dataset is None):
            raise ValueError(
                "rollout: set exactly one of 'task' (a built-in task name) and 'dataset' (a JSONL path)"
            )
        if self.num_engines < 1:
            raise ValueError(f"rollout.num_engines must be >= 1, got {self.num_engines}")
        if self.gpus_per_engine < 0:
            raise ValueError(f"rollout.gpus_per_engine must be >= 0, got {self.gpus_per_engine}")
        if self.engine == "sglang" and self.gpus_per_engine < 1:
            raise ValueError(
                "rollout.gpus_per_engine must be >= 1 with engine 'sglang' (SGLang serves on GPUs)"
            )
        if self.device == "cuda" and self.gpus_per_engine < 1:
            raise ValueError("rollout.gpus_per_engine must be >= 1 with device 'cuda'")
        if self.engine == "builtin" and self.gpus_per_engine > 1:
            raise ValueError("the built-in engine runs on one device: set rollout.gpus_per_engine to 0 or 1")
        if self.prompts_per_step < 1:
            raise ValueError(f"rollout.prompts_per_step must be >= 1, got {self.prompts_per_step}")
        if self.eval_prompts < 0:
            raise ValueError(f"rollout.eval_prompts must be >= 0, got {self.eval_prompts}")
        if self.max_prompt_length < 2:
            raise ValueError(f"rollout.max_prompt_length must be >= 2, got {self.max_prompt_length}")
        if self.timeout_s <= 0:
            raise ValueError(f"rollout.timeout_s must be > 0, got {self.timeout_s}")
        if self.dataset is not None and not Path(self.dataset).is_file():
            raise ValueError(f"rollout.dataset: no file at {self.dataset!r}; give a JSONL file path")
