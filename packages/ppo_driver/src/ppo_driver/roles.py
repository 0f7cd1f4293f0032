"""What the loop drives, and how the real parts are made.

``ppo_trainer.TrainGroup`` and ``ppo_rollout.manager.RolloutManager`` satisfy the protocols below; the loop
uses nothing else of them. ``create_roles`` builds the real ones on fresh placement groups.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast, runtime_checkable

from ppo_driver import build
from ppo_driver.config import RunConfig

if TYPE_CHECKING:
    from ppo_placement import RoleSlots
    from ppo_rollout.manager import RolloutBatch, RolloutManager
    from ppo_trainer.config import TrainerConfig
    from ppo_trainer.group import SpawnedWorkers, TrainGroup, TrainResult
    from ppo_value_transport import Box, Pieces
    from ppo_weight_sync.endpoints import EngineEndpoint


class TrainGroupLike(Protocol):
    world_size: int

    def train(
        self, step: int, batches: Sequence[Box], values: Sequence[Pieces] | None = None
    ) -> TrainResult: ...
    def policy_log_probs(self, batches: Sequence[Box]) -> list[Box]: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...
    def connect_engines(self, engines: Sequence[EngineEndpoint]) -> None: ...
    def disconnect_engines(self) -> None: ...
    def update_weights(self, version: str) -> dict[str, float]: ...
    def save(self, folder: Path) -> None: ...
    def load(self, folder: Path) -> None: ...
    def weights_checksum(self, rows: int | None = None) -> str: ...
    def pop_metrics(self) -> dict[str, float]: ...
    def memory_info(self) -> list[dict[str, float]]: ...
    def shutdown(self) -> None: ...


@runtime_checkable
class BackgroundSaving(Protocol):
    """A train group that can write its checkpoint from the host copies of its workers' last sleep
    while the loop goes on (``ppo_trainer.TrainGroup``); the loop saves others in the foreground."""

    @property
    def saves_asleep(self) -> bool: ...

    def save_async(self, folder: Path) -> Mapping[str, float]:
        """Start the writers; what they reported (``capture_seconds``, ``bytes``), as far as known."""
        ...

    def save_done(self) -> bool: ...
    def save_wait(self) -> float: ...


class RolloutLike(Protocol):
    def generate(self, step: int) -> RolloutBatch: ...
    def evaluate(self, step: int) -> dict[str, float]: ...
    def endpoints(self) -> list[EngineEndpoint]: ...
    def offload(self) -> None: ...
    def onload(self) -> None: ...
    def pop_metrics(self) -> dict[str, float]: ...
    def weights_checksums(self) -> list[str]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def shutdown(self) -> None: ...


@dataclass
class Roles:
    rollout: RolloutLike
    actor: TrainGroupLike
    critic: TrainGroupLike | None
    close: Callable[[], None] = lambda: None  # releases what the factory made (placement groups)
    # What starting them took, part by part (``ppo_lifecycle.startup``): per role, and the factory's own
    # ("placement groups"); the driver's start-up table shows it under ``roles``.
    startup: dict[str, dict[str, float]] = field(default_factory=dict)
    # ``startup.warm_up``: per role, what waits for the warm-up it started (``{"warm_up_s": ...}``).
    warming: dict[str, Callable[[], dict[str, float]]] = field(default_factory=dict)


RoleFactory = Callable[[RunConfig, Path, float], Roles]


TrainerRole = Literal["actor", "critic"]

if TYPE_CHECKING:
    _Role = RolloutManager | TrainGroup


class _SharedBase:
    """``train.lora.share_base``: the critic maps the actor's frozen base, so it is set up after the
    actor; this hands the actor's group (or its failure to start) over to the critic's maker."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._actor: Future[TrainGroup] = Future()

    def actor_made(self, actor: TrainGroup) -> None:
        self._actor.set_result(actor)

    def actor_failed(self, exc: BaseException) -> None:
        self._actor.set_exception(exc)  # the critic waiting for it fails too

    def actor(self, timeout_s: float) -> TrainGroup:
        return self._actor.result(timeout=timeout_s)


@dataclass(frozen=True)
class _Trainers:
    """What the trainer roles are made from: their slots and configs, the workers spawned ahead
    (filled in before the makers run), the shared base."""

    slots: Mapping[str, RoleSlots]
    configs: Mapping[str, TrainerConfig]
    spawned: dict[str, SpawnedWorkers]
    base: _SharedBase
    timeout_s: float

    def actor(self) -> TrainGroup:
        from ppo_trainer.group import TrainGroup

        try:
            group = TrainGroup(
                "actor",
                self.slots["actor"],
                self.configs["actor"],
                timeout_s=self.timeout_s,
                spawned=self.spawned.get("actor"),
                publish_base=self.base.enabled,
            )
        except BaseException as exc:
            self.base.actor_failed(exc)
            raise
        self.base.actor_made(group)
        return group

    def critic(self) -> TrainGroup:
        from ppo_trainer.group import TrainGroup

        slots, config, spawned = self.slots["critic"], self.configs["critic"], self.spawned.get("critic")
        if not self.base.enabled:
            return TrainGroup(
                "critic", slots, config, timeout_s=self.timeout_s, spawned=spawned, publish_base=False
            )
        actor = self.base.actor(self.timeout_s)
        critic = TrainGroup(
            "critic",
            slots,
            config,
            timeout_s=self.timeout_s,
            spawned=spawned,
            base=actor.shared_base_handles(),
        )
        actor.base_mapped()  # the files go; the two mappings stay
        return critic


def create_roles(
    config: RunConfig, model_path: Path, timeout_s: float, *, together: bool | None = None
) -> Roles:
    """Placement groups, then the rollout manager and engines, the actor and the critic groups.

    On CPU (``together`` None: from ``placement.device``) the three are started together: each role's
    processes import torch and load the model, most of a run's start-up, and one after the other they
    leave cores idle. On GPUs the trainers' processes start (and import) while the engines start, and
    are set up after them: the engines size their memory before the trainers take theirs (a trainer
    makes no CUDA context before setup)."""
    from ppo_placement import create_placement_groups, remove_placement_groups
    from ppo_rollout.manager import RolloutManager
    from ppo_trainer.group import TrainGroup

    t0 = time.perf_counter()
    placements = create_placement_groups(build.placement_spec(config), timeout_s=min(timeout_s, 120.0))
    placed_s = time.perf_counter() - t0
    trainers = _trainers(config, model_path, placements.slots, timeout_s)
    together = config.placement.device == "cpu" if together is None else together
    makers = _makers(config, model_path, placements.slots, trainers)
    warming: dict[str, Callable[[], dict[str, float]]] = {}
    if config.startup.enabled(config.placement.device):
        makers = {name: _warming(name, make, config, timeout_s, warming) for name, make in makers.items()}
    try:
        if not together:  # their imports overlap the engines' start; set up in order below
            _spawn_trainers(trainers)
        made = _make_all(makers, together=together)
    except BaseException:
        for workers in trainers.spawned.values():
            workers.kill()  # those no group adopted (a group's own failure killed its workers)
        remove_placement_groups(placements)
        raise
    rollout, actor, critic = made["rollout"], made["actor"], made.get("critic")
    assert isinstance(rollout, RolloutManager)
    assert isinstance(actor, TrainGroup)
    assert critic is None or isinstance(critic, TrainGroup)
    startup = {"driver": {"placement groups": placed_s}}
    startup.update({name: dict(part.startup) for name, part in made.items()})
    return Roles(
        rollout,
        actor,
        critic,
        close=lambda: remove_placement_groups(placements),
        startup=startup,
        warming=warming,
    )


def _trainers(
    config: RunConfig, model_path: Path, slots: Mapping[str, RoleSlots], timeout_s: float
) -> _Trainers:
    """The trainer roles' configs (the critic's from the actor's), and the shared base's handoff."""
    actor_config = build.actor_trainer_config(config, model_path)
    configs = {"actor": actor_config}
    if config.use_critic:
        configs["critic"] = build.critic_trainer_config(actor_config, config)
    return _Trainers(slots, configs, {}, _SharedBase(build.shares_base(config)), timeout_s)


def _spawn_trainers(trainers: _Trainers) -> None:
    """Every trainer role's workers started now (their imports), to be set up later by its maker."""
    from ppo_trainer.group import spawn_workers

    for role in trainers.configs:
        trainers.spawned[role] = spawn_workers(
            cast(TrainerRole, role), trainers.slots[role], trainers.configs[role], trainers.timeout_s
        )


def _makers(
    config: RunConfig, model_path: Path, slots: Mapping[str, RoleSlots], trainers: _Trainers
) -> dict[str, Callable[[], _Role]]:
    """Each role's maker, in start order: the rollout manager (its engines), the actor, the critic."""
    from ppo_rollout.manager import RolloutManager

    def rollout() -> RolloutManager:
        return RolloutManager(
            build.rollout_config(config, model_path),
            slots.get("rollout"),
            dp_size=config.placement.actor_gpus,
            critic_dp_size=critic_dp_size(config),
        )

    makers: dict[str, Callable[[], _Role]] = {"rollout": rollout, "actor": trainers.actor}
    if "critic" in trainers.configs:
        makers["critic"] = trainers.critic
    return makers


def _warming(
    name: str,
    make: Callable[[], Any],
    config: RunConfig,
    timeout_s: float,
    warming: dict[str, Callable[[], dict[str, float]]],
) -> Callable[[], Any]:
    """``make``, then the part's warm-up started (``startup.warm_up``), so that it runs while the parts
    after it start (on GPUs the trainers are set up after the engines): the engines' for a training
    step's generate, a trainer's on a batch of a step's shape (each rank's share of the samples, the
    longest prompt and response)."""
    from ppo_rollout.manager import RolloutManager
    from ppo_trainer.group import TrainGroup

    r = config.rollout

    def made() -> Any:
        part = make()
        if isinstance(part, RolloutManager):
            wait = part.start_warm_up()
            warming[name] = lambda: wait(timeout_s)
        elif isinstance(part, TrainGroup):
            samples = max(1, config.samples_per_step // part.world_size)
            warming[name] = part.start_warm_up(samples, r.max_prompt_length, r.train_response_limit)
        return part

    return made


class _Part(Protocol):
    def shutdown(self) -> None: ...


_P = TypeVar("_P", bound=_Part)


def _make_all(makers: Mapping[str, Callable[[], _P]], *, together: bool) -> dict[str, _P]:
    """Every part, in ``makers``' order or all at once; if one fails, the parts made are shut down
    (after the others finished starting) and the first failure is raised."""
    made: dict[str, _P] = {}
    failure: BaseException | None = None
    if together:
        futures: dict[str, Future[_P]] = {}
        try:
            # Leaving the block waits for every part: each one's start-up waits have their timeouts.
            with ThreadPoolExecutor(len(makers), thread_name_prefix="create-role") as pool:
                futures = {name: pool.submit(make) for name, make in makers.items()}
        except BaseException as exc:  # interrupted while waiting
            failure = exc
        for name, future in futures.items():
            error = future.exception()  # waits for a part still starting after an interruption
            if error is None:
                made[name] = future.result()
            else:
                failure = failure or error
    else:
        for name, make in makers.items():
            try:
                made[name] = make()
            except BaseException as exc:
                failure = exc
                break
    if failure is not None:
        for part in reversed(made.values()):
            part.shutdown()
        raise failure
    return made


def critic_dp_size(config: RunConfig) -> int | None:
    """The critic's data-parallel size (a dedicated critic may have its own); None: no critic."""
    p = config.placement
    if not config.use_critic:
        return None
    return p.critic_gpus if p.critic == "dedicated" and p.critic_gpus is not None else p.actor_gpus


def role_names(config: RunConfig) -> str:
    """What a run starts, e.g. "2 rollout engines, the actor (2 ranks), the critic (2 ranks)"."""

    def ranks(n: int) -> str:
        return f"{n} rank{'s' if n != 1 else ''}"

    count = config.placement.num_engines
    engines = "the rollout engine" if count == 1 else f"{count} rollout engines"
    critic = critic_dp_size(config)
    critic_part = f", the critic ({ranks(critic)})" if critic is not None else ""
    return f"{engines}, the actor ({ranks(config.placement.actor_gpus)}){critic_part}"


def shutdown_roles(roles: Roles) -> None:
    parts: list[Any] = [roles.critic, roles.actor, roles.rollout]
    try:
        for part in parts:
            if part is not None:
                part.shutdown()
    finally:
        roles.close()
