"""The rollout's engines: each launched on its slot, all waited for together, their warm-up, stop.

``rollout.engine`` picks the handle (``engine.handles``): the built-in engine as a Ray actor holding
its GPU share, or an SGLang server launched by an actor that holds no GPU (the server takes its GPUs
by id). Engine ``i`` takes bundles ``[i * gpus_per_engine, (i + 1) * gpus_per_engine)`` of ``slots``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from ppo_lifecycle.startup import role_startup
from ppo_weight_sync import EngineEndpoint
from ppo_weight_sync.sglang_lora import ADAPTER_NAME

from .config import RolloutConfig, SamplingConfig
from .engine.handles import BuiltinEngineHandle, EngineHandle, SGLangEngineHandle
from .engine.vllm_handle import VLLMEngineHandle
from .engine.vllm_server import check_cpu_head_size
from .slots import EngineSlots, actor_options

__all__ = ["EnginePool", "check_bundles", "make_engine"]


def check_bundles(config: RolloutConfig, slots: EngineSlots | None) -> None:
    """The placement gave every engine its bundles (``None``: anywhere on the local Ray instance)."""
    per_engine = max(1, config.gpus_per_engine)
    if slots is not None and len(slots.bundle_indices) < config.num_engines * per_engine:
        raise ValueError(
            f"rollout needs {config.num_engines * per_engine} bundles ({config.num_engines} engines x "
            f"{per_engine}), the placement gave {len(slots.bundle_indices)}"
        )


def make_engine(cfg: RolloutConfig, i: int, slots: EngineSlots | None) -> EngineHandle:
    """Engine ``i``'s handle, its start requested (not waited for)."""
    per_engine = max(1, cfg.gpus_per_engine)
    share = float(slots.gpu_share) if slots is not None else (1.0 if cfg.device == "cuda" else 0.0)
    name = f"rollout-{i}"
    if cfg.engine == "builtin":
        return BuiltinEngineHandle(
            name,
            cfg.model_path,
            cfg.device,
            cfg.dtype,
            cfg.gpus_per_engine,
            actor_options(slots, i * per_engine, share),
            cfg.timeout_s,
            lora=cfg.lora,
        )
    if cfg.engine == "vllm":
        return VLLMEngineHandle(
            name,
            vllm_spec_args(cfg, i),
            actor_options(slots, i * per_engine, share),  # vLLM takes the GPUs Ray gives its actor
            startup_timeout_s=cfg.vllm.startup_timeout_s,
            stop_grace_s=cfg.vllm.stop_grace_s,
            request_timeout_s=cfg.vllm.request_timeout_s,
            weights=(cfg.dtype, None),
        )
    spec_args = sglang_spec_args(cfg, i, slots)
    # The launching actor holds no GPU: the server takes its GPUs by id.
    return SGLangEngineHandle(
        name,
        spec_args,
        actor_options(slots, i * per_engine, 0.0),
        startup_timeout_s=cfg.sglang.startup_timeout_s,
        stop_grace_s=cfg.sglang.stop_grace_s,
        request_timeout_s=cfg.sglang.request_timeout_s,
        adapter=ADAPTER_NAME if cfg.lora is not None else None,
        weights=(cfg.dtype, cfg.sglang.check_rows),  # what train.check_weights reads back
    )


def sglang_spec_args(cfg: RolloutConfig, i: int, slots: EngineSlots | None) -> dict[str, Any]:
    """The ``SGLangServerSpec`` arguments of engine ``i`` (its port picked where it runs)."""
    per_engine = max(1, cfg.gpus_per_engine)
    share = float(slots.gpu_share) if slots is not None else (1.0 if cfg.device == "cuda" else 0.0)
    sharing = slots is not None and 0.0 < share < 1.0  # the server releases its memory for training
    gpu_ids = tuple(slots.gpu_ids) if slots is not None else ()
    base_gpu = gpu_ids[i * per_engine] if gpu_ids else i * per_engine
    spec_args = {
        "model_path": cfg.model_path,
        "port": None,
        "tp_size": cfg.gpus_per_engine,
        "base_gpu_id": base_gpu,
        "host": cfg.sglang.host,
        # Sharing GPUs with training (a fractional share) means the server must release its memory.
        "enable_memory_saver": sharing,
        # rollout.sglang.mem_fraction_static; unset and sharing GPUs with training, 0.6 leaves room
        # for the trainers' CUDA contexts and what they keep resident while asleep (SGLang's own
        # default assumes the GPU is the server's alone). extra_args' --mem-fraction-static wins.
        "mem_fraction_static": cfg.sglang.mem_fraction_static or (0.6 if sharing else None),
        "random_seed": cfg.seed + i,
        "attention_backend": cfg.sglang.attention_backend,
        "dtype": cfg.dtype,  # the weights' dtype as the actor sends them (not SGLang's auto: float16)
        # a released server resumes its weights as zeros: keep a host copy where no whole update follows
        "weights_cpu_backup": sharing and _backup_weights(cfg),
        "extra_args": cfg.sglang.extra_args,
        "lora": cfg.lora,  # adapter-only updates: the server runs with LoRA on
        **({"command": cfg.sglang.command} if cfg.sglang.command else {}),
    }
    return spec_args


def vllm_spec_args(cfg: RolloutConfig, i: int) -> dict[str, Any]:
    """The ``VLLMServerSpec`` arguments of engine ``i`` (its port picked where it runs); on CPU, a
    model whose head size vLLM's CPU attention cannot run is refused here, before any server starts."""
    import sys

    if cfg.device == "cpu":
        check_cpu_head_size(cfg.model_path)
    extra = list(cfg.vllm.extra_args)
    kv_bytes = cfg.vllm.kv_cache_memory_bytes
    if kv_bytes is None and cfg.device == "cpu":
        kv_bytes = 1 << 30  # vLLM's CPU default reserves 92% of the host's memory and refuses to start
    if kv_bytes is not None and "--kv-cache-memory-bytes" not in extra:
        extra += ["--kv-cache-memory-bytes", str(kv_bytes)]
    if cfg.device == "cuda" and "--enable-sleep-mode" not in extra:
        extra.append("--enable-sleep-mode")  # else /sleep frees nothing: vLLM allocates outside its pool
    return {
        "model_path": cfg.model_path,
        "port": None,
        "python": cfg.vllm.python or sys.executable,
        "dtype": cfg.dtype,  # the weights' dtype as the actor sends them
        "host": cfg.vllm.host,
        "seed": cfg.seed + i,
        "tp_size": max(1, cfg.gpus_per_engine),
        "eager": cfg.vllm.eager,
        "extra_args": tuple(extra),
    }


def _backup_weights(cfg: RolloutConfig) -> bool:
    """Whether a server keeps a host copy of its weights while released: the setting, else where an
    adapter-only update (the base is never sent again) may follow a resume."""
    chosen = cfg.sglang.weights_cpu_backup
    return chosen if chosen is not None else cfg.lora is not None


class EnginePool:
    """``config.num_engines`` engines on ``slots``, started and ready; on a failure to start, the ones
    made are stopped and the failure raised. ``engines`` is emptied in place by :meth:`shutdown`."""

    def __init__(self, config: RolloutConfig, slots: EngineSlots | None) -> None:
        self.config = config
        self.engines: list[EngineHandle] = []
        requested_at = time.time()
        try:
            for i in range(config.num_engines):
                self.engines.append(make_engine(config, i, slots))
            # Created first, waited for together: engines load in parallel.
            servers = {"sglang": config.sglang.startup_timeout_s, "vllm": config.vllm.startup_timeout_s}
            wait = servers[config.engine] + 60 if config.engine in servers else config.timeout_s
            for engine in self.engines:
                engine.wait_ready(wait)
            # The engines' start-up, part by part (the slowest engine's), for the driver's table.
            self.startup = role_startup(requested_at, [e.startup(config.timeout_s) for e in self.engines])
        except BaseException:
            self.shutdown()
            raise

    def endpoints(self) -> list[EngineEndpoint]:
        """The engines as ppo_weight_sync endpoints, for ``WeightSender.connect``."""
        return [e.endpoint() for e in self.engines]

    def start_warm_up(self) -> Callable[[float], dict[str, float]]:
        """Start each built-in engine's ``warm_up`` for the first wave of a training step (the rows
        ``GenerateClient`` sends each engine: ``prompts_per_step`` split in near-equal contiguous
        chunks, ``n_samples_per_prompt`` rows each) and return what waits for them: the slowest
        engine's ``{"warm_up_s": ...}``. SGLang servers capture their graphs at launch: nothing to do."""
        cfg = self.config
        engines = len(self.engines)
        bounds = [round(k * cfg.prompts_per_step / engines) for k in range(engines + 1)]
        sampling = SamplingConfig.of(cfg.sampling, seed=0)
        waits = [
            engine.submit_warm_up(
                (bounds[j + 1] - bounds[j]) * cfg.sampling.n_samples_per_prompt,
                cfg.max_prompt_length,
                sampling,
            )
            for j, engine in enumerate(self.engines)
            if isinstance(engine, BuiltinEngineHandle) and bounds[j + 1] > bounds[j]
        ]

        def wait(timeout_s: float) -> dict[str, float]:
            seconds = [w(timeout_s)["warm_up_s"] for w in waits]
            return {"warm_up_s": max(seconds, default=0.0)}

        return wait

    def shutdown(self) -> None:
        engines = list(self.engines)
        self.engines.clear()
        for engine in engines:
            # Best effort: one engine failing to stop must not leave the others running.
            with contextlib.suppress(Exception):
                engine.shutdown()
