"""PlacementSpec validation: every impossible spec raises a ValueError naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from ppo_placement import PlacementSpec

BAD: list[tuple[dict[str, Any], str]] = [
    ({"actor_gpus": 0, "rollout_gpus": 8}, "actor_gpus must be >= 1"),
    ({"actor_gpus": -1, "rollout_gpus": 8}, "actor_gpus must be >= 1"),
    ({"actor_gpus": -1, "rollout_gpus": 8, "rollout_only": True}, "actor_gpus must be >= 0"),
    ({"actor_gpus": 8, "rollout_gpus": 0}, "rollout_gpus must be >= 1"),
    ({"actor_gpus": 8, "rollout_gpus": -2, "train_only": True}, "rollout_gpus must be >= 0"),
    ({"actor_gpus": 8, "rollout_gpus": 8, "gpus_per_engine": 0}, "gpus_per_engine must be >= 1"),
    ({"actor_gpus": 8, "rollout_gpus": 6, "gpus_per_engine": 4}, "not divisible by gpus_per_engine"),
    ({"actor_gpus": 2.0, "rollout_gpus": 8}, "actor_gpus must be an int"),
    ({"actor_gpus": True, "rollout_gpus": 8}, "actor_gpus must be an int"),
    ({"actor_gpus": 8, "rollout_gpus": 8, "colocate": True, "critic": "dedicated"}, "critic='dedicated'"),
    (
        {"actor_gpus": 8, "rollout_gpus": 8, "critic": "shared", "critic_gpus": 4},
        "critic_gpus \\(4\\) differs",
    ),
    (
        {"actor_gpus": 8, "rollout_gpus": 8, "critic": "dedicated", "critic_gpus": 0},
        "critic_gpus must be >= 1",
    ),
    ({"actor_gpus": 8, "rollout_gpus": 8, "critic_gpus": 4}, "critic_gpus is 4 but critic is 'none'"),
    ({"actor_gpus": 8, "rollout_gpus": 8, "critic": "yes"}, "critic must be one of"),
    (
        {"actor_gpus": 8, "rollout_gpus": 8, "train_only": True, "rollout_only": True},
        "train_only and rollout_only",
    ),
    (
        {"actor_gpus": 8, "rollout_gpus": 8, "train_only": True, "external_rollout": True},
        "train_only and external_rollout",
    ),
    ({"actor_gpus": 8, "rollout_gpus": 8, "colocate": True, "external_rollout": True}, "unset colocate"),
    ({"actor_gpus": 8, "rollout_gpus": 8, "cpus_per_bundle": 0}, "cpus_per_bundle must be > 0"),
    ({"actor_gpus": 8, "rollout_gpus": 8, "cpus_per_bundle": "1"}, "cpus_per_bundle must be a number"),
    ({"actor_gpus": 8, "rollout_gpus": 8, "colocate": 1}, "colocate must be True or False"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD)
def test_bad_spec_raises_value_error_naming_the_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlacementSpec(**kwargs)


def test_error_says_the_fix() -> None:
    with pytest.raises(ValueError, match="make rollout_gpus a multiple of gpus_per_engine"):
        PlacementSpec(actor_gpus=8, rollout_gpus=6, gpus_per_engine=4)
    with pytest.raises(ValueError, match="use critic='shared', or set colocate=False"):
        PlacementSpec(actor_gpus=8, rollout_gpus=8, colocate=True, critic="dedicated")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"actor_gpus": 8, "rollout_gpus": 0, "train_only": True},
        {"actor_gpus": 8, "rollout_gpus": 0, "external_rollout": True},
        {"actor_gpus": 0, "rollout_gpus": 8, "rollout_only": True},
        {"actor_gpus": 8, "rollout_gpus": 8, "critic": "shared", "critic_gpus": 8},
        {"actor_gpus": 8, "rollout_gpus": 8, "cpus_per_bundle": 0.25},
    ],
)
def test_edge_specs_are_accepted(kwargs: dict[str, Any]) -> None:
    PlacementSpec(**kwargs)


def test_spec_is_frozen() -> None:
    spec = PlacementSpec(actor_gpus=8, rollout_gpus=8)
    with pytest.raises(AttributeError):
        spec.actor_gpus = 4  # type: ignore[misc]
