"""The built-in rollout engine: generation, weight updates and memory release in one object.

:class:`BuiltinEngine` is a plain class (tests and benchmarks use it directly);
:data:`BuiltinEngineActor` is the same class as a Ray actor. Create the actor with
``max_concurrency >= 2`` so that the weight operations run while a ``generate`` call is in flight:
``pause_generation`` holds the generation between two decode steps (SGLang's in-place pause), the
update loads the new weights, ``continue_generation`` lets it go on with them.

Memory: the model's tensors are tracked under SGLang's tag ``"weights"`` by a ppo_lifecycle memory
backend (host copies on CPU; pinned copies or torch_memory_saver on CUDA). ``"kv_cache"`` frees the
static KV cache and decode graphs the generation core keeps between calls on CUDA (they are rebuilt by
the next ``generate``); nothing else is held under it.

Adapter-only updates (``lora``, an :class:`~ppo_rollout.config.AdapterUpdates`): an update may carry
``<module path>.lora_A.weight`` and ``.lora_B.weight`` for any linear layer instead of its weight. The
first such update of a layer copies the weight it holds (the base: loaded from ``model_path`` or sent
whole) into ``_bases``; every adapter update then sets the weight to
``merge_lora(base, A, B, alpha / rank)``, from the base, never from the previous merge. The base copies
sit on the engine's device, one per adapted layer, in the engine's dtype (the adapted weights' bytes
again: 212 MB for SmolLM2-135M's seven projections in bfloat16), and are tracked under ``"weights"``:
releasing the weights moves them off the device with the weights, resuming brings them back.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch

from ppo_lifecycle.memory import default_backend
from ppo_lifecycle.startup import SetupTimer
from ppo_lifecycle.stats import TransferStats
from ppo_weight_sync import EngineOps, EngineReply, ReceivingEngine, TensorOps, WeightReceiver, checksum
from ppo_weight_sync.lora import adapter_module, merge_lora

from .. import fault_injection
from ..config import AdapterUpdates, SamplingConfig
from .core import GenerationCore, GenerationOutput
from .early_stop import EarlyStop

__all__ = ["MEMORY_TAGS", "BuiltinEngine", "BuiltinEngineActor", "GenerationAborted"]

MEMORY_TAGS: tuple[str, ...] = ("weights", "kv_cache")


class GenerationAborted(RuntimeError):
    """A generate call ended early by :meth:`BuiltinEngine.abort_requests` (SGLang's abort)."""


class BuiltinEngine(ReceivingEngine):
    """Generates with a Hugging Face causal LM and receives weight updates through ``WeightReceiver``."""

    def __init__(
        self,
        model_path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        *,
        name: str = "builtin-engine",
        timeout_s: float = 300.0,
        torch_threads: int | None = None,
        max_running: int = 256,
        refill_every: int = 8,
        lora: AdapterUpdates | None = None,
    ) -> None:
        self._setup = SetupTimer()  # the start-up the driver reports (its imports ended here)
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.name = name
        self.timeout_s = timeout_s
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            # Inside a Ray actor the assigned GPU is the only visible one.
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device = dev
        self._memory = default_backend(dev)
        with self._setup.part("model"), self._memory.region("weights"):
            self._core = GenerationCore(
                model_path, device=dev, dtype=dtype, max_running=max_running, refill_every=refill_every
            )
        self.lora = lora
        # The base weight of each layer an adapter update reached, by module path (module docstring).
        self._bases: dict[str, torch.Tensor] = {}
        self._memory.track(
            "weights", lambda: [*self._core.model.state_dict().values(), *self._bases.values()]
        )
        self._memory.track("kv_cache", list)
        self._released: set[str] = set()
        # What release/restore moved since start-up (bytes, seconds): the driver's step budget.
        self._moved: dict[str, TransferStats] = {"release": TransferStats(), "restore": TransferStats()}
        # _step_lock is held for each forward pass and each weight load: a load never lands mid-step.
        self._step_lock = threading.Lock()
        self._cond = threading.Condition()
        self._paused = False
        self._active = 0
        self._abort_epoch = 0  # abort_requests() ends every generate call started before it
        # the weight operations (SGLang's names) are ReceivingEngine's, answered by this receiver
        self.receiver = WeightReceiver(self._load_weights, self._expected, dev, timeout_s=timeout_s)

    # -- generation --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig,
        seed: int | None = None,
        *,
        max_new_tokens: Sequence[int] | None = None,
        stop: Sequence[Sequence[Sequence[int]]] | None = None,
        until: EarlyStop | None = None,
    ) -> list[GenerationOutput]:
        """See :meth:`GenerationCore.generate` (per-prompt ``max_new_tokens`` and ``stop``, and an early
        stop, included)."""
        with self._generating("generate") as guard:
            return self._core.generate(
                prompts,
                sampling,
                seed=seed,
                step_guard=guard,
                max_new_tokens=max_new_tokens,
                stop=stop,
                until=until,
            )

    def warm_up(self, rows: int, max_prompt_tokens: int, sampling: SamplingConfig) -> dict[str, float]:
        """Capture the decode graphs of the run's batch calls before the first one
        (:meth:`GenerationCore.warm_up`; changes no later output); returns ``{"warm_up_s": seconds}``,
        0 where there is nothing to capture (the decode loop)."""
        t0 = time.perf_counter()
        with self._generating("warm_up") as guard:
            warmed = self._core.warm_up(rows, max_prompt_tokens, sampling, step_guard=guard)
        return {"warm_up_s": time.perf_counter() - t0 if warmed else 0.0}

    @contextlib.contextmanager
    def _generating(self, what: str) -> Iterator[Callable[[], contextlib.AbstractContextManager[None]]]:
        """A generation call's bracket: counted as active, its forward passes guarded by ``_step``."""
        with self._cond:
            if "weights" in self._released:
                raise RuntimeError(
                    f"engine {self.name}: weights are released; call resume_memory_occupation() before {what}"
                )
            self._active += 1
            epoch = self._abort_epoch
        try:
            yield lambda: self._step(epoch)
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def _step(self, epoch: int) -> Iterator[None]:
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._paused and epoch == self._abort_epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"engine {self.name}: generation stayed paused for {self.timeout_s:.0f} s "
                        "waiting for "
                        "continue_generation"
                    )
                self._cond.wait(left)
            if epoch != self._abort_epoch:
                raise GenerationAborted(f"engine {self.name}: generation aborted")
        with self._step_lock:
            yield

    def pause_generation(self) -> EngineReply:
        """Holds in-flight generation before its next decode step; returns once no step is running."""
        with self._cond:
            self._paused = True
        with self._step_lock:  # the step in progress, if any, has finished
            pass
        return EngineReply.ok("Generation paused.")

    def abort_requests(self) -> int:
        """Ends every generate call in flight at its next step with :class:`GenerationAborted` (SGLang's
        abort); returns how many were in flight. Later calls run normally."""
        with self._cond:
            self._abort_epoch += 1
            self._cond.notify_all()
            return self._active

    def active_requests(self) -> int:
        with self._cond:
            return self._active

    def continue_generation(self) -> EngineReply:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return EngineReply.ok("Generation continued.")

    def flush_cache(self) -> EngineReply:
        # No prefix cache is kept between requests: the static KV cache kept on CUDA is rewritten from
        # column 0 by every call, so nothing in it is ever reused.
        return EngineReply.ok("Cache flushed (the built-in engine holds no cache between requests).")

    def is_paused(self) -> bool:
        with self._cond:
            return self._paused

    # -- weights -------------------------------------------------------------------------------------
    def _expected(self) -> Mapping[str, tuple[torch.dtype, tuple[int, ...]]]:
        held = {n: (t.dtype, tuple(t.shape)) for n, t in self._core.named_tensors()}
        if self.lora is None:
            return held
        # Every 2-D weight can take adapters: lora_A is rank x in, lora_B out x rank, in the weight's dtype.
        r = self.lora.rank
        adapters: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name, (dtype, shape) in held.items():
            if name.endswith(".weight") and len(shape) == 2:
                path = name[: -len(".weight")]
                adapters[f"{path}.lora_A.weight"] = (dtype, (r, shape[1]))
                adapters[f"{path}.lora_B.weight"] = (dtype, (shape[0], r))
        return {**held, **adapters}

    def _load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        fault_injection.before_weight_load(self.name)
        if "weights" in self._released:
            raise RuntimeError(f"engine {self.name}: weights are released; resume them before an update")
        whole: list[tuple[str, torch.Tensor]] = []
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named:
            split = adapter_module(name) if self.lora is not None else None
            if split is None:
                whole.append((name, tensor))
            else:
                pairs.setdefault(split[0], {})[split[1]] = tensor
        unpaired = sorted(p for p, parts in pairs.items() if len(parts) != 2)
        if unpaired:
            raise ValueError(f"engine {self.name}: lora_A and lora_B come together; {unpaired[:3]} lack one")
        with self._step_lock:
            self._core.load_weights(whole)
            if not (self._bases or pairs) or self.lora is None:
                return  # no adapters sent, none merged before: a plain update
            held = dict(self._core.named_tensors())
            with torch.no_grad():
                for name, _ in whole:  # a base weight sent whole is the base the next merge starts from
                    base = self._bases.get(name.removesuffix(".weight"))
                    if base is not None and name.endswith(".weight"):
                        base.copy_(held[name])
            if pairs:
                self._merge_adapters(pairs, held, self.lora.scale)

    def _merge_adapters(
        self, pairs: Mapping[str, Mapping[str, torch.Tensor]], held: Mapping[str, torch.Tensor], scale: float
    ) -> None:
        merged: list[tuple[str, torch.Tensor]] = []
        for path, parts in pairs.items():
            base = self._bases.get(path)
            if base is None:
                # The first adapters of this layer: what it holds is the base (nothing merged yet).
                with self._memory.region("weights"):
                    base = held[f"{path}.weight"].detach().clone()
                self._bases[path] = base
            a = parts["lora_A.weight"].to(base.device)
            b = parts["lora_B.weight"].to(base.device)
            merged.append((f"{path}.weight", merge_lora(base, a, b, scale)))
        self._core.load_weights(merged)

    def weights_checksum(self) -> str:
        """``ppo_weight_sync.checksum`` of the weights held (the trainer computes it the same way)."""
        with self._step_lock:
            # checksum() hashes host bytes. A device tensor is copied to the host there anyway; a CPU
            # tensor is hashed through a copy, so that nothing the hashing does to a storage (numpy
            # marks it non-resizable) can stop the memory backend from releasing the live weights.
            return checksum(
                [
                    (n, t.detach().clone() if t.device.type == "cpu" else t.detach())
                    for n, t in self._core.named_tensors()
                ]
            )

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """A CPU copy of the weights (tests, debugging)."""
        with self._step_lock:
            return [(n, t.detach().to("cpu", copy=True)) for n, t in self._core.named_tensors()]

    # -- memory --------------------------------------------------------------------------------------
    def _tags(self, tags: Sequence[str] | None) -> list[str]:
        chosen = list(MEMORY_TAGS) if tags is None else list(tags)
        unknown = [t for t in chosen if t not in MEMORY_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; the engine knows {list(MEMORY_TAGS)}")
        return chosen

    def release_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        """Moves the tagged memory off the device (idempotent per tag). Refused while generating."""
        try:
            chosen = self._tags(tags)
        except ValueError as exc:
            return EngineReply.refused(str(exc))
        with self._cond:
            if self._active:
                return EngineReply.refused(
                    f"engine {self.name}: {self._active} generate call(s) in flight; wait for them"
                )
            with self._step_lock:
                if "kv_cache" in chosen:
                    # The generation core keeps its static KV cache and decode graphs between calls.
                    self._core.drop_decode_state()
                stats = self._memory.release(chosen)
                self._moved["release"] += stats
                if self.device.type == "cuda":
                    # Hand the freed blocks (and the last call's KV cache) back to the driver, so
                    # that training on the same GPU can use them.
                    torch.cuda.empty_cache()
            self._released.update(chosen)
        return EngineReply.ok(f"Released {chosen}: {stats.bytes} bytes in {stats.seconds:.3f} s.")

    def resume_memory_occupation(self, *, tags: Sequence[str] | None) -> EngineReply:
        """Brings the tagged memory back (idempotent per tag)."""
        try:
            chosen = self._tags(tags)
        except ValueError as exc:
            return EngineReply.refused(str(exc))
        with self._cond, self._step_lock:
            stats = self._memory.restore(chosen)
            self._moved["restore"] += stats
            self._released.difference_update(chosen)
        return EngineReply.ok(f"Resumed {chosen}: {stats.bytes} bytes in {stats.seconds:.3f} s.")

    def memory_stats(self) -> dict[str, float]:
        """Bytes and seconds every release and restore moved since start-up (running totals)."""
        with self._cond:
            return {
                f"{op}_{what}": float(getattr(stats, what))
                for op, stats in self._moved.items()
                for what in ("bytes", "seconds")
            }

    def released_tags(self) -> list[str]:
        with self._cond:
            return sorted(self._released)

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "device": str(self.device),
            "vocab_size": self._core.vocab_size,
            "eos_token_ids": list(self._core.eos_token_ids),
            "pad_token_id": self._core.pad_token_id,
            "max_positions": self._core.max_positions,
            # Physical GPUs this process sees (Ray narrows CUDA_VISIBLE_DEVICES for GPU actors).
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def ready(self) -> bool:
        return True

    def startup(self) -> dict[str, float]:
        """This engine's start-up (``ppo_lifecycle.startup``), with the CUDA graphs captured so far."""
        return {**self._setup.report(), "cuda_graphs_s": self._core.graph_capture_seconds}


if TYPE_CHECKING:  # mypy checks that the engine has the engine operations' exact signatures

    def _is_tensor_ops(engine: BuiltinEngine) -> TensorOps:
        return engine

    def _is_engine_ops(engine: BuiltinEngine) -> EngineOps:
        return engine


# The same class as a Ray actor; create with .options(max_concurrency>=2, ...).
BuiltinEngineActor = ray.remote(BuiltinEngine)
