"""A step's trajectories are checked against the model before training (issue 54): a token id outside
the vocabulary, or a trajectory longer than the model's positions, stops ``generate`` with one line
naming the sample, instead of an ``IndexError`` in the critic or silent training past the positions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from ppo_rollout.manager import RolloutManager
from ppo_rollout.rollout_fns import PromptGroup, RolloutContext
from ppo_rollout.sample_limits import SampleRefused, model_limits
from ppo_rollout.trajectory import Segment, Trajectory

pytestmark = pytest.mark.timeout(600)


def _returning(response: tuple[int, ...], bad_prompt: int) -> Any:
    """A user's rollout function: every sample answers ``(5,)`` except prompt ``bad_prompt``'s last."""

    async def fn(ctx: RolloutContext, group: PromptGroup) -> list[Trajectory]:
        out = []
        for k in range(group.samples):
            ids = response if group.index == bad_prompt and k == group.samples - 1 else (5,)
            segment = Segment(ids, True, 0, (0.0,) * len(ids))
            out.append(Trajectory(group.index, group.prompt_ids, (segment,), weight_versions=(0,)))
        return out

    return fn


def _generate_with(manager: RolloutManager, fn: Any) -> None:
    saved = manager.generation.parts
    manager.generation.parts = dataclasses.replace(saved, fn=fn, fn_name="my_rollout:fn")
    try:
        manager.generate(step=11)
    finally:
        manager.generation.parts = saved


def test_the_tiny_models_limits_are_read_from_its_folder(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    limits = model_limits(str(tiny_model))
    assert limits.vocab_size == config["vocab_size"]
    assert limits.max_positions == config["max_position_embeddings"]


def test_a_token_id_outside_the_vocabulary_is_refused_naming_the_sample(
    manager: RolloutManager, tiny_model: Path
) -> None:
    vocab = model_limits(str(tiny_model)).vocab_size
    assert vocab is not None
    with pytest.raises(
        SampleRefused,
        match=rf"^sample 2 of prompt 1 \(rollout function my_rollout:fn\): token id {vocab + 7} at response "
        rf"position 1 is outside the model's vocabulary \(0..{vocab - 1}",
    ):
        _generate_with(manager, _returning((5, vocab + 7), bad_prompt=1))
    with pytest.raises(SampleRefused, match=r"token id -1 at response position 0"):
        _generate_with(manager, _returning((-1,), bad_prompt=0))


def test_a_trajectory_longer_than_the_model_is_refused(manager: RolloutManager, tiny_model: Path) -> None:
    positions = model_limits(str(tiny_model)).max_positions
    assert positions is not None
    with pytest.raises(
        SampleRefused,
        match=rf"^sample 2 of prompt 3 .*: \d+ tokens \(\d+ prompt \+ 5000 response\) is more than the "
        rf"model's max_position_embeddings {positions}",
    ):
        _generate_with(manager, _returning((5,) * 5000, bad_prompt=3))
    _generate_with(manager, _returning((5,), bad_prompt=3))  # within the limits: trains as before
