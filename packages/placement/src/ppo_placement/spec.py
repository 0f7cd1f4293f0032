"""What a run asks of placement: `PlacementSpec`, validated when it is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

CriticMode = Literal["none", "shared", "dedicated"]
CRITIC_MODES: tuple[str, ...] = ("none", "shared", "dedicated")
# Resources Ray defines itself: a bundle already asks for CPU/GPU, and "node:<ip>" is Ray's own tag.
_RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _require_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True GPUs is a typo, not a count.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{name} must be an int, got {value!r} ({type(value).__name__}); pass a whole number"
        )
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}; set {name} to at least {minimum}")


@dataclass(frozen=True)
class PlacementSpec:
    """The GPU (or CPU bundle) needs of one PPO run.

    Counts are in bundles: one bundle is one GPU (plus ``cpus_per_bundle`` CPUs), or, when
    ``use_gpus`` is False, ``cpus_per_bundle`` CPUs alone. Building an impossible spec raises a
    ``ValueError`` that names the field and the fix.
    """

    actor_gpus: int
    rollout_gpus: int
    gpus_per_engine: int = 1
    colocate: bool = False
    critic: CriticMode = "none"
    critic_gpus: int | None = None
    train_only: bool = False
    rollout_only: bool = False
    external_rollout: bool = False
    use_gpus: bool = True
    cpus_per_bundle: float = 1.0
    # (role, custom resource): that role's bundles also ask for a little of the resource, so they land
    # only on nodes started with it (``ray start --resources '{"NAME": 1}'``); see ``bundle_resources``.
    node_resources: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for flag in ("colocate", "train_only", "rollout_only", "external_rollout", "use_gpus"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.critic not in CRITIC_MODES:
            raise ValueError(f"critic must be one of {CRITIC_MODES}, got {self.critic!r}")
        if self.train_only and self.rollout_only:
            raise ValueError(
                "train_only and rollout_only are both set; a run skips at most one side: unset one"
            )
        if self.train_only and self.external_rollout:
            raise ValueError(
                "train_only and external_rollout are both set; train_only runs no rollout at all: unset one"
            )
        if self.colocate and self.external_rollout:
            raise ValueError(
                "colocate and external_rollout are both set; external engines cannot share the training "
                "GPUs: unset colocate"
            )
        # The actor may be absent only when nothing trains.
        _require_int("actor_gpus", self.actor_gpus, 0 if self.rollout_only else 1)
        # The rollout may be absent only when nothing generates, or when the engines live elsewhere.
        _require_int(
            "rollout_gpus", self.rollout_gpus, 0 if (self.train_only or self.external_rollout) else 1
        )
        _require_int("gpus_per_engine", self.gpus_per_engine, 1)
        if self.rollout_gpus % self.gpus_per_engine != 0:
            raise ValueError(
                f"rollout_gpus ({self.rollout_gpus}) is not divisible by gpus_per_engine "
                f"({self.gpus_per_engine}); make rollout_gpus a multiple of gpus_per_engine"
            )
        if isinstance(self.cpus_per_bundle, bool) or not isinstance(self.cpus_per_bundle, int | float):
            raise ValueError(f"cpus_per_bundle must be a number, got {self.cpus_per_bundle!r}")
        if not self.cpus_per_bundle > 0:
            raise ValueError(f"cpus_per_bundle must be > 0, got {self.cpus_per_bundle}; set it to e.g. 1.0")
        self._check_critic()
        self._check_node_resources()

    def _check_node_resources(self) -> None:
        placed = {"actor": self.actor_gpus > 0, "critic": self.critic != "none"}
        placed["rollout"] = not (self.train_only or self.external_rollout)
        roles = [role for role, _ in self.node_resources]
        for role, name in self.node_resources:
            if role not in placed:
                raise ValueError(
                    f"node_resources names role {role!r}; the roles are actor, critic and rollout"
                )
            if not placed[role]:
                raise ValueError(f"node_resources names the {role}, which this run does not place: drop it")
            if roles.count(role) > 1:
                raise ValueError(f"node_resources names the {role} twice: give each role one resource")
            if not isinstance(name, str) or not name.strip() or name != name.strip():
                raise ValueError(
                    f"node_resources[{role}] must be a resource name without spaces around it, got {name!r}"
                )
            if name in _RAY_RESOURCES or name.startswith("node:"):
                raise ValueError(
                    f"node_resources[{role}]={name!r} is one of Ray's own resources; tag the nodes with a "
                    "custom one (ray start --resources '{\"train\": 1}') and name that"
                )

    def _check_critic(self) -> None:
        if self.critic == "none":
            if self.critic_gpus is not None:
                raise ValueError(
                    f"critic_gpus is {self.critic_gpus} but critic is 'none'; set critic to 'shared' or "
                    "'dedicated', or leave critic_gpus unset"
                )
            return
        if self.critic_gpus is not None:
            _require_int("critic_gpus", self.critic_gpus, 1)
        if self.critic == "shared" and self.critic_gpus is not None and self.critic_gpus != self.actor_gpus:
            raise ValueError(
                f"critic_gpus ({self.critic_gpus}) differs from actor_gpus ({self.actor_gpus}) with "
                "critic='shared'; a shared critic runs on the actor's GPUs: leave critic_gpus unset, "
                "or use critic='dedicated'"
            )
        if self.critic == "dedicated" and self.colocate:
            raise ValueError(
                "critic='dedicated' with colocate=True; colocated runs share every GPU: "
                "use critic='shared', or set colocate=False"
            )

    @property
    def critic_bundles(self) -> int:
        """GPUs of the critic's own model (0 without a critic); a shared critic has the actor's."""
        if self.critic == "none":
            return 0
        return self.actor_gpus if self.critic_gpus is None else self.critic_gpus
