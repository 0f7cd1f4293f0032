"""The engines' weights as the rollout keeps track of them: each engine's weight version (asked of
the engine itself), held still through a rollout, and each engine's weights checksum."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from .engine.handles import EngineHandle

__all__ = ["version_number", "versions_held", "weight_versions", "weights_checksums"]


def version_number(version: str | None) -> int:
    """A weight version as recorded per sample: the driver's versions are step numbers."""
    try:
        return int(version) if version is not None else -1
    except ValueError:
        return -1


def weight_versions(engines: Sequence[EngineHandle], timeout_s: float) -> list[str | None]:
    """Each engine's weight version, asked of the engine itself."""
    pending = [(e, e.endpoint().get_weight_version()) for e in engines]
    out: list[str | None] = []
    for engine, call in pending:
        try:
            version = call.result(timeout_s)
        except Exception as exc:
            raise RuntimeError(f"engine {engine.endpoint().name}: get_weight_version failed: {exc}") from exc
        out.append(None if version is None else str(version))
    return out


@contextmanager
def versions_held(engines: Sequence[EngineHandle], timeout_s: float, step: int) -> Iterator[tuple[int, ...]]:
    """The engines' weight versions as numbers, for a rollout; the versions must not change until it
    ends (a weight update never overlaps a rollout), else ``RuntimeError`` after it."""
    before = weight_versions(engines, timeout_s)
    yield tuple(version_number(v) for v in before)
    after = weight_versions(engines, timeout_s)
    if before != after:
        raise RuntimeError(
            f"step {step}: the engines' weight versions changed during generation ({before} -> "
            f"{after}); a weight update must not overlap a generate call"
        )


def weights_checksums(engines: Sequence[EngineHandle], timeout_s: float) -> list[str]:
    """``ppo_weight_sync.checksum`` of each engine's weights (built-in engines only)."""
    # Together: hashing a 1B-parameter model's weights takes seconds per engine.
    with concurrent.futures.ThreadPoolExecutor(max(1, len(engines))) as pool:
        return list(pool.map(lambda e: e.weights_checksum(timeout_s), engines))
