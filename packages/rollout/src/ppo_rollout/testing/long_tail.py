"""Long-tailed response lengths for benchmarks: the length sampler, a rollout function that forces
them, and the memory-bandwidth bound of decoding them.

Reasoning and tool trajectories run to thousands of tokens with a long tail; a benchmark of such a
workload gives each request its own ``max_new_tokens`` drawn from a lognormal distribution and
ignores eos (``rollout.sampling.ignore_eos``), so every response has exactly its drawn length and two
runs decode the same tokens' worth of work whatever the weights say.

- :func:`lognormal_lengths`: ``count`` lengths, ``exp(N(log median, sigma))`` rounded and clipped to
  ``[1, longest]``, a fixed function of the seed;
- :class:`LongTailRollout`: a rollout function (``rollout_fns``) whose samples each ask for their own
  length, all in the step's first wave of requests, so that the engines serve them continuously
  (per-request limits: ``GenerationCore.generate_requests``); it records every request it made;
- :func:`decode_bytes` (with :func:`decode_sizes` of a model) and :func:`copy_rate`: what decode
  steps must read at least and a device copy's rate, their quotient the bandwidth bound a decode's
  wall time is compared to.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..rollout_fns import PromptGroup, RolloutContext
from ..trajectory import Trajectory, TrajectoryBuilder

__all__ = [
    "LongTailRollout",
    "RecordedRequest",
    "copy_rate",
    "decode_bytes",
    "decode_sizes",
    "lognormal_lengths",
]


def lognormal_lengths(count: int, median: float, longest: int, sigma: float, seed: int) -> list[int]:
    """Lognormal response lengths: ``exp(N(log median, sigma))`` rounded, clipped to [1, longest]."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if median <= 0 or longest < 1 or sigma < 0:
        raise ValueError(
            f"lognormal lengths need median > 0, longest >= 1 and sigma >= 0; got median={median}, "
            f"longest={longest}, sigma={sigma}"
        )
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(median) + sigma * torch.randn(count, generator=g, dtype=torch.float64))
    return [max(1, min(longest, round(float(x)))) for x in draws]


@dataclass(frozen=True)
class RecordedRequest:
    """One request a :class:`LongTailRollout` made: the step, its prompt's tokens and its length."""

    step: int
    group: int
    prompt_tokens: int
    new_tokens: int


@dataclass
class LongTailRollout:
    """``async (ctx, group) -> trajectories``: each sample asks for its own drawn length.

    A group's lengths are ``lognormal_lengths(group.samples, ...)`` seeded from ``seed``, the step and
    the group's index, so a step's workload is the same in every run. Each sample is one request of
    one continuation; all of them are submitted before the first is awaited, so they go out in the
    step's first wave (``generate_client``) and an engine gets them in one call with per-request
    limits. Set ``rollout.sampling.ignore_eos`` for the lengths to hold exactly, and
    ``rollout.multi_turn.max_response_tokens`` (the training response limit of a rollout function
    of one's own) to at least ``longest``.

    Register it by name in the process that runs the rollout manager (the driver):
    ``register_rollout_function("long_tail")(LongTailRollout(512, 2048, 1.0))`` and
    ``rollout.rollout_function=long_tail``. :attr:`requests` lists what it asked for, in the order
    the requests were submitted.
    """

    median: float
    longest: int
    sigma: float = 1.0
    seed: int = 0
    requests: list[RecordedRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        lognormal_lengths(0, self.median, self.longest, self.sigma, 0)  # the same checks, up front

    def lengths(self, step: int, group: int, samples: int) -> list[int]:
        """The lengths of ``group``'s samples at ``step``."""
        seed = (self.seed * 1_000_003 + step * 7_919 + group * 104_729) % (2**62)
        return lognormal_lengths(samples, self.median, self.longest, self.sigma, seed)

    async def __call__(self, ctx: RolloutContext, group: PromptGroup) -> list[Trajectory]:
        lengths = self.lengths(ctx.step, group.index, group.samples)
        pending = []
        for n in lengths:
            self.requests.append(RecordedRequest(ctx.step, group.index, len(group.prompt_ids), n))
            pending.append(asyncio.ensure_future(ctx.generate(group.prompt_ids, n=1, max_new_tokens=n)))
        out = []
        for future in pending:
            (turn,) = await future
            builder = TrajectoryBuilder(group.index, group.prompt_ids)
            builder.add_turn(turn.token_ids, turn.log_probs, turn.weight_version)
            out.append(
                builder.build("length" if turn.finish_reason == "length" else "done", turn.finish_reason)
            )
        return out


def decode_bytes(
    weight_bytes: int, kv_token_bytes: int, steps: int, workload: Sequence[tuple[int, int]]
) -> int:
    """What ``steps`` decode steps must read at least: ``weight_bytes`` (every weight the step reads:
    all but the input embedding, whose rows of the step's tokens are negligible) once per step, and
    each kept token's keys and values (``kv_token_bytes``: every layer's) over its context, for the
    ``(prompt tokens, new tokens)`` of each request in ``workload``. A request's first token comes from
    its prefill; decode step ``t`` (1..n-1) attends over ``prompt + t`` columns."""
    contexts = sum((n - 1) * p + n * (n - 1) // 2 for p, n in workload)
    return steps * weight_bytes + contexts * kv_token_bytes


def decode_sizes(model: Any, itemsize: int) -> tuple[int, int]:
    """(bytes of the weights a decode step reads, bytes of one token's keys and values over every
    layer) of a Hugging Face causal LM held in ``itemsize``-byte elements. The weights are all but an
    untied input embedding (a lookup of the step's rows). Works on the meta device too."""
    config = model.config
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embed
    weights = sum(p.numel() for p in model.parameters()) - (0 if tied else embed.numel())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize
    return weights * itemsize, kv_token


def copy_rate(device: str | torch.device) -> float:
    """Bytes a second a device copy moves (read plus write), best of 5: 1 GiB on CUDA, 128 MiB on CPU."""
    device = torch.device(device)
    n = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best
