"""TrainGroup: the driver's handle on one role's TrainWorkers, one Ray actor per placement slot."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ppo_lifecycle.startup import role_startup
from ppo_trainer.config import TrainerConfig
from ppo_trainer.shared_base import SharedBaseHandle
from ppo_trainer.worker import TrainWorker
from ppo_value_transport import Box, Pieces, dispatch, gather, route
from ppo_weight_sync import EngineEndpoint

log = logging.getLogger(__name__)


class Slots(Protocol):
    """Where the workers go: ``ppo_placement.RoleSlots`` satisfies it, so does ``LocalSlots``."""

    @property
    def placement_group(self) -> PlacementGroup | None: ...
    @property
    def bundle_indices(self) -> tuple[int, ...]: ...
    @property
    def gpu_share(self) -> float: ...
    @property
    def cpu_share(self) -> float: ...


@dataclass(frozen=True)
class LocalSlots:
    """``count`` workers without a placement group (tests, examples, a single machine)."""

    count: int
    gpu_share: float = 0.0
    cpu_share: float = 0.0
    placement_group: None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"LocalSlots.count={self.count} must be >= 1")

    @property
    def bundle_indices(self) -> tuple[int, ...]:
        return tuple(range(self.count))


@dataclass(frozen=True)
class TrainResult:
    """Rank 0's metrics (already reduced over ranks) and, from the critic, one Box per rank holding
    ``values`` and ``token_rewards`` per sample (``pack_fields``), in that rank's sample order."""

    metrics: dict[str, float]
    values: list[Box] | None


@dataclass(frozen=True)
class SpawnedWorkers:
    """A role's TrainWorkers, started (their processes importing) but not set up: no process group,
    no model and no CUDA context yet, so they may start while the engines size their GPU memory."""

    role: str
    workers: tuple[Any, ...]
    requested_at: float  # when they were asked for (epoch seconds), for the start-up table

    def kill(self) -> None:
        """Kill workers that no TrainGroup adopted (a start-up that failed elsewhere); safe twice."""
        for worker in self.workers:
            ray.kill(worker)


def spawn_workers(
    role: Literal["actor", "critic"], slots: Slots, config: TrainerConfig, timeout_s: float = 600.0
) -> SpawnedWorkers:
    """One TrainWorker per slot, placed; returns at once (the processes start and import meanwhile)."""
    if role != config.role:
        raise ValueError(f"TrainGroup role={role!r} but config.role={config.role!r}; make them agree")
    bundles = tuple(slots.bundle_indices)
    if not bundles:
        raise ValueError(f"{role}: slots hold no bundles; the placement gave this role no slots")
    if config.device == "cuda" and not slots.gpu_share > 0:
        raise ValueError(f"{role}: device='cuda' but slots.gpu_share={slots.gpu_share}; give the role GPUs")
    remote_cls = ray.remote(TrainWorker)
    requested_at = time.time()
    workers = []
    for rank, bundle in enumerate(bundles):
        options: dict[str, Any] = {"num_cpus": slots.cpu_share, "num_gpus": slots.gpu_share}
        if slots.placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=slots.placement_group, placement_group_bundle_index=bundle
            )
        workers.append(remote_cls.options(**options).remote(config, rank, len(bundles), timeout_s))
    return SpawnedWorkers(role, tuple(workers), requested_at)


class TrainGroup:
    """One role (actor or critic) over ``len(slots.bundle_indices)`` data-parallel ranks.

    Every method waits at most ``timeout_s`` and names what it waited for. Sleep and wake are the
    driver's to call; ``update_weights`` and ``weights_checksum`` may wake and re-sleep an asleep actor.
    """

    def __init__(
        self,
        role: Literal["actor", "critic"],
        slots: Slots,
        config: TrainerConfig,
        *,
        timeout_s: float = 600.0,
        spawned: SpawnedWorkers | None = None,
        publish_base: bool = False,
        base: Sequence[SharedBaseHandle] | None = None,
    ) -> None:
        """Start the role's workers (or adopt ``spawned``, started earlier by :func:`spawn_workers`)
        and set them up: process group, model, optimizer. On failure every worker is killed.

        ``train.lora.share_base``: the actor's group ``publish_base``; the critic's, placed on the same
        bundles, maps them: ``base`` is the actor group's ``shared_base_handles()``, one per rank."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        spawned = spawned or spawn_workers(role, slots, config, timeout_s)
        if spawned.role != role:
            raise ValueError(f"TrainGroup role={role!r} was handed the workers of {spawned.role!r}")
        self.role = role
        self.config = config
        self.timeout_s = timeout_s
        self.world_size = len(spawned.workers)
        self.workers: list[Any] = list(spawned.workers)
        requested_at = spawned.requested_at
        try:
            init_method = self._get([self.workers[0].rendezvous_address.remote()], "rendezvous address")[0]
            if base is not None and len(base) != self.world_size:
                raise ValueError(
                    f"{role}: {len(base)} shared bases for {self.world_size} ranks; the critic shares the "
                    "actor's bundles one to one (placement.critic='shared')"
                )
            bases = list(base) if base is not None else [None] * self.world_size
            refs = [
                w.setup.remote(init_method, publish_base, b) for w, b in zip(self.workers, bases, strict=True)
            ]
            infos = self._get(refs, "setup")
        except BaseException:
            self.shutdown()
            raise
        # "replicate" or "fsdp2": what config.data_parallel resolved to for this many ranks.
        self.data_parallel: str = str(infos[0]["data_parallel"])
        # Whether save_async can write a checkpoint from the host copies of a sleep (every rank can).
        self.saves_asleep: bool = all(bool(i["saves_asleep"]) for i in infos)
        # The role's start-up, part by part (the slowest rank's), for the driver's start-up table.
        self.startup: dict[str, float] = role_startup(requested_at, [i["startup"] for i in infos])
        self._pending_save: tuple[Path, Path] | None = None  # (staging, final) of save_async

    # ------------------------------------------------------------------ helpers
    def _get(self, refs: Sequence[Any], what: str) -> list[Any]:
        """Wait for every rank; the first rank that fails raises at once (its peers may be stuck in a
        collective with it and would otherwise only surface as a timeout)."""
        refs = list(refs)
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                try:
                    ray.get(ref)  # raises the rank's own exception
                except RayActorError as exc:
                    # Ray's bare ActorDiedError names an actor id; the driver's report needs the rank.
                    raise RuntimeError(
                        f"{self.role} rank {refs.index(ref)}: {what}: the worker process died "
                        f"({str(exc).strip().splitlines()[0]})"
                    ) from exc
        return gather(refs, max(deadline - time.monotonic(), 1.0), f"{self.role} group: {what}")

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        return self._get(refs, method)

    # ------------------------------------------------------------------ the driver's interface
    def train(self, step: int, batches: Sequence[Box], values: Sequence[Pieces] | None = None) -> TrainResult:
        """Train every rank on its batch Box (one per rank, or one for all).

        The actor (``ppo``) needs ``values``: one ``Pieces`` per rank, from
        ``ppo_value_transport.pair_values(critic_result.values, critic_sample_ids, actor_sample_ids)``.
        The critic with ``off_policy_returns: vtrace`` needs the actor's log-probs there instead:
        ``pair_values(actor.policy_log_probs(actor_batches), actor_sample_ids, critic_sample_ids)``.
        """
        per_rank_values: list[Pieces | None] = (
            list(route(values, self.world_size)) if values is not None else [None] * self.world_size
        )
        refs = [
            w.train.remote(step, batch, v)
            for w, batch, v in zip(
                self.workers, route(batches, self.world_size), per_rank_values, strict=True
            )
        ]
        results = self._get(refs, f"train(step={step})")
        metrics = dict(results[0][0])
        out_values = [r[1] for r in results] if self.role == "critic" else None
        return TrainResult(metrics=metrics, values=out_values)

    def critic_outputs(self, batches: Sequence[Box], values: Sequence[Pieces]) -> list[Box]:
        """Per actor rank, the critic values and token rewards ``train`` would use (for checks)."""
        refs = [
            w.critic_outputs.remote(b, v)
            for w, b, v in zip(
                self.workers, route(batches, self.world_size), route(values, self.world_size), strict=True
            )
        ]
        return self._get(refs, "critic_outputs")

    def compute_values(self, batches: Sequence[Box]) -> list[Box]:
        """The critic's values without training, one Box per rank."""
        return self._get(dispatch(self.workers, "compute_values", batches), "compute_values")

    def compute_log_probs(self, batches: Sequence[Box]) -> list[Box]:
        """The actor's log-probs of the response tokens, one Box per rank."""
        return self._get(dispatch(self.workers, "compute_log_probs", batches), "compute_log_probs")

    def policy_log_probs(self, batches: Sequence[Box]) -> list[Box]:
        """The actor's log-probs as ``pack_fields`` payloads (field ``policy_log_probs``), one Box per
        rank: what a critic with ``off_policy_returns: vtrace`` trains on (see :meth:`train`)."""
        return self._get(dispatch(self.workers, "policy_log_probs", batches), "policy_log_probs")

    def sleep(self) -> None:
        self._all("sleep")

    def wake_up(self) -> None:
        self._all("wake_up")

    def is_asleep(self) -> bool:
        states = self._all("is_asleep")
        if len(set(states)) != 1:
            raise RuntimeError(f"{self.role} group: ranks disagree on sleeping: {states}")
        return bool(states[0])

    def connect_engines(self, engines: Sequence[EngineEndpoint]) -> None:
        self._all("connect_engines", list(engines))

    def disconnect_engines(self) -> None:
        """Leave the engines now (a no-op when not connected); the next update reconnects. The
        driver calls it before a sleep it runs in the background, so the engines are left while
        they are idle, not while they generate."""
        self._all("disconnect_engines")

    def update_weights(self, version: str) -> dict[str, float]:
        """Every rank sends to its own engines (rank 0 also to the group's); the ranks' metrics merged."""
        return merge_sync_metrics(self._all("update_weights", version))

    def save(self, folder: Path) -> None:
        """Write ``folder`` (created; replaced if present) through a staging folder renamed into place."""
        folder = Path(folder)
        staging = folder.with_name(folder.name + ".partial")
        self._all("save", str(staging))
        self._get([self.workers[0].commit.remote(str(staging), str(folder))], "commit checkpoint")

    def save_async(self, folder: Path) -> dict[str, float]:
        """Start writing ``folder`` from the host copies of the workers' last sleep; returns at once.

        The group must be asleep and ``saves_asleep``. ``save_done`` polls, ``save_wait`` waits and
        renames the staging folder into place; until then ``folder`` does not exist.
        """
        if self._pending_save is not None:
            self.save_wait()
        folder = Path(folder)
        staging = folder.with_name(folder.name + ".partial")
        started = self._all("save_async", str(staging))
        # Only once every rank started: a rank that refused (resident) leaves nothing to commit.
        self._pending_save = (staging, folder)
        # The slowest rank's capture (the call waited for it) and every rank's bytes.
        return {
            "capture_seconds": max(float(s["capture_seconds"]) for s in started),
            "bytes": sum(float(s["bytes"]) for s in started),
        }

    def save_done(self) -> bool:
        """Whether every rank finished writing (True when no save is pending); raises a rank's error."""
        if self._pending_save is None:
            return True
        return all(self._all("save_status"))

    def save_wait(self) -> float:
        """Wait for every rank's background save, then rename it into place; the slowest writer's
        seconds (0 when none was pending)."""
        if self._pending_save is None:
            return 0.0
        staging, folder = self._pending_save
        self._pending_save = None
        seconds = max(float(s) for s in self._all("save_wait"))
        self._get([self.workers[0].commit.remote(str(staging), str(folder))], "commit checkpoint")
        return seconds

    def memory_state(self) -> list[dict[str, Any]]:
        """Per rank: tracked bytes per memory tag and host memory pinned so far (``TrainWorker``)."""
        return list(self._all("memory_state"))

    def shared_base_handles(self) -> list[SharedBaseHandle]:
        """Per rank, what the critic's rank on the same bundle maps (after ``publish_base``)."""
        return list(self._all("shared_base_handle"))

    def base_mapped(self) -> None:
        """The critic mapped every rank's base: the shared-memory files go (the mappings stay)."""
        self._all("base_mapped")

    def shared_base_state(self) -> list[dict[str, Any]]:
        """Per rank, the shared base as its process sees it (``TrainWorker.shared_base_state``)."""
        return list(self._all("shared_base_state"))

    def load(self, folder: Path) -> None:
        self._all("load", str(Path(folder)))

    def weights_checksum(self, rows: int | None = None) -> str:
        return str(self._all("weights_checksum", rows)[0])

    def pop_metrics(self) -> dict[str, float]:
        return dict(self._all("pop_metrics")[0])

    def start_warm_up(
        self, samples: int, prompt_tokens: int, response_tokens: int
    ) -> Callable[[], dict[str, float]]:
        """Start every rank's ``TrainWorker.warm_up`` (``samples`` per rank); returns what waits for
        them: the slowest rank's ``{"warm_up_s": ...}``."""
        refs = [w.warm_up.remote(samples, prompt_tokens, response_tokens) for w in self.workers]

        def wait() -> dict[str, float]:
            return {"warm_up_s": max(r["warm_up_s"] for r in self._get(refs, "warm_up"))}

        return wait

    def memory_info(self) -> list[dict[str, float]]:
        return list(self._all("memory_info"))

    def shutdown(self) -> None:
        """Destroy the process groups and kill the workers; safe to call twice.

        Waits at most ``min(timeout_s, 30)`` s for the ranks' clean shutdown, and not at all for the
        rest once one rank's fails (its process died, say): the others are then typically stuck in a
        collective with it, and are killed at once."""
        if not self.workers:
            return
        workers, self.workers = self.workers, []
        try:
            self._shut_down_cleanly([w.shutdown.remote() for w in workers], min(self.timeout_s, 30.0))
        finally:
            for w in workers:
                ray.kill(w)

    def _shut_down_cleanly(self, refs: list[Any], timeout_s: float) -> None:
        """Wait for every rank's ``shutdown`` until the first fails or ``timeout_s`` passes; log why
        the workers are killed without a clean shutdown, if they are."""
        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            left = max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                ranks = [rank for rank, ref in enumerate(refs) if ref in pending]
                log.warning(
                    "%s group: clean shutdown failed: ranks %s did not finish within %g s; killed",
                    self.role,
                    ranks,
                    timeout_s,
                )
                return
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # a dead rank's ActorDiedError, or its own error
                    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    log.warning(
                        "%s group: rank %d's shutdown failed (%s); the other ranks were killed without "
                        "a clean shutdown (they may be waiting for it in a collective)",
                        self.role,
                        refs.index(ref),
                        reason,
                    )
                    return


def merge_sync_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """One update's metrics over the sending ranks: bytes and buckets add up (each rank moved its own),
    times and flags take the slowest rank (the ranks send at the same time), the rate is recomputed."""
    out: dict[str, float] = {}
    for metrics in per_rank:
        for key, value in metrics.items():
            if key.endswith(("bytes", "buckets")):
                out[key] = out.get(key, 0.0) + value
            else:
                out[key] = max(out.get(key, value), value)
    seconds = out.get("weight_sync/seconds", 0.0)
    if "weight_sync/gb_per_s" in out:
        out["weight_sync/gb_per_s"] = out["weight_sync/bytes"] / seconds / 1e9 if seconds > 0 else 0.0
    return out
