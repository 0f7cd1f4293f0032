"""Continuous batching on the static decoder: requests of their own lengths and stops share slots.

A call holds ``slots`` rows of one static KV cache. The waiting requests that take free slots are
prefilled together, into each slot's rows of the cache (columns ``[0, prompt)``), and each samples its
first token; then every decode step advances all slots at once (``LlamaStaticDecoder.slot_step``:
each row has its own cache column, position and output column). Every ``refill_every`` steps -- or as
soon as every occupied slot has reached its length limit -- the host reads the tokens, ends the rows
that hit a stop, frees their slots and prefills waiting requests into them.

A refill's prefill is one forward over its prompts right-padded to the longest (a causal mask with
the padding columns off, each row's logits read at its own last prompt position), split into several
forwards where the padded prompts would exceed :data:`PREFILL_TOKENS`: the prompts sorted by length,
so each forward pads little. The forward writes a scratch cache whose rows are then copied into the
slots' rows; the padding columns copied beyond a prompt stay invalid (never attended to) until decode
overwrites them. A row that reaches its ``max_new_tokens`` stops
on the device at once; a row that hits a stop sequence decodes on until the next check and the
tokens past its stop are cut off, so the check interval costs slot-steps, never changes an output.

Finish rules follow SGLang 0.5.23 (``sglang/srt/managers/schedule_batch.py``,
``Req.update_finish_state``, formerly ``check_finished``): a stop -- a stop token id, eos unless
``ignore_eos``, or a stop sequence -- ends the row with the stop's tokens included and
``finish_reason`` "stop", and wins over the length limit reached at the same token; otherwise the
row ends at ``max_new_tokens`` with "length". SGLang matches stop strings on decoded text; here the
engine matches token sequences and the caller tokenizes its strings (or cuts decoded text itself,
as ``rollout_fns.cut_at_stop`` does).

Exactness: each request draws its sampling noise from a generator of its own, seeded with the
request's seed, in the shape a one-row call draws it (``[1, vocab]`` per token, see
``core.pick_with_noise``), so a request's tokens are a fixed function of its prompt, sampling and
seed whatever slot, wave or prefill batch it runs in: the same as ``GenerationCore.generate([prompt],
..., seed=seed)`` up to the rounding of a batched matmul. A batched prefill samples each row's first
token from that row's logits ``[1, vocab]`` with the row's generator, as a prefill of its own does.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from ..config import SamplingConfig
from .decode_graphs import SDPA_BACKENDS, DecodeGraphs
from .early_stop import PAUSED, EarlyStop
from .static_decode import (
    KV_BLOCK,
    DecodeBuffers,
    LlamaStaticDecoder,
    Sampler,
    batch_bucket,
    kv_bucket,
    round_up,
)

__all__ = [
    "PREFILL_TOKENS",
    "GenerationRequest",
    "SlotStats",
    "generate_in_slots",
    "idle_share",
    "prefill_groups",
    "row_seed",
]

_SEED_MASK = 0x7FFF_FFFF_FFFF_FFFF

PREFILL_TOKENS = 8192
"""The most prompt tokens one prefill forward computes, padding included (rows x longest prompt): it
bounds the forward's scratch cache and attention mask. A longer prompt is prefilled alone."""


@dataclass(frozen=True)
class GenerationRequest:
    """One sample to generate: its prompt, length limit, stop token sequences and sampling seed."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    seed: int = 0
    stop: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt is empty; every request needs at least one token (e.g. <bos>)")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for i, seq in enumerate(self.stop):
            if not seq:
                raise ValueError(f"stop[{i}] is an empty token sequence; give at least one token or drop it")
            if any(t < 0 for t in seq):
                raise ValueError(f"stop[{i}] holds a negative token id: {list(seq)}")


@dataclass(frozen=True)
class SlotStats:
    """How a call used its slots. ``slots`` is the rows the device computes: ``max_running`` (or the
    request count, if smaller) rounded up to its batch bucket, every one of them used."""

    slots: int
    steps: int  # decode steps run
    busy_slot_steps: int  # slot-steps that made a token some output keeps
    prefills: int = 0  # prefill forwards run (each prefills one or more requests)

    @property
    def slot_steps(self) -> int:
        return self.slots * self.steps

    @property
    def idle_share(self) -> float:
        """The share of slot-steps spent on finished rows, empty slots and tokens past a stop."""
        return 1.0 - self.busy_slot_steps / self.slot_steps if self.steps else 0.0


def idle_share(lengths: Sequence[int], slots: int, steps: int) -> float:
    """The idle share of ``steps`` decode steps over ``slots`` rows that returned outputs of ``lengths``
    tokens (each output's first token comes from its prefill, the others from one decode step each)."""
    if slots < 1 or steps < 0:
        raise ValueError(f"idle_share needs slots >= 1 and steps >= 0, got slots={slots}, steps={steps}")
    return SlotStats(slots, steps, sum(max(n - 1, 0) for n in lengths)).idle_share


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row`` of a call seeded ``seed`` (a fixed mix, so each row's draws are its own)."""
    return (int(seed) * 1_000_003 + row * 2_654_435_761 + 1) & _SEED_MASK


def prefill_groups(lengths: Sequence[int], max_tokens: int = PREFILL_TOKENS) -> list[list[int]]:
    """Indices into ``lengths`` (prompt lengths), grouped into prefill forwards: shortest first, each
    group as many as fit in ``max_tokens`` padded tokens (rows x its longest), a longer prompt alone."""
    if max_tokens < 1:
        raise ValueError(f"prefill_groups needs max_tokens >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        # Sorted ascending: prompt i is the longest of the group it joins.
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class _Slot:
    request: int
    prompt_len: int
    limit: int
    made: int  # tokens in the output buffer so far (host count, exact: the device advances alike)
    checked: int  # tokens already searched for stops
    generator: torch.Generator


@dataclass(frozen=True)
class _Finish:
    length: int
    reason: str


def _find_stop(tokens: Sequence[int], start: int, stops: Sequence[tuple[int, ...]]) -> int | None:
    """The length of the shortest prefix of ``tokens`` longer than ``start`` that ends with a stop."""
    for end in range(start + 1, len(tokens) + 1):
        for seq in stops:
            if end >= len(seq) and tuple(tokens[end - len(seq) : end]) == seq:
                return end
    return None


Outputs = list[tuple[tuple[int, ...], tuple[float, ...], str]]


def generate_in_slots(
    decoder: LlamaStaticDecoder,
    runner: DecodeGraphs,
    requests: Sequence[GenerationRequest],
    sampling: SamplingConfig,
    *,
    stop_token_ids: Sequence[int],
    pad_token_id: int,
    slots: int,
    refill_every: int,
    weights_key: Hashable,
    guard: Callable[[], AbstractContextManager[Any]],
    make_sampler: Callable[[SamplingConfig], Sampler],
    first_token: Callable[[torch.Tensor, SamplingConfig, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
    prefill_tokens: int = PREFILL_TOKENS,
    until: EarlyStop | None = None,
) -> tuple[Outputs, SlotStats]:
    """(token ids, log-probs, finish reason) per request in request order, and the slot use.

    ``stop_token_ids`` (eos and the sampling's stop tokens) end every request; each request's own
    ``stop`` sequences end it alone. ``first_token(logits [1, V], sampling, generator)`` samples a
    prefill's token as a one-row call does. ``prefill_tokens``: the most padded prompt tokens of one
    prefill forward (see :func:`prefill_groups`). ``until``: end the call at the first check where it
    is reached (``early_stop``): the requests still running or waiting return as paused.
    """
    if slots < 1:
        raise ValueError(f"max_running must be >= 1, got {slots}")
    if refill_every < 1:
        raise ValueError(f"refill_every must be >= 1, got {refill_every}")
    if prefill_tokens < 1:
        raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
    batch = batch_bucket(min(slots, len(requests)))
    capacity = round_up(max(len(r.prompt) + r.max_new_tokens for r in requests), KV_BLOCK)
    # One spare output column: a finished row samples its pad tokens there.
    width = max(r.max_new_tokens for r in requests) + 1
    b = runner.prepare(batch, capacity, width, weights_key, per_row=True)
    capacity = b.capacity
    _empty(b, slice(None), pad_token_id)
    b.limits.zero_()
    shared_stops = tuple((int(t),) for t in stop_token_ids)
    sampler = make_sampler(sampling)
    sampling_key = ("slots", sampling.temperature, sampling.top_k, sampling.top_p)
    greedy = sampling.temperature == 0.0

    waiting = deque(range(len(requests)))
    occupied: dict[int, _Slot] = {}
    results: dict[int, tuple[tuple[int, ...], tuple[float, ...], str]] = {}
    steps = 0
    prefills = 0
    while waiting or occupied:
        # Free slots in order take waiting requests in order; their prefills run in groups.
        free = [s for s in range(batch) if s not in occupied]
        placed = [(s, waiting.popleft()) for s in free[: len(waiting)]]
        for group in prefill_groups([len(requests[i].prompt) for _, i in placed], prefill_tokens):
            pairs = [placed[g] for g in group]
            occupied.update(_prefill(decoder, b, pairs, requests, sampling, guard, first_token))
            prefills += 1
        since_check = 0
        while since_check < refill_every and any(slot.made < slot.limit for slot in occupied.values()):
            columns = max(slot.prompt_len + slot.made for slot in occupied.values())
            if not greedy:
                for s, slot in occupied.items():
                    if slot.made < slot.limit:
                        b.noise[s : s + 1].exponential_(1, generator=slot.generator)
            with guard():
                runner.step(kv_bucket(columns, capacity), sampling_key, sampler, pad_token_id)
            for slot in occupied.values():
                slot.made = min(slot.made + 1, slot.limit)
            steps += 1
            since_check += 1
        _check(b, occupied, results, requests, shared_stops, pad_token_id)
        running = bool(waiting or occupied)
        if until is not None and running and until.reached(len(results), _made(results, occupied)):
            _pause(b, occupied, results, waiting)
            break
    busy = sum(max(len(out[0]) - 1, 0) for out in results.values())
    return [results[i] for i in range(len(requests))], SlotStats(batch, steps, busy, prefills)


def _check(
    b: DecodeBuffers,
    occupied: dict[int, _Slot],
    results: dict[int, tuple[tuple[int, ...], tuple[float, ...], str]],
    requests: Sequence[GenerationRequest],
    shared_stops: tuple[tuple[int, ...], ...],
    pad: int,
) -> None:
    """The check: stops in the tokens made since the last one, then the length limits. A finished
    request's output goes to ``results`` and its slot is emptied (and leaves ``occupied``)."""
    rows = sorted(occupied)
    made = b.tokens_out[rows, : max(occupied[s].made for s in rows)].cpu().tolist()
    for s, tokens in zip(rows, made, strict=True):
        slot = occupied[s]
        finish = _finish(tokens[: slot.made], slot, shared_stops + requests[slot.request].stop)
        slot.checked = slot.made
        if finish is None:
            continue
        logps = b.logps_out[s, : finish.length].cpu().tolist()
        results[slot.request] = (tuple(tokens[: finish.length]), tuple(logps), finish.reason)
        del occupied[s]
        _empty(b, s, pad)


def _made(
    results: dict[int, tuple[tuple[int, ...], tuple[float, ...], str]], occupied: dict[int, _Slot]
) -> int:
    """The tokens a call has made so far: its finished outputs' and its running slots'."""
    return sum(len(out[0]) for out in results.values()) + sum(slot.made for slot in occupied.values())


def _pause(
    b: DecodeBuffers,
    occupied: dict[int, _Slot],
    results: dict[int, tuple[tuple[int, ...], tuple[float, ...], str]],
    waiting: deque[int],
) -> None:
    """An early stop: every running request's tokens so far (none past a stop: the check before found
    none), every waiting request with none, all paused."""
    for s, slot in occupied.items():
        tokens = b.tokens_out[s, : slot.made].cpu().tolist()
        logps = b.logps_out[s, : slot.made].cpu().tolist()
        results[slot.request] = (tuple(tokens), tuple(logps), PAUSED)
    occupied.clear()
    while waiting:
        results[waiting.popleft()] = ((), (), PAUSED)


def _finish(tokens: Sequence[int], slot: _Slot, stops: Sequence[tuple[int, ...]]) -> _Finish | None:
    end = _find_stop(tokens, slot.checked, stops) if stops else None
    if end is not None:
        return _Finish(end, "stop")
    if slot.made >= slot.limit:
        return _Finish(slot.limit, "length")
    return None


def _empty(b: DecodeBuffers, s: int | slice, pad: int) -> None:
    """An empty slot (``slice(None)``: every slot): finished, attending to its column 0 only (finite,
    never NaN)."""
    b.finished[s] = True
    b.valid[s].zero_()
    b.valid[s, 0] = True
    b.tok[s] = pad
    b.pos[s] = 0
    b.col[s] = 0
    b.step[s] = 0


def _prefill(
    decoder: LlamaStaticDecoder,
    b: DecodeBuffers,
    pairs: Sequence[tuple[int, int]],
    requests: Sequence[GenerationRequest],
    sampling: SamplingConfig,
    guard: Callable[[], AbstractContextManager[Any]],
    first_token: Callable[[torch.Tensor, SamplingConfig, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
) -> dict[int, _Slot]:
    """Prefills each ``(slot, request index)`` of ``pairs`` into its slot's rows of the cache, in one
    forward over the prompts right-padded, and samples each request's first token."""
    dev = decoder.device
    prompts = [requests[i].prompt for _, i in pairs]
    lengths = [len(p) for p in prompts]
    rows, width = len(pairs), max(lengths)
    # 0 on padding: any valid id (its keys are never attended to, its logits never read).
    ids = torch.tensor([[*p, *(0,) * (width - len(p))] for p in prompts], dtype=torch.long, device=dev)
    n = torch.tensor(lengths, dtype=torch.long, device=dev)
    slot_index = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=dev)
    positions = torch.arange(width, device=dev)[None].expand(rows, width)
    valid = positions < n[:, None]
    # The slots are any rows of the cache; the forward writes rows [0, rows), so it writes a scratch
    # cache of the prompts' columns, copied into the slots' rows below (padding columns included: they
    # stay invalid, and decode overwrites them).
    shape = (rows, decoder.kv_heads, width, decoder.head_dim)
    scratch = dataclasses.replace(
        b,
        keys=[torch.empty(shape, dtype=k.dtype, device=dev) for k in b.keys],
        values=[torch.empty(shape, dtype=v.dtype, device=dev) for v in b.values],
    )
    with guard(), sdpa_kernel(SDPA_BACKENDS):
        logits = decoder.forward(
            ids, positions, scratch, decoder.prefill_bias(valid), width, col=None, last=n - 1
        ).float()
        for cache, part in zip(b.keys + b.values, scratch.keys + scratch.values, strict=True):
            cache[:, :, :width].index_copy_(0, slot_index, part)
    placed: dict[int, _Slot] = {}
    firsts = []
    for r, (s, i) in enumerate(pairs):
        request = requests[i]
        generator = torch.Generator(device=dev)
        generator.manual_seed(int(request.seed) & _SEED_MASK)
        # One row's logits [1, V], its own generator: the draw of a prefill of its own.
        firsts.append(first_token(logits[r : r + 1], sampling, generator))
        placed[s] = _Slot(i, lengths[r], request.max_new_tokens, 1, 0, generator)
    tok0 = torch.cat([t for t, _ in firsts])
    logp0 = torch.cat([lp for _, lp in firsts])
    limits = torch.tensor([requests[i].max_new_tokens for _, i in pairs], dtype=torch.long, device=dev)
    columns = torch.arange(b.capacity, device=dev)[None]
    b.valid.index_copy_(0, slot_index, columns < n[:, None])
    b.tok.index_copy_(0, slot_index, tok0)
    b.pos.index_copy_(0, slot_index, n)
    b.col.index_copy_(0, slot_index, n)
    b.step.index_fill_(0, slot_index, 1)
    b.tokens_out[:, 0].index_copy_(0, slot_index, tok0)
    b.logps_out[:, 0].index_copy_(0, slot_index, logp0.to(b.logps_out.dtype))
    b.limits.index_copy_(0, slot_index, limits)
    b.finished.index_copy_(0, slot_index, limits == 1)
    return placed
