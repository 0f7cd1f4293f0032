"""Prompt sources: a built-in task stream or a JSONL file, with a resumable position."""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from .tasks import get_task

__all__ = ["JsonlPrompts", "PromptSource", "TaskPrompts"]


class PromptSource(Protocol):
    """Hands out rows (dicts with at least the prompt field) in a fixed, resumable order."""

    prompt_field: str

    def next_rows(self, count: int) -> list[dict[str, Any]]: ...
    def eval_rows(self, count: int) -> list[dict[str, Any]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class TaskPrompts:
    """Row ``i`` of a built-in task for ``seed``; evaluation rows come from a disjoint stream."""

    prompt_field = "prompt"

    def __init__(self, task: str, seed: int) -> None:
        self.task = get_task(task)
        self.seed = seed
        self.position = 0

    def next_rows(self, count: int) -> list[dict[str, Any]]:
        rows = [self.task.row(self.position + i, self.seed) for i in range(count)]
        self.position += count
        return rows

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        # A different seed string: evaluation prompts are fixed and independent of training progress.
        return [self.task.row(i, f"eval/{self.seed}") for i in range(count)]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "task", "task": self.task.name, "seed": self.seed, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "task" or state.get("task") != self.task.name:
            raise ValueError(f"data state {dict(state)!r} is not from task {self.task.name!r}")
        self.position = int(state["position"])


class JsonlPrompts:
    """Rows of a JSONL file, reshuffled each epoch with ``Random(f"{seed}/{epoch}")``.

    Evaluation rows are the file's first rows, in file order.
    """

    def __init__(self, path: str | Path, prompt_field: str, seed: int) -> None:
        self.path = Path(path)
        self.prompt_field = prompt_field
        self.seed = seed
        self.rows: list[dict[str, Any]] = []
        self.lines: list[int] = []  # the file's line number of each row, for error messages
        with self.path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(
                        f"{self.path}:{lineno}: not JSON ({exc.msg}); one JSON object per line"
                    ) from None
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{self.path}:{lineno}: a {type(row).__name__}, not a JSON object; "
                        "one JSON object per line"
                    )
                prompt = row.get(prompt_field)
                if not isinstance(prompt, str):
                    raise ValueError(
                        f"{self.path}:{lineno}: field {prompt_field!r} must be a string "
                        "(set rollout.prompt_field to the "
                        f"field that holds the prompt); row keys: {sorted(row)}"
                    )
                self.rows.append(row)
                self.lines.append(lineno)
        if not self.rows:
            raise ValueError(f"{self.path} is empty; give a JSONL file with one prompt object per line")
        self.epoch = 0
        self.offset = 0
        self._order = self._make_order(0)

    def _make_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next_rows(self, count: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(count):
            if self.offset == len(self._order):
                self.epoch += 1
                self.offset = 0
                self._order = self._make_order(self.epoch)
            out.append(dict(self.rows[self._order[self.offset]]))
            self.offset += 1
        return out

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows[:count]]

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "jsonl", "path": str(self.path), "epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "jsonl":
            raise ValueError(f"data state {dict(state)!r} is not from a JSONL dataset")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = self._make_order(self.epoch)
