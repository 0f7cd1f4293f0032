"""Stop strings as the engines take them: the strings themselves, and token sequences to match.

SGLang matches stop strings on decoded text: after each token it decodes the output's tail and ends
the request once a stop string is in it (SGLang 0.5.23, ``sglang/srt/managers/schedule_batch.py``,
``Req.update_finish_state`` -> ``_check_str_based_finish``: ``stop_str in tail_str``, the tail being
the last ``stop_str_max_len + 1`` tokens, ``stop_str_max_len`` the string's standalone token count).
The built-in engine matches token ids instead (``engine.continuous``), so each string is turned into
the token sequences a tokenizer writes it as: standalone and inside text (after a space, a newline,
a letter; before one), e.g. ``"</a>"`` alone and ``" </a>"`` as one token with its leading space.

Two rules make this safe whatever the tokenizer does:

- a sequence is kept only if its own decoded text holds the string, so a match means the string is
  really in the output (the engine never ends a turn early);
- the rollout still cuts each turn at the first occurrence of the string in the decoded text
  (``rollout_fns.cut_at_stop``), the exact rule: a way of writing the string that no sequence covers
  (a token that merges the string's end with the text after it) only lets the engine decode on to
  the turn's limit, as it would without engine-side stops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["RequestStop", "stop_token_sequences"]

# Text put before and after a stop string to see how a tokenizer writes it inside other text.
_BEFORE = ("", " ", "\n", "a", "1", ".", ")", ":")
_AFTER = ("", " ", "\n", ".")


@dataclass(frozen=True)
class RequestStop:
    """One request's stop strings, and the token sequences that spell them (built-in engine)."""

    strings: tuple[str, ...] = ()
    token_ids: tuple[tuple[int, ...], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.strings or self.token_ids)


def stop_token_sequences(
    stops: Sequence[str],
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[Sequence[int]], str],
) -> tuple[tuple[int, ...], ...]:
    """Token sequences whose decoded text holds one of ``stops``, shortest first.

    ``encode`` tokenizes text without special tokens; ``decode`` is the decoding the rollout cuts
    with. For each stop string and each context ``before + stop + after``, the kept sequence is the
    shortest window of the context's tokens whose text holds the stop string.
    """
    found: set[tuple[int, ...]] = set()
    for stop in stops:
        if not stop:
            raise ValueError("rollout.multi_turn.stop holds an empty string; remove it")
        for before in _BEFORE:
            for after in _AFTER:
                window = _window(list(encode(before + stop + after)), stop, decode)
                if window:
                    found.add(window)
    return tuple(sorted(found, key=lambda seq: (len(seq), seq)))


def _window(ids: list[int], stop: str, decode: Callable[[Sequence[int]], str]) -> tuple[int, ...] | None:
    """The shortest ``ids[i:j]`` whose text holds ``stop`` (the first such end, the latest start)."""
    end = next((j for j in range(1, len(ids) + 1) if stop in decode(ids[:j])), None)
    if end is None:
        return None
    start = max(i for i in range(end) if stop in decode(ids[i:end]))
    return tuple(int(t) for t in ids[start:end])
