"""The driver's declarative offload schedule: which roles are resident in which phase."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

Phase = Literal["generate", "critic_train", "actor_train", "weight_update", "save"]
CriticMode = Literal["none", "shared", "dedicated"]
Action = Literal["sleep", "wake"]

PHASES: tuple[Phase, ...] = get_args(Phase)
ROLE_ORDER: tuple[str, ...] = ("actor", "critic", "rollout")


class ResidentSharedCriticWarning(UserWarning):
    """A shared critic without offload was allowed for debugging; both models stay on the GPUs."""


@dataclass(frozen=True)
class Transition:
    role: str
    action: Action


@dataclass(frozen=True)
class OffloadPlan:
    """Which roles must be resident in each phase, for one placement mode.

    With ``offload=True``:

    * actor: resident for ``actor_train`` and ``weight_update`` (it sends the weights);
    * critic (if any): resident for ``critic_train``;
    * ``save``: no trainer role resident: checkpoints are written from the host copies the sleeps
      made, or (a role that cannot) by waking one role at a time, never two on shared GPUs;
    * rollout: always resident on its own GPUs (``colocate=False``); when colocated, only for
      ``generate`` and ``weight_update`` (it receives the weights).

    With ``offload=False`` every role stays resident in every phase. A ``shared`` critic lives on
    the actor's GPUs and needs offload: without it ``build`` raises, unless
    ``allow_resident_shared_critic=True`` (for debugging on a machine with room for both), which
    warns instead.

    A role's sleep moves what its memory backend tracks. A LoRA actor and a LoRA shared critic share
    one frozen base (``train.lora.share_base``, ``ppo_trainer.shared_base``): it is tracked by neither,
    so it stays resident in every phase, and their sleeps move the adapters, the value head and the
    AdamW state only.
    """

    colocate: bool
    critic: CriticMode
    offload: bool
    table: Mapping[Phase, frozenset[str]]

    @classmethod
    def build(
        cls,
        *,
        colocate: bool,
        critic: CriticMode,
        offload: bool,
        allow_resident_shared_critic: bool = False,
    ) -> OffloadPlan:
        if critic not in get_args(CriticMode):
            raise ValueError(f"critic must be one of {get_args(CriticMode)}, got {critic!r}")
        if critic == "shared" and not offload:
            if not allow_resident_shared_critic:
                raise ValueError(
                    "critic='shared' puts the critic on the actor's GPUs, so offload must be on "
                    "(offload=True); set allow_resident_shared_critic=True only to debug with both resident"
                )
            warnings.warn(
                "allow_resident_shared_critic=True: the shared critic stays resident next to the actor, "
                "so both models occupy memory at once (debug only)",
                ResidentSharedCriticWarning,
                stacklevel=2,
            )
        roles = ["actor", "rollout"] + ([] if critic == "none" else ["critic"])
        table: dict[Phase, frozenset[str]] = {}
        for phase in PHASES:
            if not offload:
                table[phase] = frozenset(roles)
                continue
            resident = set()
            if phase in ("actor_train", "weight_update"):
                resident.add("actor")
            if critic != "none" and phase == "critic_train":
                resident.add("critic")
            if not colocate or phase in ("generate", "weight_update"):
                resident.add("rollout")
            table[phase] = frozenset(resident)
        return cls(colocate=colocate, critic=critic, offload=offload, table=table)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this plan schedules, in the order transitions list them."""
        present = {"actor", "rollout"} | ({"critic"} if self.critic != "none" else set())
        return tuple(r for r in ROLE_ORDER if r in present)

    def resident(self, phase: Phase) -> frozenset[str]:
        if phase not in self.table:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        return self.table[phase]

    def transitions(self, before: Phase, after: Phase) -> list[Transition]:
        """Sleeps first (to free memory), then wakes, each in role order."""
        return self.transitions_from(self.resident(before), after)

    def transitions_from(self, resident: Iterable[str], after: Phase) -> list[Transition]:
        """Like ``transitions`` from an explicit set of resident roles (e.g. all, right after start)."""
        now = frozenset(resident)
        unknown = now - set(self.roles)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}; this plan has {self.roles}")
        target = self.resident(after)
        sleeps = [Transition(r, "sleep") for r in self.roles if r in now and r not in target]
        wakes = [Transition(r, "wake") for r in self.roles if r in target and r not in now]
        return sleeps + wakes
