"""When a generate call may end before every request has finished (``rollout.partial``).

An :class:`EarlyStop` ends a call at the first check where at least ``finished`` of its samples have
finished, or at least ``tokens`` tokens were made (whichever comes first). The checks are the ones
the call makes anyway: every 16 decode steps in a static batch, at every refill in slots, so where a
call ends is a fixed function of its inputs and seed. The samples still running return the tokens
made so far and their log-probs with finish reason :data:`PAUSED`; a request that never took a slot
returns no tokens. Continuing a paused sample is a new request: its prompt and tokens so far as the
input ids, the tokens it has left as its limit.

A server engine (SGLang, vLLM) answers a generate call only once all of it has finished, so its handle
generates a call with an early stop in chunks of ``chunk_tokens`` tokens per sample and checks between
them (``engine.server_chunks``): the same contract, checked every ``chunk_tokens`` tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CHUNK_TOKENS", "PAUSED", "EarlyStop", "StopRule"]

PAUSED = "paused"
"""The finish reason of a sample an :class:`EarlyStop` ended before its stop or its length limit."""

CHUNK_TOKENS = 256
"""A server engine's tokens per sample between two checks, unless set (``rollout.partial.chunk_tokens``)."""


@dataclass(frozen=True)
class EarlyStop:
    """End the call once ``finished`` samples have finished or ``tokens`` tokens were made (None: no
    such bound; at least one is set). ``chunk_tokens``: a server engine's checks come every that many
    tokens of each sample (``engine.server_chunks``); the built-in engine checks where it does anyway."""

    finished: int | None = None
    tokens: int | None = None
    chunk_tokens: int = CHUNK_TOKENS

    def __post_init__(self) -> None:
        if self.finished is None and self.tokens is None:
            raise ValueError("EarlyStop needs finished or tokens (or both)")
        bounds = (("finished", self.finished), ("tokens", self.tokens), ("chunk_tokens", self.chunk_tokens))
        for name, value in bounds:
            if value is not None and value < 1:
                raise ValueError(f"EarlyStop.{name} must be >= 1, got {value}")

    def reached(self, finished: int, tokens: int) -> bool:
        """Whether a call that has ``finished`` samples done and ``tokens`` tokens made may end."""
        return (self.finished is not None and finished >= self.finished) or (
            self.tokens is not None and tokens >= self.tokens
        )


@dataclass(frozen=True)
class StopRule:
    """A generation phase's budget (``rollout.partial``), as each engine call's :class:`EarlyStop`:
    ``finish_fraction`` of the call's samples finished, or the call's share of ``token_budget``
    tokens (its samples over the wave's) made; None turns one off. ``chunk_tokens``: every call's
    (:class:`EarlyStop`)."""

    finish_fraction: float | None = None
    token_budget: int | None = None
    chunk_tokens: int = CHUNK_TOKENS

    def for_call(self, samples: int, wave: int) -> EarlyStop:
        """The early stop of a call of ``samples`` samples out of a wave of ``wave``."""
        finished = None
        if self.finish_fraction is not None:
            finished = max(1, math.ceil(self.finish_fraction * samples - 1e-9))
        tokens = None
        if self.token_budget is not None:
            tokens = max(1, math.ceil(self.token_budget * samples / max(wave, 1)))
        return EarlyStop(finished, tokens, self.chunk_tokens)
