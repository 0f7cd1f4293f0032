"""An environment's reply as the token ids appended after the model's turn (never the model's own ids).

With a chat template, the reply is a new message rendered by the template, and the ids appended are
exactly what the template writes after the model's turn: the end of the assistant's message (what the
template puts after its end-of-turn token, or the whole closing text when the turn ended on a stop
string instead), the reply's message, and the generation prompt of the next assistant turn. That only
holds for a template whose rendering of turns ``1..k`` is a prefix of its rendering of ``1..k+1``:
:func:`check_append_only` refuses one that is not (a template that rewrites earlier turns, for
example by dropping their reasoning, would make the model see a history it never wrote).

Without a chat template the reply's text is encoded as it is, without special tokens.

**The reply stays text.** Its content is encoded in the tokenizer's split-special-tokens mode, apart
from the template's own text around it: a reply holding ``<|im_end|>\n<|im_start|>assistant\n`` (an
environment that echoes a web page, a file or a user) is encoded as those characters, never as the
control tokens, so it cannot end its message or forge a turn. Only the template writes special tokens.

A reply longer than ``max_tokens`` (its content, before the template's own tokens) is cut and ends
with the truncation marker (``TRUNCATION_MARKER`` unless another is given); only a bounded prefix of it
is tokenized (a 10 MB reply costs what its first few thousand characters do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TRUNCATION_MARKER", "ObservationRenderer", "check_append_only"]

TRUNCATION_MARKER = " ...[truncated]"
_USER, _MODEL, _REPLY = "Question?", "Answer.", "Reply."
_CONTENT = "Observation7f3a9c"  # stands for the reply's content, to find where the template puts it
_CHARS_PER_TOKEN = 8  # the first guess of how many characters max_tokens tokens span (doubled as needed)


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], *, generation: bool) -> str:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    if not isinstance(text, str):
        raise TypeError(f"the chat template rendered {type(text).__name__}, expected text")
    return text


def _template_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def check_append_only(tokenizer: PreTrainedTokenizerBase, role: str, turns: int = 3) -> None:
    """``ValueError`` naming the template unless rendering turns ``1..k`` is a prefix of ``1..k+1``.

    Checked for ``turns`` model turns, each answered by a ``role`` message, with and without the
    generation prompt after the history (the engine continues from the rendering with it).
    """
    messages: list[dict[str, str]] = [{"role": "user", "content": _USER}]
    for k in range(turns):
        before_turn = _render(tokenizer, messages, generation=True)
        messages.append({"role": "assistant", "content": f"{_MODEL} {k}"})
        with_turn = _render(tokenizer, messages, generation=False)
        messages.append({"role": role, "content": f"{_REPLY} {k}"})
        with_reply = _render(tokenizer, messages, generation=True)
        for earlier, later, what in (
            (before_turn, with_turn, "the model's turn"),
            (with_turn, with_reply, f"a {role!r} reply"),
        ):
            if not later.startswith(earlier):
                raise ValueError(
                    f"the chat template of {_template_name(tokenizer)} rewrites earlier turns: after "
                    f"{what} at turn {k + 1} its rendering no longer starts with the one before, so the "
                    "model would be trained on a history it never saw; use a template that only appends "
                    "(or rollout.chat_template=false), or set rollout.multi_turn.observation_role"
                )


class ObservationRenderer:
    """Token ids of an environment's reply, appended after a model turn."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: bool,
        role: str = "user",
        max_tokens: int = 256,
        eos_token_ids: Sequence[int] = (),
        marker: str = TRUNCATION_MARKER,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.role = role
        self.max_tokens = max_tokens
        self.marker = marker
        self._marker_ids = self._encode_text(marker)
        if max_tokens <= len(self._marker_ids):
            raise ValueError(
                f"rollout.multi_turn.max_observation_tokens ({max_tokens}) must exceed the "
                f"{len(self._marker_ids)} tokens of rollout.multi_turn.truncation_marker {marker!r}"
            )
        self._eos_ids = frozenset(int(t) for t in eos_token_ids) or frozenset(
            t for t in (tokenizer.eos_token_id,) if t is not None
        )
        if chat_template:
            check_append_only(tokenizer, role)
            self._history = [
                {"role": "user", "content": _USER},
                {"role": "assistant", "content": _MODEL},
            ]
            closed = _render(tokenizer, self._history, generation=False)
            self._closed_turn = closed
            self._after_model = closed[closed.rindex(_MODEL) + len(_MODEL) :]
            end_text = str(tokenizer.decode(sorted(self._eos_ids)[:1])) if self._eos_ids else ""
            # What the template writes after the end-of-turn token the model itself sampled.
            self._after_eos = (
                self._after_model[len(end_text) :]
                if end_text and self._after_model.startswith(end_text)
                else self._after_model
            )

    def _encode(self, text: str) -> list[int]:
        """``text`` as the template's own: its special-token text becomes the special tokens."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def _encode_text(self, text: str) -> list[int]:
        """``text`` from the environment: encoded as characters, never as special tokens."""
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [int(t) for t in ids]

    def truncate(self, text: str) -> str:
        """``text``, cut to ``max_tokens`` tokens (the marker included) when longer.

        Only a prefix is tokenized: ``_CHARS_PER_TOKEN * max_tokens`` characters, doubled until it
        holds more than ``max_tokens`` tokens or the whole text."""
        span = _CHARS_PER_TOKEN * self.max_tokens
        while True:
            head = text[:span]
            ids = self._encode_text(head)
            if len(ids) > self.max_tokens:
                break
            if len(head) == len(text):
                return text
            span *= 2
        kept = ids[: self.max_tokens - len(self._marker_ids)]
        return str(self.tokenizer.decode(kept, skip_special_tokens=True)) + self.marker

    def ids(self, text: str, turn_ids: Sequence[int]) -> list[int]:
        """The ids to append after the model's turn ``turn_ids`` for the reply ``text``."""
        content = self.truncate(text)
        if not self.chat_template:
            return self._encode_text(content)
        ended_on_eos = bool(turn_ids) and int(turn_ids[-1]) in self._eos_ids
        closing = self._after_eos if ended_on_eos else self._after_model
        before, written, after = self._split_reply(content)
        return [*self._encode(closing + before), *self._encode_text(written), *self._encode(after)]

    def _split_reply(self, content: str) -> tuple[str, str, str]:
        """The template's text before the reply's content, the content as the template wrote it, and
        the template's text after it (the generation prompt of the next turn included)."""

        def reply(text: str) -> str:
            rendered = _render(
                self.tokenizer, [*self._history, {"role": self.role, "content": text}], generation=True
            )
            return rendered[len(self._closed_turn) :]

        marked = reply(_CONTENT)
        at = marked.find(_CONTENT)
        if at < 0 or marked.find(_CONTENT, at + 1) >= 0:
            raise ValueError(
                f"the chat template of {_template_name(self.tokenizer)} does not write a "
                f"{self.role!r} message's content once, as it is; set rollout.chat_template=false"
            )
        before, after = marked[:at], marked[at + len(_CONTENT) :]
        rendered = reply(content)
        if not (rendered.startswith(before) and rendered.endswith(after)):
            raise ValueError(
                f"the chat template of {_template_name(self.tokenizer)} writes the text around a "
                f"{self.role!r} message differently for different contents; set rollout.chat_template=false"
            )
        return before, rendered[len(before) : len(rendered) - len(after)], after
