"""Synthetic tasks with verifiable rewards, and the tiny random model that learns them.

Each task makes prompt rows ``{"prompt": "1234>", "label": "4321"}`` from an index and a seed (so
a data position is one integer and resumes exactly). Rewards give partial credit per character.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TASKS", "Task", "get_task", "make_tiny_model"]


@dataclass(frozen=True)
class Task:
    name: str
    transform: Callable[[str], str]
    min_digits: int
    max_digits: int
    digits: str = "0123456789"
    reward: str = "char_match"
    separator: str = ">"

    def row(self, index: int, seed: int | str) -> dict[str, Any]:
        """Row ``index`` of the stream for ``seed``: the same pair always gives the same row."""
        rng = random.Random(f"{self.name}/{seed}/{index}")
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice(self.digits) for _ in range(n))
        return {"prompt": digits + self.separator, "label": self.transform(digits), "index": index}

    @property
    def max_response_chars(self) -> int:
        return self.max_digits


def _identity(s: str) -> str:
    return s


def _reverse(s: str) -> str:
    return s[::-1]


TASKS: Mapping[str, Task] = {
    t.name: t
    for t in (
        # The easiest: copy 2-3 digits from {0,1,2,3}; a tiny model learns it with PPO on CPU in minutes.
        Task("copy_small", _identity, 2, 3, digits="0123"),
        Task("copy", _identity, 3, 4),
        Task("reverse", _reverse, 3, 4),
    )
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}") from None


def make_tiny_model(
    task: str,
    folder: Path | str,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_positions: int = 64,
) -> Path:
    """Write a randomly initialised Llama-style causal LM and the char tokenizer for ``task`` to ``folder``.

    ``AutoModelForCausalLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)`` load it.
    Defaults give about 0.1M parameters. Returns the folder.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    get_task(task)  # validate the name: every built-in task shares the tokenizer
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    folder = Path(folder)
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Untied: every parameter has its own name, which keeps weight sync and checksums simple.
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
