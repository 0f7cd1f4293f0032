"""Keeps the static decoder's buffers and its captured decode steps between generate calls.

A graph records the addresses of every tensor it touches: the decode buffers, the weights. The
buffers are kept here for as long as the batch bucket, capacity and weight addresses stay the same
(weight updates copy in place, so they keep the graphs); anything else drops them all. The first
step of a KV bucket runs eagerly -- it is also the warm-up CUDA graphs need before capture -- and is
captured right after, so later steps of that bucket, in this call and the next ones, replay it.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .static_decode import DecodeBuffers, LlamaStaticDecoder, Sampler

__all__ = ["SDPA_BACKENDS", "DecodeGraphs"]

# Attention kernels for both decode paths: both take an additive mask, are capture-safe and repeat bit
# for bit. cuDNN's is left out: its plans are built per shape at first use, which a capture must not do,
# and on an H200 (torch 2.11) it gave different samples for the same seed twice in the decode loop
# (164 of 256 samples repeated; EFFICIENT and MATH alone: 256 of 256; benchmarks/decode_determinism.py).
SDPA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DecodeGraphs:
    """Decode buffers for one (batch bucket, capacity) and the graphs captured over them."""

    def __init__(self, decoder: LlamaStaticDecoder, use_graphs: bool) -> None:
        self.decoder = decoder
        self.use_graphs = use_graphs and decoder.device.type == "cuda"
        self.graph_failure: str | None = None  # why capture was given up, if it was
        self.captures = 0  # graphs captured over this object's life (tests, benchmarks)
        self.capture_seconds = 0.0  # what capturing them took (the engine's start-up and step budget)
        self.buffers: DecodeBuffers | None = None
        self._weights_key: Hashable = None
        self._graphs: dict[tuple[int, Hashable], Any] = {}
        self._pool: Any = None
        self._stream: Any = None

    def prepare(
        self, batch: int, capacity: int, max_new: int, weights_key: Hashable, per_row: bool = False
    ) -> DecodeBuffers:
        """Buffers for ``batch`` rows, at least ``capacity`` cache columns and ``max_new`` tokens
        (``per_row``: the continuous-batching form, see ``DecodeBuffers``)."""
        b = self.buffers
        if (
            b is None
            or b.per_row != per_row
            or b.batch != batch
            or b.capacity < capacity
            or b.max_new < max_new
            or weights_key != self._weights_key
        ):
            self.drop()
            self.buffers = b = self.decoder.allocate(batch, capacity, max_new, per_row=per_row)
            self._weights_key = weights_key
        return b

    def step(self, kv_len: int, sampling_key: Hashable, sampler: Sampler, pad_token_id: int) -> None:
        """One decode step on :attr:`buffers` (see ``LlamaStaticDecoder.decode_step``)."""
        b = self.buffers
        if b is None:
            raise RuntimeError("DecodeGraphs.step before prepare")
        if not self.use_graphs:
            with sdpa_kernel(SDPA_BACKENDS):
                self.decoder.step(b, kv_len, sampler, pad_token_id)
            return
        graph = self._graphs.get((kv_len, sampling_key))
        if graph is not None:
            graph.replay()
            return
        self._run_then_capture(b, kv_len, sampling_key, sampler, pad_token_id)

    def _run_then_capture(
        self, b: DecodeBuffers, kv_len: int, sampling_key: Hashable, sampler: Sampler, pad_token_id: int
    ) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.decoder.device)
            self._pool = torch.cuda.graph_pool_handle()
        stream = self._stream
        # The real step, run eagerly on the capture stream: also the warm-up before capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), sdpa_kernel(SDPA_BACKENDS):
            self.decoder.step(b, kv_len, sampler, pad_token_id)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        t0 = time.perf_counter()
        try:
            # Capture records kernels without running them: the buffers are left as the step left them.
            # thread_local: a weight receiver's thread may use the GPU meanwhile.
            with (
                torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"),
                sdpa_kernel(SDPA_BACKENDS),
            ):
                self.decoder.step(b, kv_len, sampler, pad_token_id)
        except RuntimeError as exc:
            # Decode on without graphs (slower, same outputs) rather than fail the rollout.
            self.graph_failure = f"{type(exc).__name__}: {exc}"
            self.use_graphs = False
            self._graphs.clear()
            return
        finally:
            self.capture_seconds += time.perf_counter() - t0
        self._graphs[(kv_len, sampling_key)] = graph
        self.captures += 1

    def drop(self) -> None:
        """Frees the buffers (the KV cache) and every graph."""
        self._graphs.clear()
        self.buffers = None
        self._weights_key = None
