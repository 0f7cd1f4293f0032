"""Prompts as token ids: the encoding the rollout manager applies to each step's rows, and the check
of a whole JSONL dataset with it (``check_dataset``) before a run starts anything.

The check reads the file with the run's reader (``JsonlPrompts``), tokenizes every prompt with the
run's tokenizer through ``encode_rows`` (the manager's own encoding), and holds each prompt to
``rollout.max_prompt_length`` and, with the longest ``max_new_tokens`` of training and evaluation, to
the model's ``max_position_embeddings`` (the engine's limit). The first bad row stops it, named by
its line. Fast tokenizers encode in batches of ``CHUNK_ROWS``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .config import RolloutConfig
from .data import JsonlPrompts

__all__ = ["CHUNK_ROWS", "DatasetReport", "PromptError", "check_dataset", "encode_rows"]

CHUNK_ROWS = 4096


class PromptError(ValueError):
    """A row whose prompt cannot be used; ``index`` is its place in the rows given."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def encode_rows(
    tokenizer: Any, rows: Sequence[Mapping[str, Any]], prompt_field: str, max_prompt_length: int
) -> list[list[int]]:
    """Token ids of each row's prompt (with the tokenizer's special tokens), in one batch call;
    ``PromptError`` for an empty prompt or one longer than ``max_prompt_length``."""
    texts = []
    for i, row in enumerate(rows):
        text = row.get(prompt_field)
        if not isinstance(text, str) or not text.strip():
            raise PromptError(
                i,
                f"prompt {prompt_field!r} of row {dict(row)!r} is empty; every row needs a non-empty prompt",
            )
        texts.append(text)
    if not texts:
        return []
    encoded = [list(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
    for i, (text, ids) in enumerate(zip(texts, encoded, strict=True)):
        if len(ids) > max_prompt_length:
            raise PromptError(
                i,
                f"prompt {text[:60]!r} is too long: {len(ids)} tokens > rollout.max_prompt_length "
                f"{max_prompt_length}; shorten it or raise rollout.max_prompt_length",
            )
    return encoded


@dataclass(frozen=True)
class DatasetReport:
    rows: int
    longest_prompt: int  # tokens
    seconds: float  # reading and tokenizing the whole file


def check_dataset(config: RolloutConfig) -> DatasetReport:
    """Read and tokenize every row of ``config.dataset`` as the run will; ``ValueError`` naming the
    file and line of the first row the run would fail on."""
    from transformers import AutoConfig, AutoTokenizer

    if config.dataset is None:
        raise ValueError("check_dataset needs rollout.dataset (a built-in task's prompts need no check)")
    start = time.perf_counter()
    source = JsonlPrompts(config.dataset, config.prompt_field, config.seed)  # path:line on a bad line
    tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    max_positions = getattr(AutoConfig.from_pretrained(config.model_path), "max_position_embeddings", None)
    max_new = config.sampling.max_new_tokens
    if config.eval_sampling is not None:
        max_new = max(max_new, config.eval_sampling.max_new_tokens)
    longest = 0
    for first in range(0, len(source.rows), CHUNK_ROWS):
        rows = source.rows[first : first + CHUNK_ROWS]
        where = source.lines[first : first + CHUNK_ROWS]
        try:
            encoded = encode_rows(tokenizer, rows, config.prompt_field, config.max_prompt_length)
        except PromptError as exc:
            raise ValueError(f"{source.path}:{where[exc.index]}: {exc}") from None
        for line, ids in zip(where, encoded, strict=True):
            longest = max(longest, len(ids))
            if max_positions is not None and len(ids) + max_new > max_positions:
                raise ValueError(
                    f"{source.path}:{line}: the prompt is {len(ids)} tokens; with max_new_tokens {max_new} "
                    f"that is more than the model's max_position_embeddings {max_positions}; shorten the "
                    "prompt or lower rollout.sampling.max_new_tokens"
                )
    return DatasetReport(len(source.rows), longest, time.perf_counter() - start)
