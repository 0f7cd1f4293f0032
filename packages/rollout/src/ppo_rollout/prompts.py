"""Prompts as token ids: the encoding the rollout manager applies to each step's rows, and the check
of a whole JSONL dataset with it (``check_dataset``) before a run starts anything.

The check reads the training file (and the evaluation file) with the run's reader (``JsonlPrompts``),
renders and tokenizes every prompt with the run's tokenizer and chat template through
``encode_texts`` (the manager's own encoding), and holds each prompt to ``rollout.max_prompt_length``
and, with the longest ``max_new_tokens`` of training and evaluation, to the model's
``max_position_embeddings`` (the engine's limit). The first bad row stops it, named by its line.
Fast tokenizers encode in batches of ``CHUNK_ROWS``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import RolloutConfig
from .data import JsonlPrompts, PromptRenderer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CHUNK_ROWS", "DatasetReport", "PromptError", "check_dataset", "encode_texts"]

CHUNK_ROWS = 4096


class PromptError(ValueError):
    """A row whose prompt cannot be used; ``index`` is its place in the rows given."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(message)
        self.index = index


def encode_texts(renderer: PromptRenderer, texts: Sequence[str], max_prompt_length: int) -> list[list[int]]:
    """Token ids of rendered prompts (``PromptRenderer.render``), in one batch call; ``PromptError``
    for one longer than ``max_prompt_length``."""
    encoded = renderer.encode_many(texts)
    for i, (text, ids) in enumerate(zip(texts, encoded, strict=True)):
        if len(ids) > max_prompt_length:
            raise PromptError(
                i,
                f"prompt {text[:60]!r} is too long: {len(ids)} tokens > rollout.max_prompt_length "
                f"{max_prompt_length}; shorten it or raise rollout.max_prompt_length",
            )
    return encoded


def _render_all(renderer: PromptRenderer, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    texts = []
    for i, row in enumerate(rows):
        try:
            texts.append(renderer.render(row))
        except ValueError as exc:
            raise PromptError(i, str(exc)) from None
    return texts


@dataclass(frozen=True)
class DatasetReport:
    rows: int
    longest_prompt: int  # tokens
    seconds: float  # reading and tokenizing the whole file


def check_dataset(config: RolloutConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> DatasetReport:
    """Read and tokenize every row of ``config.dataset`` (and ``config.eval_dataset``) as the run will;
    ``ValueError`` naming the file and line of the first row the run would fail on. ``tokenizer``: the
    model's, when the caller has loaded it already (else loaded here)."""
    if config.dataset is None:
        raise ValueError("check_dataset needs rollout.dataset (a built-in task's prompts need no check)")
    start = time.perf_counter()
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.model_path)
    renderer = PromptRenderer(
        tokenizer, config.prompt_field, chat_template=config.chat_template, system_prompt=config.system_prompt
    )
    max_positions = _max_positions(config.model_path)
    max_new = config.longest_response  # multi-turn: every turn and observation together
    rows, longest = 0, 0
    for path in (config.dataset, config.eval_dataset):
        if path is None:
            continue
        # path:line on a bad line
        source = JsonlPrompts(path, config.prompt_field, config.seed, messages_ok=config.chat_template)
        rows += len(source.rows)
        longest = max(
            longest, _check_rows(source, renderer, config.max_prompt_length, max_positions, max_new)
        )
    return DatasetReport(rows, longest, time.perf_counter() - start)


def _max_positions(model_path: str) -> int | None:
    """The model's ``max_position_embeddings``: read from a local folder's ``config.json`` where it
    holds it (a model's configuration class need not be imported for one number), else as
    ``AutoConfig`` gives it (a hub id, or the class's default)."""
    local = Path(model_path).expanduser() / "config.json"
    if local.is_file():
        try:
            value = json.loads(local.read_text()).get("max_position_embeddings")
        except (ValueError, AttributeError):
            value = None
        if isinstance(value, int):
            return value
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)


def _check_rows(
    source: JsonlPrompts,
    renderer: PromptRenderer,
    max_prompt_length: int,
    max_positions: int | None,
    max_new: int,
) -> int:
    """The longest prompt of ``source`` in tokens; ``ValueError`` at the first row the run would fail on."""
    longest = 0
    for first in range(0, len(source.rows), CHUNK_ROWS):
        rows = source.rows[first : first + CHUNK_ROWS]
        where = source.lines[first : first + CHUNK_ROWS]
        try:
            encoded = encode_texts(renderer, _render_all(renderer, rows), max_prompt_length)
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
    return longest
