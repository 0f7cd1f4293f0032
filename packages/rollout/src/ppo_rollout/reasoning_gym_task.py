"""Tasks from reasoning-gym's procedural generators: ``rollout.task: reasoning_gym:<name>``.

``<name>`` is one of reasoning-gym's registered generators (``gsm_symbolic``, ``countdown``,
``puzzle24``, ...), built with ``rollout.task_args`` as the fields of its config dataclass; the
optional extra ``ppo-rollout[reasoning-gym]`` installs the package. A row holds the generator's
question followed by ``ANSWER_INSTRUCTION``, its answer as ``label``, and the generator's whole entry,
which the ``reasoning_gym`` reward hands to the generator's own scorer (``dataset.score_answer``) with
the answer read from the response as reasoning-gym reads it: the text of the last
``<answer>...</answer>``, else (GSM8K's convention, which gsm_symbolic's worked solutions follow) the
text after the last ``####``.

Rows are a function of (index, seed), as the built-in tasks' rows: row ``i`` comes from a generator
instance of ``CHUNK`` items whose seed is derived from the run's seed, the stream and ``i // CHUNK``.
Held out, never trained on:

- the evaluation stream has seeds of its own (``eval/<seed>``), and
- a generator that draws each item from one of several templates (gsm_symbolic's 85 and
  list_functions': their datasets' ``task_indices``) keeps the templates whose number is a multiple of
  ``HELD_OUT_TEMPLATE_EVERY`` for evaluation and trains on the others; any other generator holds out
  one question in ``HELD_OUT_EVERY`` by a hash of its text, as the arithmetic tasks do.

An item of the wrong side is drawn again from the next instance of its chunk: a training row costs
about 1.1 draws (1.25 with templates), an evaluation row about ``HELD_OUT_EVERY`` (5 with templates),
kept after the first evaluation.

This module imports reasoning-gym only when a task's rows or scores are asked for, or its settings
checked; nothing of ``ppo_rollout`` either, so ``tasks`` and ``rewards`` may import it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ANSWER_INSTRUCTION",
    "HELD_OUT_EVERY",
    "HELD_OUT_TEMPLATE_EVERY",
    "INSTALL",
    "PREFIX",
    "ReasoningGymTask",
    "check_task",
    "extract_answer",
    "generator_names",
    "is_reasoning_gym",
    "score_row",
]

PREFIX = "reasoning_gym:"
INSTALL = 'pip install "ppo-rollout[reasoning-gym]"'
REWARD = "reasoning_gym"
ANSWER_INSTRUCTION = "Give your final answer between <answer> and </answer> tags."
# Items per generator instance: a generator that prepares something per item at construction
# (gsm_symbolic draws every item's template) is built for this many at a time.
CHUNK = 1000
HELD_OUT_EVERY = 10
HELD_OUT_TEMPLATE_EVERY = 5
MAX_DRAWS = 1000
# Config fields the task sets itself: each instance's seed and size.
_OWN_FIELDS = ("seed", "size")
_CACHED_DATASETS = 16


def is_reasoning_gym(task: str | None) -> bool:
    return task is not None and task.startswith(PREFIX)


def _registry(task: str) -> dict[str, tuple[type, type]]:
    """reasoning-gym's generators by name (``reasoning_gym.factory.DATASETS``)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ValueError(
            f"rollout.task={task!r} needs the reasoning-gym package, which is not installed: {INSTALL}"
        ) from None
    return DATASETS


def generator_names(task: str = PREFIX) -> list[str]:
    """The generators ``reasoning_gym:<name>`` may name (``ValueError`` without the package)."""
    return sorted(_registry(task))


def _generator(task: str) -> tuple[type, type]:
    """The dataset class and config class of ``reasoning_gym:<name>``; ``ValueError`` naming
    ``rollout.task`` for an unknown name, with the valid ones."""
    name = task.removeprefix(PREFIX)
    registry = _registry(task)
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(
            f"rollout.task={task!r}: reasoning-gym has no generator {name!r}{hint}; use "
            f"reasoning_gym:<name> with one of: {', '.join(sorted(registry))}"
        )
    return registry[name]


def _config(task: str, args: Mapping[str, Any], seed: int, size: int) -> tuple[type, Any]:
    """The dataset class and its config built from ``args``; ``ValueError`` naming the
    ``rollout.task_args`` field it refuses."""
    dataset_cls, config_cls = _generator(task)
    name = task.removeprefix(PREFIX)
    fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in _OWN_FIELDS]
    for key in args:
        if key in _OWN_FIELDS:
            raise ValueError(
                f"rollout.task_args.{key}: set by the run for each generator instance (from its seed); "
                "remove it"
            )
        if key not in fields:
            raise ValueError(
                f"rollout.task_args.{key}: not a setting of reasoning-gym's {name}; its settings: "
                f"{', '.join(fields) or 'none'}"
            )
    try:
        config = config_cls(**args, seed=seed, size=size)
        if callable(getattr(config, "validate", None)):
            config.validate()
    except (AssertionError, TypeError, ValueError) as exc:
        raise ValueError(f"rollout.task_args: reasoning-gym's {name} refuses {dict(args)}: {exc}") from None
    return dataset_cls, config


def check_task(task: str, args: Mapping[str, Any]) -> None:
    """``ValueError`` (one line, naming ``rollout.task`` or ``rollout.task_args``) when the package
    is missing, the generator unknown or its settings refused."""
    if not task.removeprefix(PREFIX):
        raise ValueError(f"rollout.task={task!r}: name a generator, e.g. reasoning_gym:gsm_symbolic")
    _config(task, args, 0, 1)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big")


def _hash_held_out(question: str) -> bool:
    return hashlib.sha256(question.encode()).digest()[0] % HELD_OUT_EVERY == 0


class ReasoningGymTask:
    """``reasoning_gym:<name>`` with its generator settings: rows made on the fly (``PromptTask``)."""

    reward = REWARD
    needs_real_tokenizer = True
    environment: str | None = None

    def __init__(self, name: str, args: Mapping[str, Any] | None = None) -> None:
        if not is_reasoning_gym(name):
            raise ValueError(f"{name!r} is not a reasoning-gym task (reasoning_gym:<name>)")
        self.name = name
        self.args = dict(args or {})
        self._datasets: OrderedDict[tuple[str, int, int], Any] = OrderedDict()
        self._eval_rows: dict[tuple[str, int], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def _dataset(self, stream: str, chunk: int, draw: int) -> Any:
        key = (stream, chunk, draw)
        with self._lock:
            if key in self._datasets:
                self._datasets.move_to_end(key)
                return self._datasets[key]
            dataset_cls, config = _config(self.name, self.args, _seed(self.name, *key), CHUNK)
            dataset = dataset_cls(config=config)
            self._datasets[key] = dataset
            if len(self._datasets) > _CACHED_DATASETS:
                self._datasets.popitem(last=False)
            return dataset

    @staticmethod
    def held_out(dataset: Any, position: int, entry: Mapping[str, Any]) -> bool:
        """Whether the item at ``position`` of ``dataset`` belongs to evaluation: by its template
        where the generator has templates, else by its question."""
        templates = getattr(dataset, "task_indices", None)
        if isinstance(templates, list) and len(templates) > position:
            return int(templates[position]) % HELD_OUT_TEMPLATE_EVERY == 0
        return _hash_held_out(str(entry["question"]))

    @staticmethod
    def template(dataset: Any, position: int) -> int | None:
        """The template an item was drawn from, for generators that have templates."""
        templates = getattr(dataset, "task_indices", None)
        return int(templates[position]) if isinstance(templates, list) else None

    def _draw(self, stream: str, index: int, held_out: bool) -> dict[str, Any]:
        position = index % CHUNK
        for draw in range(MAX_DRAWS):
            dataset = self._dataset(stream, index // CHUNK, draw)
            entry = dataset[position]
            if self.held_out(dataset, position, entry) == held_out:
                return {
                    "prompt": f"{str(entry['question']).rstrip()}\n\n{ANSWER_INSTRUCTION}",
                    "label": str(entry["answer"]),
                    "index": index,
                    "task": self.name,
                    "task_args": dict(self.args),
                    "template": self.template(dataset, position),
                    "entry": entry,
                }
        side = "held-out" if held_out else "training"
        raise RuntimeError(
            f"rollout.task={self.name!r}: no {side} question in {MAX_DRAWS} draws for row {index}; "
            "widen rollout.task_args"
        )

    def row(self, index: int, seed: int | str) -> dict[str, Any]:
        """Training row ``index`` for ``seed``: never a held-out question or template."""
        return self._draw(f"train/{seed}", index, held_out=False)

    def eval_row(self, index: int, seed: int | str) -> dict[str, Any]:
        """Held-out row ``index``: a stream of its own seeds, held-out questions or templates only."""
        key = (str(seed), index)
        if key not in self._eval_rows:
            self._eval_rows[key] = self._draw(f"eval/{seed}", index, held_out=True)
        return dict(self._eval_rows[key])


# -- the reward ------------------------------------------------------------------------------------

_HASHES = re.compile(r"####[ \t]*([^\n]*)")


def extract_answer(response: str) -> str | None:
    """The answer reasoning-gym's scorers take: the last ``<answer>...</answer>``'s text
    (``reasoning_gym.utils.extract_answer``), else the text after the last ``####`` on its line;
    None when the response marks no answer."""
    from reasoning_gym.utils import extract_answer as tagged

    found = tagged(response)
    if found is not None:
        return str(found)
    hashes = _HASHES.findall(response)
    return str(hashes[-1]).strip() if hashes else None


_scorers: dict[tuple[str, str], Any] = {}
_scorers_lock = threading.Lock()


def _scorer(task: str, args: Mapping[str, Any]) -> Any:
    """The generator built with the run's settings, whose ``score_answer`` scores (cached)."""
    key = (task, repr(sorted(args.items())))
    with _scorers_lock:
        if key not in _scorers:
            dataset_cls, config = _config(task, args, 0, 1)
            _scorers[key] = dataset_cls(config=config)
        return _scorers[key]


def score_row(response: str, row: Mapping[str, Any]) -> float:
    """The generator's own score of ``response`` for a ``reasoning_gym:<name>`` row."""
    task, entry, args = row.get("task"), row.get("entry"), row.get("task_args") or {}
    if not isinstance(task, str) or not is_reasoning_gym(task) or not isinstance(entry, Mapping):
        raise ValueError(
            "the reasoning_gym reward scores rows of rollout.task: reasoning_gym:<name> (with their "
            f"'task' and 'entry' fields); this row has {sorted(row)}: set rollout.reward to another reward"
        )
    return float(_scorer(task, args).score_answer(extract_answer(response), dict(entry)))
