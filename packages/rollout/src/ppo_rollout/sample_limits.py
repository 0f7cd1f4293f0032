"""What the model can train on, checked on a step's trajectories before they are packed for training.

A rollout function (or an environment's observation) can hand back token ids the model's embedding
does not have, or a trajectory longer than its positions: the first fails deep inside the critic's or
the actor's forward as an ``IndexError``, the second trains silently on positions the model never
learned (a 5,000-token turn for a 64-position model). ``check_samples`` refuses both with one line
naming the sample (its prompt, its place in the group, the rollout function) and the limit.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .trajectory import Trajectory

__all__ = ["ModelLimits", "SampleRefused", "check_samples", "model_limits"]


class SampleRefused(ValueError):
    """A trajectory the model cannot train on (token ids outside its vocabulary, or too long)."""


@dataclass(frozen=True)
class ModelLimits:
    """``vocab_size``: the embedding's rows (ids must be below it); ``max_positions``: the model's
    ``max_position_embeddings`` (prompt and response together must fit). None: not known, not checked."""

    vocab_size: int | None
    max_positions: int | None


def _int(config: dict[str, Any], key: str) -> int | None:
    value = config.get(key)
    if value is None and isinstance(config.get("text_config"), dict):  # a multimodal model's LM part
        value = config["text_config"].get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@functools.lru_cache(maxsize=8)
def model_limits(model_path: str) -> ModelLimits:
    """The limits in the model folder's ``config.json`` (a hub id's from the local Hugging Face cache,
    never over the network); unknown limits are None."""
    local = Path(model_path).expanduser() / "config.json"
    if not local.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(model_path, "config.json")
        except ValueError:  # not a hub id either (HFValidationError)
            cached = None
        if not isinstance(cached, str):
            return ModelLimits(None, None)
        local = Path(cached)
    try:
        config = json.loads(local.read_text())
    except (OSError, ValueError):
        return ModelLimits(None, None)
    if not isinstance(config, dict):
        return ModelLimits(None, None)
    return ModelLimits(_int(config, "vocab_size"), _int(config, "max_position_embeddings"))


def check_samples(trajectories: Sequence[Trajectory], limits: ModelLimits, fn_name: str) -> None:
    """Raise ``SampleRefused`` for the first trajectory with a token id outside ``[0, vocab_size)`` or
    more tokens than ``max_positions``; it names the sample, the offending id or length, and the limit."""
    position: dict[int, int] = {}
    for t in trajectories:
        k = position[t.prompt_index] = position.get(t.prompt_index, -1) + 1
        sample = f"sample {k} of prompt {t.prompt_index} (rollout function {fn_name})"
        if limits.vocab_size is not None:
            for part, ids in (("prompt", t.prompt_tokens), ("response", t.response_tokens)):
                if not ids or (min(ids) >= 0 and max(ids) < limits.vocab_size):
                    continue
                bad = next(i for i, tok in enumerate(ids) if not 0 <= tok < limits.vocab_size)
                raise SampleRefused(
                    f"{sample}: token id {ids[bad]} at {part} position {bad} is outside the model's "
                    f"vocabulary (0..{limits.vocab_size - 1}, vocab_size in its config.json); return "
                    "ids from the run's tokenizer (ctx.tokenizer)"
                )
        if limits.max_positions is not None and t.num_tokens > limits.max_positions:
            raise SampleRefused(
                f"{sample}: {t.num_tokens} tokens ({len(t.prompt_tokens)} prompt + "
                f"{t.num_tokens - len(t.prompt_tokens)} response) is more than the model's "
                f"max_position_embeddings {limits.max_positions}; bound the trajectory "
                "(rollout.multi_turn.max_response_tokens, max_observation_tokens, or the rollout "
                "function's own limits)"
            )
