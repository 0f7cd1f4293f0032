"""A run's rollout function and what its context is given, built once from the config: the function
by name (``rollout.rollout_function``), and for multi-turn ones the environment and the observation
renderer; the thread pool plain ``def`` environments run on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from .config import RolloutConfig
from .environment import DaemonThreadPool, resolve_environment
from .observation import ObservationRenderer
from .rollout_fns import ContextEnvironment, ContextTools, RolloutFn, resolve_rollout_function

__all__ = ["RolloutParts", "eos_token_ids", "rollout_parts"]


@dataclass(frozen=True)
class RolloutParts:
    """The rollout function (``fn``, registered or imported as ``fn_name``) and its context's tools."""

    fn: RolloutFn
    fn_name: str
    tools: ContextTools

    @property
    def multi_turn(self) -> bool:
        return self.fn_name != "single_turn"

    def close(self) -> None:
        """Stop the environments' thread pool (calls still waiting are dropped)."""
        pool = self.tools.environment.pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def eos_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The ids a turn ends on: the generation config's eos ids (what the engines stop on), else the
    tokenizer's."""
    from transformers import GenerationConfig

    ids: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [int(tokenizer.eos_token_id)]
    return ids


def rollout_parts(config: RolloutConfig, tokenizer: Any) -> RolloutParts:
    """The rollout function, and for multi-turn ones the environment and the observation renderer."""
    env_spec = config.resolved_environment
    fn_name = config.resolved_rollout_function
    fn = resolve_rollout_function(fn_name)
    environment = resolve_environment(env_spec) if env_spec else None
    limits = config.multi_turn
    observations = (
        ObservationRenderer(
            tokenizer,
            chat_template=config.chat_template,
            role=limits.observation_role,
            max_tokens=limits.max_observation_tokens,
            marker=limits.truncation_marker,
            eos_token_ids=eos_token_ids(config.model_path, tokenizer),
        )
        if fn_name != "single_turn"
        else None
    )
    # Environments written as plain functions run here, so that one waiting never stalls the others
    # (daemon threads: a call that never returns cannot keep the process from exiting).
    pool = DaemonThreadPool("environment")
    seat = ContextEnvironment(environment, env_spec or "", dict(config.environment_args or {}), pool)
    return RolloutParts(fn, fn_name, ContextTools(tokenizer, limits, observations, seat))
