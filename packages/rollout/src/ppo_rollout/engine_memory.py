"""The engines' turn on the GPU in colocated runs: offload (weights and KV cache released) and onload
(taken back), on the driver's command, and the bytes and seconds each moved."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

from .engine.builtin import MEMORY_TAGS
from .engine_pool import EnginePool

__all__ = ["EngineMemory"]


class EngineMemory:
    """Offloads and onloads every engine of ``pool`` (both idempotent) and reports what they moved."""

    def __init__(self, pool: EnginePool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.offloaded = False
        self._seen: dict[str, dict[str, float]] = {}  # each engine's totals at the last pop_metrics

    def offload(self) -> None:
        """Every engine releases its weights and KV cache."""
        self._memory("release", list(MEMORY_TAGS))
        self.offloaded = True

    def onload(self) -> None:
        """Every engine takes its weights and KV cache back."""
        self._memory("resume", list(MEMORY_TAGS))
        self.offloaded = False

    def check_resident(self, call: str) -> None:
        """``call`` (``generate``, ``evaluate``) needs the engines' memory back."""
        if self.offloaded:
            raise RuntimeError(f"rollout engines are offloaded; call onload() before {call}()")

    def pop_metrics(self) -> dict[str, float]:
        """Bytes and seconds the engines' offloads and onloads moved since the last call, summed
        over the engines: ``offload/bytes``, ``offload/seconds``, ``onload/bytes``, ``onload/seconds``
        (the engines' own timing). Empty when an engine does not report them (SGLang)."""
        engines = self.pool.engines
        totals = {"offload/bytes": 0.0, "offload/seconds": 0.0, "onload/bytes": 0.0, "onload/seconds": 0.0}
        # The calls go out together: one engine's answer does not wait for another's.
        with concurrent.futures.ThreadPoolExecutor(max(1, len(engines))) as pool:
            answers = list(pool.map(lambda e: e.memory_stats(self.timeout_s), engines))
        for engine, stats in zip(engines, answers, strict=True):
            if stats is None:
                return {}
            before = self._seen.get(engine.name, {})
            for key, ours in (("release", "offload"), ("restore", "onload")):
                for what in ("bytes", "seconds"):
                    name = f"{key}_{what}"
                    totals[f"{ours}/{what}"] += stats.get(name, 0.0) - before.get(name, 0.0)
            self._seen[engine.name] = dict(stats)
        return totals

    def _memory(self, op: str, tags: Sequence[str] | None) -> None:
        failures = []
        for engine in self.pool.engines:
            call = engine.release_memory_occupation if op == "release" else engine.resume_memory_occupation
            reply = call(tags, self.timeout_s)
            if not reply.success:
                failures.append(f"{engine.name}: {reply.message}")
        if failures:
            raise RuntimeError(f"{op} of rollout memory failed on " + "; ".join(failures))
