"""Per-request generation over the engines: ``await client.generate(ids, sampling)``, continuous.

Rollout functions ask for one prompt's continuation at a time; the client batches what is waiting.
Whenever an engine is idle and requests wait, the waiting requests with the same sampling -- their
``max_new_tokens`` and stop strings aside: a call carries one limit and one
:class:`~ppo_rollout.stops.RequestStop` per request -- go out together, split into
contiguous, near-equal chunks over the idle engines (one ``generate`` call each); when a call
returns, its requests' futures resolve and the next waiting requests go out. So
a trajectory that waits for its environment never holds the engines: the others' requests keep them
busy.

Seeds: engine ``j``'s ``d``-th call of a client draws from ``call_seed(base, step, j, stream, d)``,
a fixed function of the run's seed. Requests made together (every rollout function's first turn
is submitted before the event loop runs the client's dispatch) go out as one wave, exactly as one
batch call per engine.

Later calls depend on ``order`` (``rollout.multi_turn.turn_order``):

- ``"fixed"`` (the default): requests go out in waves. The rollout's participants (each prompt's
  rollout function; with ``multi_turn``, each sample's trajectory: :meth:`GenerateClient.fork`) are
  known to the client; a wave goes out once the engines are idle and every participant still running
  has a request waiting, sorted by participant (prompt, sample), then by arrival within one. No batch
  depends on how fast an environment answered, so a run with the same seed gives the same numbers.
- ``"arrival"``: waiting requests go out whenever an engine is idle, in arrival order: the engines
  never wait for a slow environment, but the batches (and so the samples) vary from run to run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from .config import SamplingConfig
from .engine.core import GenerationOutput
from .engine.early_stop import EarlyStop, StopRule
from .engine.handles import Waiter
from .participant import PARTICIPANT, Key
from .stops import RequestStop

__all__ = ["BatchGenerator", "GenerateClient", "Generated", "call_seed"]


class BatchGenerator(Protocol):
    """What the client needs of an engine (``engine.handles.EngineHandle`` is one): a batch call."""

    def submit_generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[RequestStop] | None = None,
        until: EarlyStop | None = None,
    ) -> Waiter: ...


def call_seed(base: int, step: int, engine: int, stream: int = 0, call: int = 0) -> int:
    """The seed of engine ``engine``'s ``call``-th generate call of ``step``: resumed runs sample alike."""
    mixed = base * 1_000_003 + step * 7_919 + engine * 104_729 + stream * 15_485_863 + call * 49_979_687
    return mixed % (2**62)


@dataclass(frozen=True)
class Generated:
    """One continuation, with the engine that produced it (its weight version is that engine's)."""

    token_ids: tuple[int, ...]
    log_probs: tuple[float, ...]
    finish_reason: str  # "stop" (eos or a stop token) or "length"
    engine: int


@dataclass
class _Pending:
    ids: list[int]
    sampling: SamplingConfig  # seed 0 and max_new_tokens 1: the key requests are batched by
    max_new_tokens: int
    stop: RequestStop
    future: asyncio.Future[list[Generated]]
    key: Key = ()
    arrival: int = 0


class GenerateClient:
    """Requests to ``engines`` from one asyncio event loop (create and use it inside that loop).

    ``timeout_s`` bounds each engine call. ``busy_seconds[j]`` and ``calls[j]`` count engine ``j``'s
    work through this client.
    """

    def __init__(
        self,
        engines: Sequence[BatchGenerator],
        *,
        seed: int,
        step: int,
        stream: int,
        timeout_s: float,
        order: Literal["fixed", "arrival"] = "arrival",
    ) -> None:
        if not engines:
            raise ValueError("GenerateClient needs at least one engine")
        self._engines = list(engines)
        self._seed, self._step, self._stream = seed, step, stream
        self._timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()
        self._queue: list[_Pending] = []
        self._busy = [False] * len(engines)
        self._flush_scheduled = False
        self._pool = concurrent.futures.ThreadPoolExecutor(len(engines), thread_name_prefix="generate")
        self._in_flight: set[asyncio.Future[list[GenerationOutput]]] = set()
        self.calls = [0] * len(engines)
        self.busy_seconds = [0.0] * len(engines)
        self.order = order  # may be set before the first request
        # rollout.partial: each engine call may end once its share of the phase's budget is reached
        self.stop_rule: StopRule | None = None
        self._participants: set[Key] = set()
        self._arrivals = itertools.count()

    # -- participants (turn_order: fixed) --------------------------------------------------------------
    def join(self, key: Key) -> None:
        """``key`` takes part: a fixed-order wave waits for its request (until it :meth:`leave` s)."""
        self._participants.add(key)

    def leave(self, key: Key) -> None:
        """``key`` makes no more requests (idempotent)."""
        if key in self._participants:
            self._participants.discard(key)
            self._schedule_flush()

    def fork(self, parent: Key, children: Sequence[Key]) -> None:
        """``parent`` hands its part to ``children`` (a prompt's samples, each its own trajectory)."""
        self._participants.update(children)
        self.leave(parent)

    async def generate(
        self, ids: Sequence[int], sampling: SamplingConfig, stop: RequestStop | None = None
    ) -> list[Generated]:
        """``sampling.n_samples_per_prompt`` continuations of ``ids`` (``sampling.seed`` is not used:
        the client seeds each engine call). ``stop``: what the engine may stop each continuation at
        (a continuation ends with the stop's tokens; the caller cuts at the stop string itself)."""
        if not ids:
            raise ValueError("generate needs a non-empty list of input ids")
        future: asyncio.Future[list[Generated]] = self._loop.create_future()
        key = replace(sampling, seed=0, max_new_tokens=1)
        self._queue.append(
            _Pending(
                [int(t) for t in ids],
                key,
                sampling.max_new_tokens,
                stop or RequestStop(),
                future,
                PARTICIPANT.get(),
                next(self._arrivals),
            )
        )
        self._schedule_flush()
        return await future

    # -- dispatch ------------------------------------------------------------------------------------
    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        idle = [j for j, busy in enumerate(self._busy) if not busy]
        if not idle or not self._queue or not self._wave_ready(idle):
            return
        batch = self._take_batch()
        bounds = [round(k * len(batch) / len(idle)) for k in range(len(idle) + 1)]
        for k, j in enumerate(idle):
            chunk = batch[bounds[k] : bounds[k + 1]]
            if chunk:
                self._dispatch(j, chunk, len(batch))
        if self._queue and any(not b for b in self._busy):
            self._schedule_flush()

    def _wave_ready(self, idle: list[int]) -> bool:
        """Arrival order: always. Fixed order: every engine idle, every participant's request waiting
        (the queue then sorted by participant and arrival)."""
        if self.order == "arrival":
            return True
        if len(idle) < len(self._busy) or not self._participants <= {p.key for p in self._queue}:
            return False
        self._queue.sort(key=lambda p: (p.key, p.arrival))
        return True

    def _take_batch(self) -> list[_Pending]:
        """Every waiting request with the first one's sampling, in arrival order."""
        key = self._queue[0].sampling
        batch = [p for p in self._queue if p.sampling == key]
        self._queue = [p for p in self._queue if p.sampling != key]
        return batch

    def _dispatch(self, engine: int, chunk: list[_Pending], wave: int) -> None:
        limits = [p.max_new_tokens for p in chunk]
        sampling = replace(chunk[0].sampling, max_new_tokens=max(limits))
        seed = call_seed(self._seed, self._step, engine, self._stream, self.calls[engine])
        self.calls[engine] += 1
        self._busy[engine] = True
        prompts = [p.ids for p in chunk]
        # Only what the call needs: one limit and no stops is the engine's plain batch call.
        options: dict[str, Any] = {}
        if len(set(limits)) > 1:
            options["max_new_tokens"] = limits
        if any(p.stop for p in chunk):
            options["stop"] = [p.stop for p in chunk]
        if self.stop_rule is not None:
            n = sampling.n_samples_per_prompt
            options["until"] = self.stop_rule.for_call(len(chunk) * n, wave * n)
        waiter = self._engines[engine].submit_generate(prompts, sampling, seed, **options)
        started = time.perf_counter()
        future = self._loop.run_in_executor(self._pool, waiter, self._timeout_s)
        self._in_flight.add(future)
        future.add_done_callback(functools.partial(self._done, engine, chunk, started))

    def _done(
        self,
        engine: int,
        chunk: list[_Pending],
        started: float,
        future: asyncio.Future[list[GenerationOutput]],
    ) -> None:
        self._in_flight.discard(future)
        self._busy[engine] = False
        self.busy_seconds[engine] += time.perf_counter() - started
        error = future.exception() if not future.cancelled() else asyncio.CancelledError()
        if error is not None:
            for pending in chunk:
                if not pending.future.done():
                    pending.future.set_exception(error)
        else:
            outputs = future.result()
            per_request: list[list[Generated]] = [[] for _ in chunk]
            for out in outputs:
                per_request[out.prompt_position].append(
                    Generated(out.token_ids, out.log_probs, out.finish_reason, engine)
                )
            for pending, generated in zip(chunk, per_request, strict=True):
                if not pending.future.done():
                    pending.future.set_result(generated)
        self._schedule_flush()

    # -- the end -------------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Waits for the engine calls still running (after a failure: none may outlive the step)."""
        for pending in self._queue:
            pending.future.cancel()
        self._queue = []
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=self._timeout_s)

    def close(self) -> None:
        # With no call in flight its threads end at once: waited for, so none outlives the step holding
        # the last reference to a Ray object (freed after ray.shutdown(), it ends the process: "The core
        # worker has already been shutdown"). A call still in flight (a failure) is not waited for.
        self._pool.shutdown(wait=not any(not f.done() for f in self._in_flight), cancel_futures=True)

    def idle_share(self, wall_seconds: float) -> float:
        """The share of ``wall_seconds`` x engines in which no call of this client ran on an engine."""
        capacity = wall_seconds * len(self._engines)
        return max(0.0, 1.0 - sum(self.busy_seconds) / capacity) if capacity > 0 else 0.0
