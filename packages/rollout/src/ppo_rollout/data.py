"""Prompt sources (a built-in task stream or a JSONL file, with a resumable position), the held-out
evaluation file, and how a row becomes the prompt's token ids (plain, or through the chat template)."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .tasks import get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from .config import RolloutSettings

__all__ = [
    "DatasetChangedError",
    "HeldOutEval",
    "JsonlPrompts",
    "PromptRenderer",
    "PromptSource",
    "TaskPrompts",
    "dataset_change",
    "describe_eval_source",
    "open_prompts",
]


class PromptSource(Protocol):
    """Hands out rows (dicts with at least the prompt field) in a fixed, resumable order."""

    prompt_field: str

    def next_rows(self, count: int) -> list[dict[str, Any]]: ...
    def eval_rows(self, count: int) -> list[dict[str, Any]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class TaskPrompts:
    """Row ``i`` of a built-in task for ``seed``; evaluation rows come from a disjoint stream.
    ``args``: a ``reasoning_gym:<name>`` task's settings (``rollout.task_args``), part of the saved
    position (other settings draw other rows)."""

    prompt_field = "prompt"

    def __init__(self, task: str, seed: int, args: Mapping[str, Any] | None = None) -> None:
        self.task = get_task(task, args)
        self.args = dict(args or {})
        self.seed = seed
        self.position = 0

    def next_rows(self, count: int) -> list[dict[str, Any]]:
        rows = [self.task.row(self.position + i, self.seed) for i in range(count)]
        self.position += count
        return rows

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        # The task's held-out stream: fixed, independent of training progress.
        return [self.task.eval_row(i, self.seed) for i in range(count)]

    def state_dict(self) -> dict[str, Any]:
        state = {"kind": "task", "task": self.task.name, "seed": self.seed, "position": self.position}
        return state | ({"task_args": dict(self.args)} if self.args else {})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != "task" or state.get("task") != self.task.name:
            raise ValueError(f"data state {dict(state)!r} is not from task {self.task.name!r}")
        saved = dict(state.get("task_args") or {})
        if saved != self.args:
            raise ValueError(
                f"data state of task {self.task.name!r} was saved with rollout.task_args={saved}, which "
                f"drew other rows than rollout.task_args={self.args}; set them back, or start a new run"
            )
        self.position = int(state["position"])


class JsonlPrompts:
    """Rows of a JSONL file, reshuffled each epoch with ``Random(f"{seed}/{epoch}")``.

    Evaluation rows are the file's first rows, in file order (``HeldOutEval`` takes them from a file
    of their own). With ``messages_ok`` the prompt field may hold a chat, a list of
    ``{"role": ..., "content": ...}`` objects, for the chat template.
    """

    def __init__(self, path: str | Path, prompt_field: str, seed: int, *, messages_ok: bool = False) -> None:
        self.path = Path(path)
        self.prompt_field = prompt_field
        self.seed = seed
        self.rows: list[dict[str, Any]] = []
        self.lines: list[int] = []  # the file's line number of each row, for error messages
        data = self.path.read_bytes()
        # The saved position names rows of this very file: a resume compares both (``load_state_dict``).
        self.sha256 = hashlib.sha256(data).hexdigest()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        for lineno, line in enumerate(text.split("\n"), start=1):  # as a file reads: on \n alone
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
            if isinstance(prompt, list) and messages_ok:
                _check_messages(prompt, f"{self.path}:{lineno}: field {prompt_field!r}")
            elif not isinstance(prompt, str):
                chat = " or a list of chat messages" if messages_ok else ""
                hint = "" if messages_ok else " (a list of messages needs rollout.chat_template=true)"
                raise ValueError(
                    f"{self.path}:{lineno}: field {prompt_field!r} must be a string{chat} "
                    f"(set rollout.prompt_field to the field that holds the prompt{hint}); "
                    f"row keys: {sorted(row)}"
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
        """The position, and the row count and content hash of the file it is a position in."""
        return {
            "kind": "jsonl",
            "path": str(self.path),
            "epoch": self.epoch,
            "offset": self.offset,
            "rows": len(self.rows),
            "sha256": self.sha256,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take up a saved position. The file must be the one it was saved with (same rows, same
        hash), else ``DatasetChangedError``; unless the state carries ``on_change: "next_epoch"``
        (``checkpoint.accept_changes=[dataset]``): then the changed file starts a new epoch."""
        if state.get("kind") != "jsonl":
            raise ValueError(f"data state {dict(state)!r} is not from a JSONL dataset")
        problem = dataset_change(state, len(self.rows), self.sha256)
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if problem is not None:
            if state.get("on_change") != NEXT_EPOCH:
                raise DatasetChangedError(f"rollout.dataset {self.path}: {problem}; {CHANGED_FIX}")
            epoch, offset = epoch + 1, 0
        self.epoch, self.offset = epoch, offset
        self._order = self._make_order(self.epoch)


# A data state's marker, set by the driver when the user accepts a changed file.
NEXT_EPOCH = "next_epoch"
CHANGED_FIX = (
    "restore the file it was saved with, or set checkpoint.accept_changes=[dataset] to go on with this "
    "file from a new epoch (its rows are reshuffled; some may come round again early)"
)


class DatasetChangedError(ValueError):
    """The training file differs from the one a saved position was taken in."""


def dataset_change(state: Mapping[str, Any], rows: int, sha256: str) -> str | None:
    """What differs between the file a saved JSONL position was taken in and one of ``rows`` rows
    hashing to ``sha256``; None when it is the same file. A position saved without the file's
    fingerprint is checked against the row count alone."""
    epoch, offset = state.get("epoch"), int(state.get("offset", 0))
    saved_rows, saved_sha = state.get("rows"), state.get("sha256")
    at = f"the saved position (epoch {epoch}, row {offset})"
    if saved_rows is None or saved_sha is None:
        if offset > rows:
            return f"{at} is past its {rows} rows: the file was cut since"
        return None
    if int(saved_rows) == rows and saved_sha == sha256:
        return None
    return (
        f"the file changed since the checkpoint ({saved_rows} rows, sha256 {str(saved_sha)[:12]} then; "
        f"{rows} rows, sha256 {sha256[:12]} now), so {at} no longer names the same prompts"
    )


def _check_messages(messages: list[Any], where: str) -> None:
    if not messages:
        raise ValueError(f"{where}: the chat is empty; give at least one user message")
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: message {i} must be an object with string 'role' and 'content' "
                f'(e.g. {{"role": "user", "content": "What is 2 + 3?"}}); got {message!r}'
            )


class HeldOutEval:
    """A training source whose evaluation rows come from a JSONL file of their own (never trained on):
    its first ``count`` rows, in file order (all of them when it has fewer)."""

    def __init__(self, train: PromptSource, eval_file: JsonlPrompts) -> None:
        if eval_file.prompt_field != train.prompt_field:
            raise ValueError("the evaluation file must use the training source's prompt_field")
        self.train = train
        self.eval_file = eval_file
        self.prompt_field = train.prompt_field

    def next_rows(self, count: int) -> list[dict[str, Any]]:
        return self.train.next_rows(count)

    def eval_rows(self, count: int) -> list[dict[str, Any]]:
        return self.eval_file.eval_rows(count)

    def state_dict(self) -> dict[str, Any]:
        return self.train.state_dict()  # the evaluation rows are fixed: no position to keep

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.train.load_state_dict(state)


def open_prompts(settings: RolloutSettings, seed: int) -> PromptSource:
    """The run's prompt source: the task's streams, or the dataset with ``eval_dataset``'s rows (if set)
    for evaluation."""
    chat = settings.chat_template
    source: PromptSource
    if settings.task is not None:
        source = TaskPrompts(settings.task, seed, settings.task_args)
    else:
        if settings.dataset is None:  # RolloutSettings holds one of the two
            raise ValueError("set rollout.task or rollout.dataset")
        source = JsonlPrompts(settings.dataset, settings.prompt_field, seed, messages_ok=chat)
    if settings.eval_dataset is not None:
        eval_file = JsonlPrompts(settings.eval_dataset, settings.prompt_field, seed, messages_ok=chat)
        source = HeldOutEval(source, eval_file)
    return source


def describe_eval_source(settings: RolloutSettings) -> str:
    """Where a run's evaluation prompts come from, in words (the driver prints it at the start)."""
    if settings.eval_dataset is not None:
        if settings.dataset is not None and _same_file(settings.eval_dataset, settings.dataset):
            return (
                f"the first {settings.eval_prompts} rows of {settings.eval_dataset}, which is also "
                "rollout.dataset: evaluation measures prompts the run trains on"
            )
        return f"held-out file {settings.eval_dataset} (at most {settings.eval_prompts} rows)"
    if settings.task is not None:
        return f"the held-out stream of task {settings.task} ({settings.eval_prompts} prompts)"
    return (
        f"the first {settings.eval_prompts} rows of the training file {settings.dataset}: no "
        "rollout.eval_dataset is set, so evaluation measures prompts the run trains on"
    )


def _same_file(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().samefile(Path(b).expanduser())
    except OSError:
        return False


class PromptRenderer:
    """A row's prompt as the model sees it: the prompt string as it is (``<bos>`` added as the
    tokenizer does), or, with ``chat_template``, the tokenizer's chat template applied to the row's
    messages (a prompt string is one user turn; ``system_prompt`` comes first unless the row's chat
    starts with a system message) with the generation prompt, the special tokens the template writes
    and no others (as verl and OpenRLHF encode a rendered chat)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_field: str,
        *,
        chat_template: bool = False,
        system_prompt: str | None = None,
    ) -> None:
        if chat_template and not tokenizer.chat_template:
            raise ValueError(
                "rollout.chat_template is true but the model's tokenizer has no chat template "
                "(tokenizer_config.json or chat_template.jinja); set rollout.chat_template=false, or "
                "import a chat model with `ppo-driver import-model`"
            )
        self.tokenizer = tokenizer
        self.prompt_field = prompt_field
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    def messages(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        value = row.get(self.prompt_field)
        messages = (
            [dict(m) for m in value]
            if isinstance(value, list)
            else [{"role": "user", "content": self._text(row)}]
        )
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def _text(self, row: Mapping[str, Any]) -> str:
        text = row.get(self.prompt_field)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(
                f"prompt {self.prompt_field!r} of row {dict(row)!r} is empty; every row needs a "
                "non-empty prompt"
            )
        return text

    def render(self, row: Mapping[str, Any]) -> str:
        """The prompt text (the chat template's output when on)."""
        if not self.chat_template:
            return self._text(row)
        text = self.tokenizer.apply_chat_template(
            self.messages(row), add_generation_prompt=True, tokenize=False
        )
        if not isinstance(text, str):
            raise TypeError(f"the chat template rendered {type(text).__name__}, expected text")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of a ``render`` result."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of ``render`` results, in one batch call of the tokenizer."""
        if not texts:
            return []
        ids = self.tokenizer(list(texts), add_special_tokens=not self.chat_template)["input_ids"]
        return [[int(i) for i in row] for row in ids]
