"""Reward functions: a registry by name, ``module:function`` strings, and the result check.

A reward function takes the whole batch of finished samples and returns one float per sample::

    @register_reward("my_reward")
    def my_reward(samples: Sequence[RewardInput]) -> Sequence[float]: ...

Batching lets a function call a judge or a verifier once per step. The result is checked: it must
hold exactly one finite real number per sample, else a ``RewardError`` names the sample and the
function.
"""

from __future__ import annotations

import functools
import importlib
import math
import numbers
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .answers import extract_answer, parse_number

__all__ = [
    "RewardError",
    "RewardFn",
    "RewardInput",
    "char_match",
    "check_rewards",
    "compute_rewards",
    "exact_match",
    "math_answer",
    "math_answer_strict",
    "reasoning_gym_answer",
    "register_reward",
    "registered_rewards",
    "resolve_reward",
    "response_text",
]


@dataclass(frozen=True)
class RewardInput:
    """One generated sample as a reward function sees it."""

    prompt: str  # prompt text: the dataset row's, or the chat template's rendering of it
    response: str  # decoded response: the end-of-sequence token(s) ending it removed (response_text)
    response_token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    row: Mapping[str, Any] = field(default_factory=dict)  # the dataset row: labels, metadata
    prompt_index: int = 0  # the prompt's index in this step (samples of one prompt share it)
    # Multi-turn: ``response`` is the last turn's text; ``transcript`` every turn and observation
    # after the prompt, decoded (equal to ``response`` for one turn).
    transcript: str = ""
    num_turns: int = 1


RewardFn = Callable[[Sequence[RewardInput]], Sequence[float]]


def _end_ids(tokenizer: Any, stop_token_ids: Sequence[int] = ()) -> frozenset[int]:
    """The ids that end a response: the tokenizer's eos, its model folder's eos (the generation
    config's, else the model config's: the ids the engines stop on; read from a local folder only,
    never over the network) and ``stop_token_ids`` (``rollout.sampling.stop_token_ids``)."""
    own = tuple(i for i in (tokenizer.eos_token_id,) if isinstance(i, int))
    return _model_eos(str(getattr(tokenizer, "name_or_path", "")), own) | frozenset(map(int, stop_token_ids))


@functools.lru_cache(maxsize=16)
def _model_eos(model_path: str, own: tuple[int, ...]) -> frozenset[int]:
    ids = set(own)
    if not (model_path and os.path.isdir(model_path)):
        return frozenset(ids)
    from transformers import AutoConfig, GenerationConfig

    for load in (GenerationConfig.from_pretrained, AutoConfig.from_pretrained):
        try:
            eos = load(model_path).eos_token_id
        except (OSError, ValueError, TypeError, KeyError):  # no such file: the next, or the tokenizer's
            continue
        found = {eos} if isinstance(eos, int) else set(eos or ())
        if found:
            ids |= found
            break
    return frozenset(ids)


def response_text(tokenizer: Any, token_ids: Sequence[int], stop_token_ids: Sequence[int] = ()) -> str:
    """A response as its reward reads it: decoded with its special tokens kept as text, except the one
    end-of-sequence (or stop) token that ends it (:func:`_end_ids`). A special token the model wrote
    is part of its answer: dropping every special token would reward a model that pads an answer with
    ``<bos>`` (or any special token that does not stop the engine) instead of ending it, ``12<bos><bos>``
    reading as ``12``."""
    ids = list(token_ids)
    if ids and ids[-1] in _end_ids(tokenizer, stop_token_ids):
        ids.pop()
    return str(tokenizer.decode(ids, skip_special_tokens=False))


class RewardError(ValueError):
    """A reward function raised, or returned something other than one finite float per sample."""


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``fn`` under ``name``.

    Names are unique; registering the same function again is a no-op.
    """
    if not name or ":" in name:
        raise ValueError(
            f"reward name {name!r} must be non-empty and hold no ':' (that form means module:function)"
        )

    def deco(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"a reward named {name!r} is already registered ({_describe(existing)}); pick another name"
            )
        _REGISTRY[name] = fn
        return fn

    return deco


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def resolve_reward(spec: str) -> RewardFn:
    """A registered name, or ``package.module:function``."""
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"reward {spec!r}: write 'package.module:function'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {exc}") from exc
        fn = getattr(module, attr, None)
        if fn is None or not callable(fn):
            raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
        return fn
    try:
        return _REGISTRY[spec]
    except KeyError:
        raise ValueError(
            f"reward {spec!r} is not registered; registered: {registered_rewards()}, "
            "or give 'package.module:function'"
        ) from None


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


# The largest float32 (numpy.finfo(numpy.float32).max): rewards become float32 tensors in training,
# where a larger finite float64 turns into inf and every loss after it into NaN.
FLOAT32_MAX = 3.4028234663852886e38


def check_rewards(values: Any, samples: Sequence[RewardInput], fn_name: str) -> list[float]:
    """One finite real per sample, else ``RewardError`` naming the sample and the function."""
    try:
        items = list(values)
    except TypeError:
        raise RewardError(
            f"reward function {fn_name} returned {type(values).__name__}, expected a sequence of "
            f"{len(samples)} floats (one per sample)"
        ) from None
    if len(items) != len(samples):
        raise RewardError(
            f"reward function {fn_name} returned {len(items)} values for {len(samples)} samples; "
            "return exactly one float per sample"
        )
    out: list[float] = []
    for i, (value, sample) in enumerate(zip(items, samples, strict=True)):
        where = f"sample {i} (prompt_index {sample.prompt_index}, prompt {sample.prompt!r})"
        # bool is an int subclass; a True/False reward is almost always a bug in the function.
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(
                f"reward function {fn_name} returned {value!r} ({type(value).__name__}) for {where}; "
                "expected a float"
            )
        as_float = float(value)
        if not math.isfinite(as_float):
            raise RewardError(
                f"reward function {fn_name} returned {as_float} for {where}; rewards must be finite"
            )
        if abs(as_float) > FLOAT32_MAX:
            raise RewardError(
                f"reward function {fn_name} returned {as_float} for {where}; training uses float32 "
                f"rewards, which cannot hold more than {FLOAT32_MAX:.4g} in magnitude; scale the rewards"
            )
        out.append(as_float)
    return out


# rollout.reward_timeout_s's default: a judge or verifier service that stops answering ends the run
# with a message instead of hanging it.
REWARD_TIMEOUT_S = 600.0


def compute_rewards(
    fn: RewardFn, samples: Sequence[RewardInput], *, timeout_s: float = REWARD_TIMEOUT_S
) -> list[float]:
    """Call ``fn`` on the batch and check its result. An exception the function raises becomes a
    ``RewardError`` that names it (``rollout.reward``), chained to the original for its traceback; a
    call that has not returned after ``timeout_s`` (``rollout.reward_timeout_s``) a ``RewardError``
    naming the function, the samples' prompt indices and the limit. The call runs in a daemon thread:
    a call past its limit is abandoned (Python cannot stop a thread), and the run stops."""
    name = _describe(fn)
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["values"] = fn(samples)
        except BaseException as exc:  # handed to the caller's thread, which raises it
            outcome["error"] = exc

    worker = threading.Thread(target=call, name=f"reward {name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise RewardError(
            f"reward function {name} (rollout.reward) did not return within rollout.reward_timeout_s="
            f"{timeout_s:g} s for {len(samples)} samples ({_prompt_indices(samples)}); fix the function or "
            "the service it calls, or raise rollout.reward_timeout_s"
        )
    error = outcome.get("error")
    if isinstance(error, Exception):
        raise RewardError(
            f"reward function {name} (rollout.reward) raised {type(error).__name__}: {error}; "
            "fix the function or the service it calls, then re-run"
        ) from error
    if error is not None:
        raise error  # KeyboardInterrupt, SystemExit: not the function's failure to report
    return check_rewards(outcome["values"], samples, name)


def _prompt_indices(samples: Sequence[RewardInput]) -> str:
    indices = sorted({s.prompt_index for s in samples})
    if not indices:
        return "no prompts"
    if len(indices) == 1:
        return f"prompt_index {indices[0]}"
    return f"prompt_index {indices[0]} to {indices[-1]}"


def _label(sample: RewardInput) -> str:
    label = sample.row.get("label")
    if not isinstance(label, str):
        raise ValueError(
            f"this reward needs a string 'label' field in each dataset row; prompt {sample.prompt!r} has "
            f"{label!r}"
        )
    return label


@register_reward("char_match")
def char_match(samples: Sequence[RewardInput]) -> list[float]:
    """Partial credit: matching characters at the same position / max(len(label), len(response)).

    A response cut by the length limit (``finish_reason == "length"``) did not end: its answer goes on
    past its text, so it counts one character longer than its text and never scores 1. Scored as its
    text, a model that never ends (writing past its answer up to the limit) earns nearly what an ended
    answer does, and does not learn to end."""
    out = []
    for s in samples:
        label = _label(s)
        unfinished = 1 if s.finish_reason == "length" else 0
        denom = max(len(label), len(s.response) + unfinished, 1)
        out.append(sum(a == b for a, b in zip(label, s.response, strict=False)) / denom)
    return out


@register_reward("exact_match")
def exact_match(samples: Sequence[RewardInput]) -> list[float]:
    """1.0 when the response equals the label (after stripping whitespace), else 0.0."""
    return [1.0 if s.response.strip() == _label(s).strip() else 0.0 for s in samples]


# -- verifiable math answers ----------------------------------------------------------------------

# What a marked but wrong answer earns under ``math_answer_strict``: verl's gsm8k scorer gives such a
# ``format_score`` for an answer in the ``#### N`` format whatever its value (verl
# utils/reward_score/gsm8k.py, volcengine/verl@b178a3cd).
FORMAT_SCORE = 0.1


def _label_value(sample: RewardInput) -> Fraction:
    """The row's ``label`` as a number: ``"42"``, ``42``, ``"-1,234.5"``, or a GSM8K solution
    ending in ``#### 42``."""
    label = sample.row.get("label")
    value: Fraction | None = None
    if isinstance(label, int | float) and not isinstance(label, bool) and math.isfinite(label):
        value = Fraction(label)
    elif isinstance(label, str):
        value = parse_number(label)
        if value is None:
            found = extract_answer(label)
            value = found.value if found.mark in ("hashes", "boxed") else None
    if value is None:
        raise ValueError(
            "the math rewards need a numeric 'label' field in each dataset row (42, \"-1,234.5\" or a "
            f"solution ending in '#### 42'); prompt {sample.prompt[-80:]!r} has {label!r}"
        )
    return value


@register_reward("math_answer")
def math_answer(samples: Sequence[RewardInput]) -> list[float]:
    """1.0 when the response's final number (the marked one, else the last; ``answers.py``) equals
    the numeric label, else 0.0 (no number at all included)."""
    out = []
    for s in samples:
        found = extract_answer(s.response)
        out.append(1.0 if found.value is not None and found.value == _label_value(s) else 0.0)
    return out


@register_reward("math_answer_strict")
def math_answer_strict(samples: Sequence[RewardInput]) -> list[float]:
    """The value and the format: 1.0 for a marked answer (``\\boxed{}``, ``#### N``, "the answer is
    N") equal to the label, ``FORMAT_SCORE`` (0.1) for a marked answer that is wrong, 0.0 when the
    response marks no answer (a bare correct number included)."""
    out = []
    for s in samples:
        found = extract_answer(s.response)
        if not found.marked or found.value is None:
            out.append(0.0)
        else:
            out.append(1.0 if found.value == _label_value(s) else FORMAT_SCORE)
    return out


@register_reward("reasoning_gym")
def reasoning_gym_answer(samples: Sequence[RewardInput]) -> list[float]:
    """The generator's own scorer for rows of ``rollout.task: reasoning_gym:<name>``:
    ``dataset.score_answer(answer, entry)`` with the answer of the last ``<answer>...</answer>`` (else
    after the last ``####``); its values as it gives them (1.0 for a right answer; some generators give
    0.01 or 0.05 for a wrong or missing one)."""
    from .reasoning_gym_task import score_row

    return [score_row(s.response, s.row) for s in samples]


@register_reward("none")
def no_reward(samples: Sequence[RewardInput]) -> list[float]:
    """0.0 for every sample: an environment's turn rewards are the whole signal."""
    return [0.0] * len(samples)
