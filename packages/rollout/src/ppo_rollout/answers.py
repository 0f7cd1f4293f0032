"""The final number of a math answer, as the verifiable math rewards read it.

An answer is *marked* when the response says which number it means: the last ``\\boxed{...}``, else
the last ``#### 42`` (GSM8K's solutions), else the number right after the last "the answer is",
"answer:" or "final answer" (any case). Without a mark, the last number of the response is the answer
(verl's ``flexible`` method). Numbers may carry thousands separators (``1,234``, groups of three
digits), a sign, decimals, a currency sign, LaTeX ``\\frac{a}{b}`` or ``a/b`` inside a box, and text
after them (``42 apples.``); they compare exactly (``Fraction``), so ``42``, ``42.0`` and ``$42`` are
equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

__all__ = ["Answer", "extract_answer", "parse_number"]

# A minus sign is the number's own only when no digit or closing bracket comes right before it: in
# "12-5" it is the subtraction's. U+2212 is the typographic minus.
_NUMBER = re.compile(
    r"(?<![\d)\]}])(?P<sign>[-\u2212])?\$?\s?(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
)
_HASHES = re.compile(r"####\s*")
_PHRASE = re.compile(r"(?:the\s+(?:final\s+)?answer\s+is|final\s+answer|answer)\s*[:=]?", re.IGNORECASE)
# Between a phrase and its number: markdown emphasis, "$", a colon or an equals sign, spaces.
_PHRASE_GAP = re.compile(r"[\s*_:=$\\(]*")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")

Mark = Literal["boxed", "hashes", "phrase", "last_number", "none"]


@dataclass(frozen=True)
class Answer:
    """The number a response gives (None when it gives none) and how it was found."""

    value: Fraction | None
    mark: Mark

    @property
    def marked(self) -> bool:
        """Whether the response marked its answer (boxed, ``####`` or a phrase)."""
        return self.mark in ("boxed", "hashes", "phrase")


def _to_fraction(match: re.Match[str]) -> Fraction:
    digits = match.group("int").replace(",", "") + (match.group("frac") or "")
    value = Fraction(digits)
    return -value if match.group("sign") else value


def parse_number(text: str) -> Fraction | None:
    """``text`` as one number (a label such as ``"-1,234.5"``, ``"$42"``, ``"3/4"``), else None."""
    stripped = _FRAC.sub(r"\1/\2", text.strip()).rstrip(".").strip()
    if "/" in stripped:
        num, _, den = stripped.partition("/")
        a, b = parse_number(num), parse_number(den)
        return a / b if a is not None and b is not None and b != 0 else None
    match = _NUMBER.fullmatch(stripped)
    return _to_fraction(match) if match else None


def _last_number(text: str) -> Fraction | None:
    matches = list(_NUMBER.finditer(text))
    return _to_fraction(matches[-1]) if matches else None


def _boxed_contents(text: str) -> list[str]:
    """The contents of every ``\\boxed{...}``, with nested braces (``\\boxed{\\frac{1}{2}}``)."""
    out = []
    for start in (m.end() for m in re.finditer(r"\\boxed\s*\{", text)):
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[start : i - 1])
    return out


def _boxed_value(content: str) -> Fraction | None:
    whole = parse_number(content)
    if whole is not None:
        return whole
    return _last_number(_FRAC.sub(r"\1/\2", content))  # "x = 42", "42 \text{ apples}"


def extract_answer(text: str) -> Answer:
    """The final number of ``text``: the marked one when there is a mark, else the last number."""
    boxed = _boxed_contents(text)
    if boxed:
        return Answer(_boxed_value(boxed[-1]), "boxed")
    hashes = list(_HASHES.finditer(text))
    if hashes:
        after = _NUMBER.match(text, hashes[-1].end())
        if after:
            return Answer(_to_fraction(after), "hashes")
    for phrase in reversed(list(_PHRASE.finditer(text))):
        gap = _PHRASE_GAP.match(text, phrase.end())
        at = gap.end() if gap else phrase.end()
        after = _NUMBER.match(text, at)
        if after:
            return Answer(_to_fraction(after), "phrase")
    last = _last_number(text)
    return Answer(last, "last_number" if last is not None else "none")
