"""A server engine's early stop (``rollout.partial`` on SGLang and vLLM): a call generated in chunks.

An inference server answers a generate call once every request in it has finished; it cannot end the
call at a budget as the built-in engine does (``early_stop``). So :func:`generate_in_chunks` generates
such a call in chunks: each chunk is one generate call of every unfinished sample, its input ids the
prompt and the sample's tokens so far, its limit ``min(chunk_tokens, tokens left)``. After each chunk
the call's finished samples and the tokens it made are counted against the :class:`EarlyStop`; once it
is reached no further chunk goes out, and the unfinished samples return their tokens and log-probs so
far with finish reason :data:`PAUSED`. Every sample takes part from the first chunk. The checks are the
chunks' ends, so where a call ends is a fixed function of its inputs and seed, as on the built-in
engine. A chunk's prefill of the tokens so far finds them in the server's prefix cache (SGLang's radix
cache, vLLM's prefix caching) when the cache still holds them.

Not SGLang's ``/abort_request``. In SGLang 0.5.17 (the release's ``sglang/srt/managers/``) an aborted
request that is running ends one decode step later through the ordinary output path
(``scheduler.py`` ``abort_request``: ``req.to_finish = FINISH_ABORT()``), while one waiting in the
queue answers from the tokenizer manager with the tokens forwarded to it so far (``tokenizer_manager.py``
``_handle_abort_req``: ``state.output_ids``; a request that is not streamed is forwarded every
``SGLANG_FORCE_STREAM_INTERVAL`` tokens only), and where an abort lands depends on timing. Chunks keep
every token and its log-prob, need nothing of a server but ``input_ids`` and a token limit, and run
alike on SGLang and vLLM.

Seeds: chunk 0 is seeded as the plain call would be (``seed``), chunk ``c`` with
:func:`chunk_seed` ``(seed, c)``; within a chunk each sample gets its own seed as the server's client
derives it. A fresh seed per chunk is what a continuation needs on every server: vLLM's seeded sampling
starts a generator from the request's seed, so a chunk seeded as the one before would draw the same
noise again; SGLang 0.5.17 hashes seeded noise by token position (``layers/sampler.py``
``multinomial_with_seed``), so either would do there. The built-in engine draws all of a sample's tokens
of one call from one stream (``continuous.row_seed``); its continuation at a later round or step is a
new call with a new seed, as a server's is.

Stop strings: a server matches them on each chunk's output alone. One that spans two chunks is found
here by the token sequences that spell it (:class:`~ppo_rollout.stops.RequestStop`, as the built-in
engine matches them), and the rollout still cuts each turn at the first stop string of its text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ..config import SamplingConfig
from ..stops import RequestStop
from .core import GenerationOutput
from .early_stop import PAUSED, EarlyStop

__all__ = ["ChunkGenerate", "chunk_seed", "generate_in_chunks"]

ChunkGenerate = Callable[..., list[GenerationOutput]]
"""A server client's ``generate(prompts, sampling, seed, *, max_new_tokens, stop)``."""


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` of a call seeded ``seed`` (chunk 0: ``seed`` itself)."""
    return seed if chunk == 0 else (seed * 1_000_003 + chunk * 2_654_435_761) % (2**62)


@dataclass
class _Sample:
    """One sample of the call: its prompt, limit, stops, and what its chunks made so far."""

    prompt: list[int]
    limit: int
    stop: RequestStop
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reason: str | None = None  # None: unfinished

    def add(self, out: GenerationOutput, engine: str) -> None:
        """A chunk's output: its tokens appended; finished at a stop, at the limit, or at a stop string
        that spans the chunks (cut after it)."""
        before = len(self.tokens)
        self.tokens += out.token_ids
        self.log_probs += out.log_probs
        stopped = out.finish_reason == "stop"
        end = None if stopped else _spanning_stop(self.tokens, before, self.stop.token_ids)
        if end is not None:
            del self.tokens[end:], self.log_probs[end:]
        if stopped or end is not None:
            self.reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.reason = "length"
        elif not out.token_ids:
            raise RuntimeError(
                f"engine {engine}: a chunk came back without tokens and unfinished "
                f"({out.finish_reason!r}); the server must make at least one token per request"
            )


def _spanning_stop(tokens: list[int], boundary: int, sequences: Sequence[Sequence[int]]) -> int | None:
    """The end of the first stop sequence that starts before ``boundary`` and ends after it (None:
    none); one inside a chunk the server has matched already."""
    ends = []
    for seq in sequences:
        n = len(seq)
        for end in range(boundary + 1, min(boundary + n, len(tokens) + 1)):
            if end - n >= 0 and tokens[end - n : end] == list(seq):
                ends.append(end)
                break
    return min(ends, default=None)


def generate_in_chunks(
    generate: ChunkGenerate,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    seed: int,
    until: EarlyStop,
    *,
    max_new_tokens: Sequence[int] | None = None,
    stop: Sequence[RequestStop] | None = None,
    engine: str = "",
) -> list[GenerationOutput]:
    """``n_samples_per_prompt`` samples of each prompt (consecutive, in prompt order), generated in
    chunks of ``until.chunk_tokens`` tokens until every sample finished or ``until`` is reached; the
    unfinished ones with finish reason :data:`PAUSED`."""
    n = sampling.n_samples_per_prompt
    limits = [sampling.max_new_tokens] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
    stops = [RequestStop()] * len(prompts) if stop is None else list(stop)
    if len(limits) != len(prompts) or len(stops) != len(prompts):
        raise ValueError(f"max_new_tokens and stop need one entry per prompt ({len(prompts)} prompts)")
    samples = [
        _Sample([int(t) for t in p], int(limits[i]), stops[i])
        for i, p in enumerate(prompts)
        for _ in range(n)
    ]
    one = replace(sampling, n_samples_per_prompt=1)
    chunk = 0
    while todo := [s for s in samples if s.reason is None]:
        options: dict[str, object] = {
            "max_new_tokens": [min(until.chunk_tokens, s.limit - len(s.tokens)) for s in todo]
        }
        if any(s.stop.strings for s in todo):
            options["stop"] = [list(s.stop.strings) for s in todo]
        prompts_now = [[*s.prompt, *s.tokens] for s in todo]
        outputs = generate(prompts_now, one, chunk_seed(seed, chunk), **options)
        if len(outputs) != len(todo):
            raise RuntimeError(f"engine {engine}: {len(outputs)} outputs for a chunk of {len(todo)} samples")
        for sample, out in zip(todo, outputs, strict=True):
            sample.add(out, engine)
        chunk += 1
        finished = sum(s.reason is not None for s in samples)
        if until.reached(finished, sum(len(s.tokens) for s in samples)):
            break
    return [
        GenerationOutput(k // n, tuple(s.tokens), tuple(s.log_probs), s.reason or PAUSED)
        for k, s in enumerate(samples)
    ]
