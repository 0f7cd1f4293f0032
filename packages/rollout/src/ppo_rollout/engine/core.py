"""The generation core of the built-in engine: a plain class, usable without Ray.

Batched sampling from a Hugging Face causal LM with a KV cache. Prompts of different lengths are
left-padded into one batch, with an attention mask and position ids that start at 0 at each
prompt's first real token, so padding changes nothing the model sees.

Log-probs: each returned log-prob is ``log_softmax(logits / temperature)`` of the sampled token over
the whole vocabulary (``log_softmax(logits)`` when greedy) -- the distribution the trainer recomputes
at the same temperature, and what SGLang returns. It is the sampling distribution itself when
``top_k`` and ``top_p`` are off; with them on, sampling draws from the truncated renormalised
distribution while the log-prob stays the untruncated one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from ..config import SamplingConfig
from .continuous import GenerationRequest, SlotStats, generate_in_slots, row_seed
from .decode_fusions import fuse_projections
from .decode_graphs import SDPA_BACKENDS, DecodeGraphs
from .early_stop import PAUSED, EarlyStop
from .static_decode import (
    KV_BLOCK,
    STOP_SLOTS,
    LlamaStaticDecoder,
    Sampler,
    batch_bucket,
    kv_bucket,
    round_up,
    stop_check_due,
    unsupported_reason,
)

__all__ = [
    "DECODE_MODES",
    "GenerationCore",
    "GenerationOutput",
    "GenerationRequest",
    "first_token",
    "make_sampler",
    "pick_with_noise",
    "sample_tokens",
    "sampling_distribution",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DECODE_MODES = ("auto", "loop", "static", "static-eager")
"""``GenerationCore(decode=...)``: "loop" is the Hugging Face forward with a dynamic cache, one Python
iteration per token; "static" the static KV cache with CUDA-graph decode steps on CUDA (eager on CPU);
"static-eager" the static cache without graphs; "auto" is "static" on CUDA for the model types the
static decoder knows (Llama, Qwen2, Gemma 3: ``ppo_weight_sync.families``) and "loop" everywhere else."""


@dataclass(frozen=True)
class GenerationOutput:
    """One sample. ``prompt_position`` is the index of its prompt in the call's prompt list."""

    prompt_position: int
    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    # "stop": a stop token was sampled (and is the last token); "length": max_new_tokens; "paused": an
    # early stop ended the call first (``early_stop``)
    finish_reason: str


def sampling_distribution(
    logits: torch.Tensor, sampling: SamplingConfig
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the probabilities to draw from [B, V], or None when greedy; the log-probs of every token [B, V]).

    ``logits`` must be float32. Top-k and top-p truncate the draw, never the log-probs.
    """
    if sampling.temperature == 0.0:
        return None, torch.log_softmax(logits, dim=-1)
    scaled = logits / sampling.temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    masked = scaled
    vocab = scaled.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        masked = masked.masked_fill(masked < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(masked, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        masked = masked.masked_fill(drop, float("-inf"))
    return torch.softmax(masked, dim=-1), logp_all


def pick_with_noise(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw per row: ``argmax(probs / noise)``, ``noise`` Exp(1) draws of the same shape.

    This is how ``torch.multinomial(probs, 1)`` samples (its one-sample fast path fills
    ``empty_like(probs).exponential_(1, generator)`` and takes this argmax), so noise drawn with the
    same generator in the same shape gives the same tokens -- without the host syncs multinomial makes
    to validate ``probs``, which a captured CUDA graph cannot contain.
    """
    return (probs / noise).argmax(dim=-1)


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V]; returns (tokens [B] int64, log-probs [B] float32)."""
    logits = logits.float()
    probs, logp_all = sampling_distribution(logits, sampling)
    if probs is None:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logp_all.gather(-1, tokens[:, None])[:, 0]


def make_sampler(sampling: SamplingConfig) -> Sampler:
    """The sampling of :func:`sample_tokens` with the noise passed in (the static decoder's form)."""

    def sample(logits: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        probs, logp_all = sampling_distribution(logits, sampling)
        tokens = logits.argmax(dim=-1) if probs is None else pick_with_noise(probs, noise)
        return tokens, logp_all.gather(-1, tokens[:, None])[:, 0]

    return sample


def first_token(
    logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill's token from its logits [B, V] (float32), drawn exactly as the plain loop draws it."""
    probs, logp_all = sampling_distribution(logits, sampling)
    if probs is None:
        tokens = logits.argmax(dim=-1)
    else:
        tokens = pick_with_noise(probs, torch.empty_like(probs).exponential_(1, generator=generator))
    return tokens, logp_all.gather(-1, tokens[:, None])[:, 0]


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass(frozen=True)
class _Call:
    """One generate call's inputs on the device."""

    input_ids: torch.Tensor  # [B, W] left-padded
    mask: torch.Tensor  # [B, W] int64, 1 on prompt tokens
    sampling: SamplingConfig
    generator: torch.Generator
    stop_ids: list[int]
    guard: Callable[[], AbstractContextManager[Any]]
    until: EarlyStop | None = None


# (tokens [B, N], log-probs [B, N], lengths [B], stopped [B]) on the host
_Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class GenerationCore:
    """Loads a causal LM from ``model_path`` and generates for batches of token-id prompts.

    ``decode`` picks the decode path (:data:`DECODE_MODES`); :attr:`last_decode_path` says which one
    the last call took ("loop", "static-eager" or "cuda-graphs") and :attr:`graph_failure` why graphs
    were given up, if they were.

    Calls with per-request limits (:meth:`generate_requests`, or ``generate`` with ``max_new_tokens``
    or ``stop`` per prompt) run continuously batched (``engine.continuous``): at most ``max_running``
    rows decode at once, and every ``refill_every`` decode steps finished rows leave and waiting
    requests take their slots. :attr:`last_slot_stats` is the last such call's slot use.
    """

    def __init__(
        self,
        model_path: str | Path,
        device: str | torch.device = "cpu",
        dtype: str = "float32",
        *,
        decode: str = "auto",
        max_running: int = 256,
        refill_every: int = 8,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_running < 1:
            raise ValueError(f"max_running must be >= 1 (rows decoded at once), got {max_running}")
        if refill_every < 1:
            raise ValueError(f"refill_every must be >= 1 (decode steps between refills), got {refill_every}")
        self.max_running = max_running
        self.refill_every = refill_every
        self.last_slot_stats: SlotStats | None = None
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {list(DECODE_MODES)}, got {decode!r}")
        self.device = torch.device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_path))
        self.model: Any = model.to(device=self.device, dtype=_DTYPES[dtype]).eval().requires_grad_(False)
        _own_storage(self.model)
        if unsupported_reason(self.model) is None:
            # q/k/v and gate/up weights joined into one buffer each (the parameters views into it) here,
            # while the weights are allocated, so that a memory backend that tracks allocations (a
            # region) owns the buffers; the static decoders find them joined.
            fuse_projections(self.model)
        config = self.model.config
        gen_config = getattr(self.model, "generation_config", None)
        eos = _as_list(getattr(gen_config, "eos_token_id", None)) or _as_list(
            getattr(config, "eos_token_id", None)
        )
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        pad = getattr(gen_config, "pad_token_id", None)
        if pad is None:
            pad = getattr(config, "pad_token_id", None)
        self.pad_token_id: int = int(pad) if pad is not None else (eos[0] if eos else 0)
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        # transformers 5.x renamed the forward argument ``past_key_values`` to ``cache``.
        params = inspect.signature(type(self.model).forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._decoder = self._pick_decoder(decode)
        self._use_graphs = decode in ("auto", "static")
        self._graphs_lock = threading.Lock()
        self._graphs = (
            DecodeGraphs(self._decoder, use_graphs=self._use_graphs) if self._decoder is not None else None
        )
        self.last_decode_path: str | None = None
        self.graph_failure: str | None = None
        self.graph_capture_seconds = 0.0  # every decode graph captured so far
        # The continuous path's decoder where ``decode`` picked the loop (eager, made at first use).
        self._slot_decoder: LlamaStaticDecoder | None = None
        # The continuous path's kept buffers and graphs, apart from the batch path's: a run that uses
        # both keeps both sets of captured graphs.
        self._slot_graphs = (
            DecodeGraphs(self._decoder, use_graphs=self._use_graphs) if self._decoder is not None else None
        )

    def _pick_decoder(self, decode: str) -> LlamaStaticDecoder | None:
        if decode == "loop":
            return None
        reason = unsupported_reason(self.model)
        if decode == "auto":
            return LlamaStaticDecoder(self.model) if reason is None and self.device.type == "cuda" else None
        if reason is not None:
            raise ValueError(f"decode={decode!r}: {reason}; use decode='loop' (or 'auto') for this model")
        return LlamaStaticDecoder(self.model)

    # -- validation ------------------------------------------------------------------------------
    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if not prompts:
            raise ValueError("generate needs at least one prompt; got an empty list")
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. <bos>)")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
                )
            if self.max_positions is not None and len(prompt) + max_new_tokens > self.max_positions:
                raise ValueError(
                    f"prompt {i} is too long: {len(prompt)} tokens + max_new_tokens {max_new_tokens} > the "
                    f"model's max_position_embeddings {self.max_positions}; shorten the prompt or lower "
                    "max_new_tokens"
                )

    # -- generation ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None = None,
        step_guard: Callable[[], AbstractContextManager[Any]] | None = None,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[Sequence[Sequence[int]]] | None = None,
        until: EarlyStop | None = None,
    ) -> list[GenerationOutput]:
        """``n_samples_per_prompt`` samples per prompt, consecutive, in prompt order.

        The same prompts, sampling and seed give the same tokens. ``step_guard`` wraps every forward
        pass (the engine uses it to pause between decode steps and to keep weight loads out of them).

        ``max_new_tokens`` (one limit per prompt, in place of ``sampling.max_new_tokens``) and ``stop``
        (per prompt, token sequences that end its samples, included in them) make the call
        continuously batched (:meth:`generate_requests`); sample ``r`` then draws from
        ``row_seed(seed, r)``. ``until``: the call may end before every sample finished
        (``early_stop``); the unfinished ones return their tokens so far, finish reason "paused".
        """
        if max_new_tokens is not None or stop is not None:
            requests = self._requests(prompts, sampling, seed, max_new_tokens, stop)
            n = sampling.n_samples_per_prompt
            outs = self.generate_requests(requests, sampling, step_guard=step_guard, until=until)
            return [dataclasses.replace(o, prompt_position=i // n) for i, o in enumerate(outs)]
        self.check_prompts(prompts, sampling.max_new_tokens)
        n = sampling.n_samples_per_prompt
        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        batch = len(rows)
        width = max(len(r) for r in rows)
        dev = self.device
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
        call = _Call(
            input_ids=input_ids.to(dev),
            mask=mask.to(dev),
            sampling=sampling,
            generator=torch.Generator(device=dev),
            stop_ids=sorted({*(() if sampling.ignore_eos else self.eos_token_ids), *sampling.stop_token_ids}),
            guard=step_guard or contextlib.nullcontext,
            until=until,
        )
        call.generator.manual_seed(int(sampling.seed if seed is None else seed) & 0x7FFF_FFFF_FFFF_FFFF)
        if self._decoder is None:
            self.last_decode_path = "loop"
            tokens, logps, lengths, stopped = self._generate_loop(call)
        else:
            tokens, logps, lengths, stopped = self._generate_static(call, self._decoder)
        results = []
        for i in range(batch):
            length = int(lengths[i])
            reason = "length" if length == sampling.max_new_tokens else PAUSED
            results.append(
                GenerationOutput(
                    prompt_position=i // n,
                    token_ids=tuple(tokens[i, :length].tolist()),
                    log_probs=tuple(logps[i, :length].tolist()),
                    finish_reason="stop" if bool(stopped[i]) else reason,
                )
            )
        return results

    def _requests(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None,
        max_new_tokens: Sequence[int] | None,
        stop: Sequence[Sequence[Sequence[int]]] | None,
    ) -> list[GenerationRequest]:
        for field, values in (("max_new_tokens", max_new_tokens), ("stop", stop)):
            if values is not None and len(values) != len(prompts):
                raise ValueError(
                    f"{field} needs one entry per prompt: {len(values)} for {len(prompts)} prompts"
                )
        base = int(sampling.seed if seed is None else seed)
        n = sampling.n_samples_per_prompt
        requests = []
        for p, prompt in enumerate(prompts):
            limit = sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens[p])
            stops = () if stop is None else tuple(tuple(int(t) for t in seq) for seq in stop[p])
            for k in range(n):
                row = p * n + k
                try:
                    requests.append(
                        GenerationRequest(tuple(map(int, prompt)), limit, row_seed(base, row), stops)
                    )
                except ValueError as exc:
                    raise ValueError(f"prompt {p}: {exc}") from None
        return requests

    @torch.inference_mode()
    def generate_requests(
        self,
        requests: Sequence[GenerationRequest],
        sampling: SamplingConfig,
        *,
        step_guard: Callable[[], AbstractContextManager[Any]] | None = None,
        max_running: int | None = None,
        refill_every: int | None = None,
        until: EarlyStop | None = None,
    ) -> list[GenerationOutput]:
        """One output per request, in request order (``prompt_position`` is the request's index).

        Each request brings its own length limit, stop sequences and seed; ``sampling`` gives the
        temperature, top-k/top-p, extra stop token ids and ``ignore_eos`` (its ``max_new_tokens``,
        ``n_samples_per_prompt`` and ``seed`` are not used). ``max_running`` and ``refill_every``
        override the core's settings for this call; ``until`` may end it early (``early_stop``).
        """
        if not requests:
            raise ValueError("generate_requests needs at least one request; got an empty list")
        for i, request in enumerate(requests):
            try:
                self.check_prompts([request.prompt], request.max_new_tokens)
            except ValueError as exc:
                raise ValueError(f"request {i}: {exc}") from None
        decoder = self._continuous_decoder()
        stop_ids = sorted({*(() if sampling.ignore_eos else self.eos_token_ids), *sampling.stop_token_ids})
        use_graphs = self._use_graphs and decoder is self._decoder
        with self._decode_runner(self._slot_graphs, decoder, use_graphs) as runner:
            outputs, stats = generate_in_slots(
                decoder,
                runner,
                requests,
                sampling,
                stop_token_ids=stop_ids,
                pad_token_id=self.pad_token_id,
                slots=self.max_running if max_running is None else max_running,
                refill_every=self.refill_every if refill_every is None else refill_every,
                weights_key=self._weights_key(),
                guard=step_guard or contextlib.nullcontext,
                make_sampler=make_sampler,
                first_token=first_token,
                until=until,
            )
        self.last_slot_stats = stats
        return [
            GenerationOutput(prompt_position=i, token_ids=ids, log_probs=logps, finish_reason=reason)
            for i, (ids, logps, reason) in enumerate(outputs)
        ]

    def _continuous_decoder(self) -> LlamaStaticDecoder:
        if self._decoder is not None:
            return self._decoder
        if self._slot_decoder is None:
            reason = unsupported_reason(self.model)
            if reason is not None:
                raise ValueError(
                    f"per-request max_new_tokens and stop need the static decoder, which does not support "
                    f"this model: {reason}; give every request the same sampling.max_new_tokens instead"
                )
            self._slot_decoder = LlamaStaticDecoder(self.model)
        return self._slot_decoder

    def _generate_loop(self, call: _Call) -> _Outputs:
        """The Hugging Face forward with its dynamic cache, one Python iteration per token."""
        sampling, dev = call.sampling, self.device
        input_ids, mask = call.input_ids, call.mask
        batch = input_ids.shape[0]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(call.stop_ids, dtype=torch.long, device=dev)
        # The cache object is filled in place by every forward pass.
        cache_arg = {self._cache_kwarg: _new_cache()}
        # SDPA_BACKENDS leaves out cuDNN attention: on an H200 (torch 2.11) its kernel is not bit-for-bit
        # repeatable, so the same seed drew different samples twice (benchmarks/decode_determinism.py).
        with call.guard(), sdpa_kernel(SDPA_BACKENDS):
            out = self.model(
                input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **cache_arg
            )
        logits = out.logits[:, -1, :]
        last_pos = positions[:, -1]

        tokens_out = torch.empty((batch, sampling.max_new_tokens), dtype=torch.long, device=dev)
        logps_out = torch.empty((batch, sampling.max_new_tokens), dtype=torch.float32, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        lengths = torch.full((batch,), sampling.max_new_tokens, dtype=torch.long, device=dev)
        for t in range(sampling.max_new_tokens):
            tokens, logp = sample_tokens(logits, sampling, call.generator)
            tokens = torch.where(finished, torch.full_like(tokens, self.pad_token_id), tokens)
            tokens_out[:, t] = tokens
            logps_out[:, t] = logp
            hit = ~finished & torch.isin(tokens, stop_ids)
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            finished = finished | hit
            if t + 1 == sampling.max_new_tokens or bool(finished.all()):
                break
            if _stops_early(call.until, t, finished, lengths):
                lengths = torch.where(finished, lengths, torch.full_like(lengths, t + 1))
                break
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=dev)], dim=1)
            last_pos = last_pos + 1
            with call.guard(), sdpa_kernel(SDPA_BACKENDS):
                out = self.model(
                    input_ids=tokens[:, None],
                    attention_mask=mask,
                    position_ids=last_pos[:, None],
                    use_cache=True,
                    **cache_arg,
                )
            logits = out.logits[:, -1, :]
        return tokens_out.cpu(), logps_out.cpu(), lengths.cpu(), finished.cpu()

    def _generate_static(self, call: _Call, decoder: LlamaStaticDecoder) -> _Outputs:
        """The static KV cache; on CUDA each decode step is a graph replay (see ``static_decode``).

        The same tokens as :meth:`_generate_loop` for the same seed wherever the two forward passes
        agree on the logits' order (sampling noise is drawn the same way; see ``pick_with_noise``).
        """
        with self._decode_runner(self._graphs, decoder, self._use_graphs) as runner:
            return self._static_with(call, decoder, runner)

    @contextlib.contextmanager
    def _decode_runner(
        self, kept: DecodeGraphs | None, decoder: LlamaStaticDecoder, use_graphs: bool
    ) -> Iterator[DecodeGraphs]:
        """The decode buffers and graphs a static call runs on: ``kept`` (the core's, reused across
        calls) when no other call holds them, else a set of the call's own. On the way out: the graphs'
        capture time counted, and, when the call succeeded, the decode path it took."""
        # One generate call at a time owns the kept buffers; a concurrent call gets its own.
        own = self._graphs_lock.acquire(blocking=False)
        try:
            runner = (kept if own else None) or DecodeGraphs(decoder, use_graphs=use_graphs)
            captured = runner.capture_seconds
            try:
                yield runner
            finally:
                self.graph_capture_seconds += runner.capture_seconds - captured
            self.last_decode_path = "cuda-graphs" if runner.use_graphs else "static-eager"
            self.graph_failure = runner.graph_failure
        finally:
            if own:
                self._graphs_lock.release()

    def _weights_key(self) -> tuple[int, ...]:
        """Where the model's tensors live: captured decode graphs read these addresses, so a runner
        given another key (a reload reallocated them) drops its buffers and graphs."""
        return tuple(t.data_ptr() for t in self.model.state_dict().values())

    def _static_with(self, call: _Call, decoder: LlamaStaticDecoder, runner: DecodeGraphs) -> _Outputs:
        sampling, dev, pad = call.sampling, self.device, self.pad_token_id
        max_new = sampling.max_new_tokens
        rows, width = call.input_ids.shape
        if len(call.stop_ids) > STOP_SLOTS:
            raise ValueError(
                f"at most {STOP_SLOTS} stop tokens (eos included) are supported, got {len(call.stop_ids)}: "
                "shorten sampling.stop_token_ids"
            )
        capacity = round_up(width + max_new - 1, KV_BLOCK)
        b = runner.prepare(batch_bucket(rows), capacity, max_new, self._weights_key())
        capacity = b.capacity
        valid = call.mask.bool()

        # Prefill (eager), rows [0, rows) of the cache.
        positions = (call.mask.cumsum(-1) - 1).clamp(min=0)
        with call.guard(), sdpa_kernel(SDPA_BACKENDS):
            logits = decoder.forward(
                call.input_ids, positions, b, decoder.prefill_bias(valid), width, col=None
            ).float()
        tok0, logp0 = first_token(logits, sampling, call.generator)

        # The decode state: rows past ``rows`` pad the batch bucket; they are finished from the start
        # and attend to one (zero) cache column.
        b.valid.zero_()
        b.valid[:rows, :width] = valid
        b.valid[rows:, width - 1] = True
        stop = torch.tensor(call.stop_ids, dtype=torch.long, device=dev)
        b.stop_ids.fill_(-1)
        b.stop_ids[: len(call.stop_ids)] = stop
        hit0 = (tok0[:, None] == stop[None, :]).any(dim=-1)
        b.tokens_out[:rows, 0] = tok0
        b.logps_out[:rows, 0] = logp0
        b.finished.fill_(True)
        b.finished[:rows] = hit0
        b.lengths.fill_(max_new)
        b.lengths[:rows] = torch.where(hit0, 1, max_new)
        b.tok.fill_(pad)
        b.tok[:rows] = tok0
        b.pos.zero_()
        b.pos[:rows] = positions[:, -1] + 1
        b.col.fill_(width)
        b.step.fill_(1)

        sampler = make_sampler(sampling)
        sampling_key = (sampling.temperature, sampling.top_k, sampling.top_p)
        greedy = sampling.temperature == 0.0
        done = max_new == 1 or bool(hit0.all())
        t = 1
        while not done:
            if not greedy:
                b.noise[:rows].exponential_(1, generator=call.generator)
            with call.guard():
                runner.step(kv_bucket(width + t, capacity), sampling_key, sampler, pad)
            t += 1
            done = t == max_new or (
                stop_check_due(t - 1)
                and (
                    bool(b.finished[:rows].all())
                    or _stops_early(call.until, t - 1, b.finished[:rows], b.lengths[:rows])
                )
            )
        finished = b.finished[:rows]
        # An early stop: the unfinished rows made t tokens each (at max_new the same as their limit).
        lengths = torch.where(finished, b.lengths[:rows], torch.full_like(b.lengths[:rows], t))
        return (
            b.tokens_out[:rows, :max_new].cpu(),
            b.logps_out[:rows, :max_new].cpu(),
            lengths.cpu(),
            finished.cpu(),
        )

    def warm_up(
        self,
        rows: int,
        max_prompt_tokens: int,
        sampling: SamplingConfig,
        step_guard: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> bool:
        """Capture, ahead of the first real call, the decode graphs a batch call of ``rows`` rows with
        ``sampling`` will replay: on the buffers such calls reuse (``DecodeGraphs.prepare``: the batch
        bucket of ``rows``, the cache capacity a prompt of ``max_prompt_tokens`` with
        ``sampling.max_new_tokens`` needs, at least as many output columns), one decode step per KV
        bucket up to that capacity -- the first step of a bucket is the one that runs eagerly and is
        captured (``DecodeGraphs``) -- so a few dozen steps however long the responses may be.

        Nothing a later call returns changes: no random state is read (the sampling noise buffer is
        filled with ones), a real call sets every decode buffer it reads before its prefill, and the
        cache columns the steps wrote hold finite values its mask leaves out; its attention spans the
        same KV buckets (``kv_bucket`` does not depend on the capacity). False (nothing done) on the
        loop path, which keeps nothing between calls."""
        if self._decoder is None or self._graphs is None:
            return False
        if rows < 1 or max_prompt_tokens < 1:
            raise ValueError(
                f"warm_up needs rows >= 1 and max_prompt_tokens >= 1, got {rows}, {max_prompt_tokens}"
            )
        columns = max_prompt_tokens + sampling.max_new_tokens - 1
        if self.max_positions is not None:
            columns = min(columns, self.max_positions - 1)
        last_position = (self.max_positions or columns + 1) - 1
        sampler = make_sampler(sampling)
        sampling_key = (sampling.temperature, sampling.top_k, sampling.top_p)
        guard = step_guard or contextlib.nullcontext
        decoder, pad = self._decoder, self.pad_token_id
        with self._decode_runner(self._graphs, decoder, self._use_graphs) as runner:
            # The buffers a call of `rows` one-token prompts decoding `columns` tokens would take.
            b = runner.prepare(batch_bucket(rows), round_up(columns, KV_BLOCK), columns, self._weights_key())
            b.valid.zero_()
            b.finished.fill_(False)
            b.tok.fill_(pad)
            b.noise.fill_(1.0)
            b.stop_ids.fill_(-1)
            b.lengths.fill_(b.max_new)
            for i, kv_len in enumerate(range(KV_BLOCK, b.capacity + 1, KV_BLOCK)):
                # Each step writes the bucket's last column, which it then attends to (finite scores).
                b.col.fill_(kv_len - 1)
                b.pos.fill_(min(kv_len - 1, last_position))
                b.step.fill_(i)
                with guard():
                    runner.step(kv_len, sampling_key, sampler, pad)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return True

    def drop_decode_state(self) -> None:
        """Frees the kept KV cache and decode graphs (the engine calls this when it releases memory)."""
        with self._graphs_lock:
            for kept in (self._graphs, self._slot_graphs):
                if kept is not None:
                    kept.drop()

    # -- weights -----------------------------------------------------------------------------------
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters and persistent buffers in Hugging Face names."""
        return list(self.model.state_dict().items())

    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]] | Any) -> None:
        params = dict(self.model.state_dict())
        for name, tensor in named:
            if name not in params:
                raise ValueError(f"weight {name!r} is not a tensor of this model")
            params[name].copy_(tensor.to(device=params[name].device, dtype=params[name].dtype))


def _stops_early(until: EarlyStop | None, t: int, finished: torch.Tensor, lengths: torch.Tensor) -> bool:
    """Whether ``until`` ends a batch call after its token ``t`` (0-based) at one of the stop checks:
    ``finished`` and ``lengths`` are the rows' flags and finished lengths so far."""
    if until is None or not stop_check_due(t):
        return False
    made = torch.where(finished, lengths, torch.full_like(lengths, t + 1))
    return until.reached(int(finished.sum()), int(made.sum()))


def _own_storage(model: torch.nn.Module) -> None:
    """Give every tensor its own resizable storage.

    On CPU, ``from_pretrained`` leaves tensors backed by the memory-mapped safetensors file; memory
    backends cannot release such storage, and a weight update must not write into the file mapping.
    """
    for module in model.modules():
        for _, param in module.named_parameters(recurse=False):
            param.data = param.data.clone()
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                module._buffers[name] = buf.clone()


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()
