"""Synthetic tasks with verifiable rewards, and the tiny random model that learns them.

Each task makes prompt rows from an index and a seed (so a data position is one integer and resumes
exactly), and held-out evaluation rows from a stream of their own. The digit tasks
(``{"prompt": "1234>", "label": "4321"}``, partial credit per character) are made for the built-in
tokenizer and the tiny model; the arithmetic tasks (``{"prompt": "What is 23 + 45 - 12? ...",
"label": "56"}``, reward ``math_answer``) for a real instruct model with its chat template.
``reasoning_gym:<name>`` names one of reasoning-gym's generators instead (``reasoning_gym_task``).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .reasoning_gym_task import ReasoningGymTask, is_reasoning_gym

__all__ = ["TASKS", "ArithmeticTask", "GuessTask", "PromptTask", "Task", "get_task", "make_tiny_model"]


class PromptTask(Protocol):
    """A built-in task: rows made on the fly, training and held-out evaluation streams apart."""

    @property
    def name(self) -> str: ...
    @property
    def reward(self) -> str: ...
    @property
    def needs_real_tokenizer(self) -> bool:
        """True when the built-in character tokenizer cannot spell its prompts (use model.path)."""
        ...

    @property
    def environment(self) -> str | None:
        """The multi-turn environment the task is played in (``rollout.environment``), if any."""
        ...

    def row(self, index: int, seed: int | str) -> dict[str, Any]: ...
    def eval_row(self, index: int, seed: int | str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Task:
    name: str
    transform: Callable[[str], str]
    min_digits: int
    max_digits: int
    digits: str = "0123456789"
    reward: str = "char_match"
    separator: str = ">"
    needs_real_tokenizer: bool = False
    environment: str | None = None

    def row(self, index: int, seed: int | str) -> dict[str, Any]:
        """Row ``index`` of the stream for ``seed``: the same pair always gives the same row."""
        rng = random.Random(f"{self.name}/{seed}/{index}")
        n = rng.randint(self.min_digits, self.max_digits)
        digits = "".join(rng.choice(self.digits) for _ in range(n))
        return {"prompt": digits + self.separator, "label": self.transform(digits), "index": index}

    def eval_row(self, index: int, seed: int | str) -> dict[str, Any]:
        """Held-out row ``index``: a stream of its own seed, fixed whatever the training position."""
        return self.row(index, f"eval/{seed}")

    @property
    def max_response_chars(self) -> int:
        return self.max_digits


# One in HELD_OUT_EVERY arithmetic questions (by a hash of its text) is held out: the training stream
# never asks it, the evaluation stream asks nothing else.
HELD_OUT_EVERY = 10


def _held_out(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] % HELD_OUT_EVERY == 0


@dataclass(frozen=True)
class ArithmeticTask:
    """Integer arithmetic with ``terms`` operands in ``[low, high]`` and operators from ``ops``
    (``*`` binds first): ``difficulty`` picks the level (the tables below), the answer may be negative.

    The row's ``label`` is the exact value; ``math_answer`` compares the response's final number with
    it. Held-out questions (one in ``HELD_OUT_EVERY``, by their text) never appear in training.
    """

    name: str
    terms: tuple[int, int]
    low: int
    high: int
    ops: str
    reward: str = "math_answer"
    instruction: str = "Answer with the number only."
    needs_real_tokenizer: bool = True
    environment: str | None = None

    def _question(self, rng: random.Random) -> tuple[str, int]:
        n = rng.randint(*self.terms)
        numbers = [rng.randint(self.low, self.high) for _ in range(n)]
        ops = [rng.choice(self.ops) for _ in range(n - 1)]
        text = " ".join([str(numbers[0]), *(f"{op} {x}" for op, x in zip(ops, numbers[1:], strict=True))])
        # Python's own precedence and integer arithmetic: the label is exact.
        value = eval(text, {"__builtins__": {}})
        return text, int(value)

    def _draw(self, stream: str, index: int, held_out: bool) -> dict[str, Any]:
        # Rejection: about HELD_OUT_EVERY draws for a held-out row, one or two for a training row.
        for attempt in range(10_000):
            text, value = self._question(random.Random(f"{self.name}/{stream}/{index}/{attempt}"))
            if _held_out(text) == held_out:
                prompt = f"What is {text}? {self.instruction}".strip()
                return {"prompt": prompt, "label": str(value), "index": index}
        raise RuntimeError(f"task {self.name}: no {'held-out' if held_out else 'training'} question found")

    def row(self, index: int, seed: int | str) -> dict[str, Any]:
        return self._draw(str(seed), index, held_out=False)

    def eval_row(self, index: int, seed: int | str) -> dict[str, Any]:
        return self._draw(f"eval/{seed}", index, held_out=True)


@dataclass(frozen=True)
class GuessTask:
    """Guess the row's digit in a few turns: after each wrong guess the environment answers ``+`` (the
    number is higher) or ``-`` (lower); a reward every turn (``guess_number``). The prompt is ``?>``."""

    name: str
    reward: str = "none"
    needs_real_tokenizer: bool = False
    environment: str | None = "guess_number"

    def row(self, index: int, seed: int | str) -> dict[str, Any]:
        rng = random.Random(f"{self.name}/{seed}/{index}")
        return {"prompt": "?>", "label": str(rng.randint(0, 9)), "index": index}

    def eval_row(self, index: int, seed: int | str) -> dict[str, Any]:
        return self.row(index, f"eval/{seed}")


def _identity(s: str) -> str:
    return s


def _reverse(s: str) -> str:
    return s[::-1]


TASKS: Mapping[str, PromptTask] = {
    t.name: t
    for t in (
        # The easiest: copy 2-3 digits from {0,1,2,3}; a tiny model learns it with PPO on CPU in minutes.
        Task("copy_small", _identity, 2, 3, digits="0123"),
        Task("copy", _identity, 3, 4),
        Task("reverse", _reverse, 3, 4),
        # The difficulty knob: arithmetic_<level>, from one-step sums of small numbers to three-term
        # expressions with products.
        ArithmeticTask("arithmetic_1", (2, 2), 0, 20, "+-"),
        ArithmeticTask("arithmetic_2", (2, 2), 10, 99, "+-"),
        ArithmeticTask("arithmetic_3", (3, 3), 1, 50, "+-"),
        ArithmeticTask("arithmetic_4", (3, 3), 2, 20, "+-*"),
        # Beyond a 135M model's mental arithmetic: four or five terms of two and three digits, without
        # a tool (arithmetic_5) and with the calculator (<calc>expression</calc> answered by
        # <result>value</result>).
        ArithmeticTask("arithmetic_5", (4, 5), 10, 999, "+-"),
        ArithmeticTask(
            "tool_arithmetic",
            (4, 5),
            10,
            999,
            "+-",
            instruction="Use the calculator, then give the final answer as a number.",
            environment="calculator",
        ),
        # Guess a digit from "+" (higher) and "-" (lower) replies: multi-turn for the tiny model.
        GuessTask("guess_digit"),
    )
}


def get_task(name: str, args: Mapping[str, Any] | None = None) -> PromptTask:
    """A built-in task by name, or ``reasoning_gym:<name>`` built with ``args`` (``rollout.task_args``;
    ``reasoning_gym_task``, which imports reasoning-gym only when rows are asked for)."""
    if is_reasoning_gym(name):
        return ReasoningGymTask(name, args)
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(
            f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}, or reasoning_gym:<name>"
        ) from None


def tiny_model_config(
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_positions: int = 64,
) -> Any:
    """The ``LlamaConfig`` of :func:`make_tiny_model`'s model: the character tokenizer's vocabulary and
    special ids, untied embeddings. Builds no weights (and imports no torch)."""
    from transformers import LlamaConfig

    from .tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be a multiple of num_heads ({num_heads})")
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    return LlamaConfig(
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
    from transformers import LlamaForCausalLM

    from .tokenizer import DEFAULT_ALPHABET, build_char_tokenizer

    if get_task(task).needs_real_tokenizer:  # also validates the name
        raise ValueError(
            f"task {task!r} needs a real model's tokenizer (its prompts are English); the tiny model's "
            "character tokenizer spells only the digit tasks: set model.path to an imported model"
        )
    folder = Path(folder)
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET)
    config = tiny_model_config(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_positions=max_positions,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
