"""TensorEngine: an engine that only holds weights, with SGLang's weight operations.

It stands in for a rollout engine wherever the weights, not generation, are what is tested: as a plain
object, as a Ray actor (``ray.remote(TensorEngine).options(max_concurrency=4)``), or behind
:mod:`ppo_weight_sync.testing.http_engine`. ``pause_generation`` and friends only record state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ppo_weight_sync.buckets import checksum, dtype_from_name
from ppo_weight_sync.device_sync import on_device, wait_stream
from ppo_weight_sync.ops import EngineOps, EngineReply
from ppo_weight_sync.receiver import WeightReceiver
from ppo_weight_sync.receiving_engine import ReceivingEngine

__all__ = ["Spec", "TensorEngine", "llama_like_spec", "make_weights"]

Spec = Mapping[str, tuple[str, Sequence[int]]]  # name -> (dtype name, shape); JSON-friendly


def make_weights(spec: Spec, seed: int | None, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic weights for ``spec``: the same seed gives the same bytes in every process.

    ``seed=None`` gives zeros, allocated straight on ``device`` (fast for large specs).
    """
    out: dict[str, torch.Tensor] = {}
    if seed is None:
        for name, (dtype, shape) in spec.items():
            out[name] = torch.zeros(tuple(shape), dtype=dtype_from_name(dtype), device=device)
        return out
    gen = torch.Generator().manual_seed(seed)
    for name, (dtype, shape) in spec.items():
        t = torch.randn(tuple(shape), generator=gen, dtype=torch.float32)
        out[name] = t.to(dtype_from_name(dtype)).to(device)
    return out


def llama_like_spec(
    layers: int, hidden: int, intermediate: int, vocab: int, dtype: str = "bfloat16", kv_heads_ratio: int = 4
) -> dict[str, tuple[str, list[int]]]:
    """Hugging Face Llama names and shapes: embeddings, per-layer attention/MLP/norms, final norm, head."""
    kv = hidden // kv_heads_ratio
    spec: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": (dtype, [vocab, hidden])}
    for i in range(layers):
        p = f"model.layers.{i}."
        spec[p + "input_layernorm.weight"] = (dtype, [hidden])
        spec[p + "self_attn.q_proj.weight"] = (dtype, [hidden, hidden])
        spec[p + "self_attn.k_proj.weight"] = (dtype, [kv, hidden])
        spec[p + "self_attn.v_proj.weight"] = (dtype, [kv, hidden])
        spec[p + "self_attn.o_proj.weight"] = (dtype, [hidden, hidden])
        spec[p + "post_attention_layernorm.weight"] = (dtype, [hidden])
        spec[p + "mlp.gate_proj.weight"] = (dtype, [intermediate, hidden])
        spec[p + "mlp.up_proj.weight"] = (dtype, [intermediate, hidden])
        spec[p + "mlp.down_proj.weight"] = (dtype, [hidden, intermediate])
    spec["model.norm.weight"] = (dtype, [hidden])
    spec["lm_head.weight"] = (dtype, [vocab, hidden])
    return spec


class TensorEngine(ReceivingEngine):
    """Holds ``spec``'s weights (initialised from ``seed``) and receives updates through a WeightReceiver."""

    def __init__(
        self,
        spec: Spec,
        *,
        seed: int | None = 0,
        device: str = "cpu",
        timeout_s: float = 60.0,
        load_delay_s: float = 0.0,
    ) -> None:
        """``load_delay_s``: sleep this long per loaded batch, so tests can interrupt an update midway."""
        torch.set_num_threads(1)
        self.load_delay_s = load_delay_s
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" means this process's current GPU (Ray sets CUDA_VISIBLE_DEVICES to the actor's own).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeout_s
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # this thread only: server threads use on_device() below
        self.weights = make_weights(spec, seed, self.device)
        self.paused = False
        self.flushes = 0
        self.receiver = WeightReceiver(
            self._load, self._expected, self.device, on_flush_cache=self._on_flush, timeout_s=timeout_s
        )

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``named`` into the held weights (KeyError for a name not held, RuntimeError for a shape)."""
        self._load(named)

    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        for name, tensor in named:
            self.weights[name].copy_(tensor)

    def _expected(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (t.dtype, tuple(t.shape)) for n, t in self.weights.items()}

    def _on_flush(self) -> None:
        self.flushes += 1

    # The engine operations (EngineOps): the weight operations are ReceivingEngine's -----------

    def pause_generation(self) -> EngineReply:
        self.paused = True
        return EngineReply.ok("Generation paused.")

    def continue_generation(self) -> EngineReply:
        self.paused = False
        return EngineReply.ok("Generation continued.")

    def flush_cache(self) -> EngineReply:
        self._on_flush()
        return EngineReply.ok("Cache flushed.")

    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        return EngineReply.ok("nothing to release: this engine only holds weights")

    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        return EngineReply.ok("nothing to resume: this engine only holds weights")

    def set_spec(self, spec: Spec, seed: int | None = None) -> None:
        """Hold ``spec``'s weights from now on (``seed=None``: zeros); the group membership is kept."""
        with on_device(self.device):
            # Nothing queued may still write the old weights when their memory goes back to the cache.
            wait_stream(self.device, self.timeout_s, "set_spec: finishing queued work")
            self.weights = {}
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.weights = make_weights(spec, seed, self.device)

    def set_load_delay(self, seconds: float) -> None:
        """Sleep ``seconds`` per loaded batch from now on (tests interrupt updates midway with it)."""
        self.load_delay_s = seconds

    # Inspection (not part of the engine protocol) -------------------------------------------

    def checksum(self) -> str:
        # Called from server or actor threads (current device cuda:0 there): read on the weights' device,
        # and wait (bounded) for queued work first, so a stuck update shows as an error, not a hang.
        with on_device(self.device):
            wait_stream(self.device, self.timeout_s, "checksum: waiting for queued work on the weights")
            return checksum(self.weights.items())

    def state(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "flushes": self.flushes,
            "weight_version": self.receiver.weight_version,
            "checksum": self.checksum(),
            "ipc_mappings": self.receiver.ipc_mappings,
            "pid": os.getpid(),  # for tests that look at the process (its sockets)
        }

    def named_tensors(self) -> dict[str, torch.Tensor]:
        with on_device(self.device):
            wait_stream(self.device, self.timeout_s, "named_tensors: waiting for queued work on the weights")
            return {n: t.detach().cpu().clone() for n, t in self.weights.items()}


if TYPE_CHECKING:  # mypy checks that TensorEngine has the engine operations' exact signatures

    def _is_engine_ops(engine: TensorEngine) -> EngineOps:
        return engine
