"""Partial rollouts (``rollout.partial``): the open groups' bookkeeping, and steps of a real rollout
manager whose samples pause at the budget and continue at the next step from their tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ppo_rollout.batch import FIELDS
from ppo_rollout.config import MultiTurnSettings, PartialSettings, RolloutConfig, SamplingSettings
from ppo_rollout.manager import RolloutManager
from ppo_rollout.partial import OpenGroup, OpenGroups, OpenSample, Piece
from ppo_rollout.rollout_fns import register_rollout_function
from ppo_rollout.testing.long_tail import LongTailRollout
from ppo_value_transport import unpack_fields

pytestmark = pytest.mark.timeout(600)

LONG_TAIL = LongTailRollout(median=10, longest=40, sigma=1.0, seed=1)
register_rollout_function("partial_long_tail")(LONG_TAIL)


def _sample(limit: int, *pieces: tuple[int, int], finish: str | None = None) -> OpenSample:
    """A sample whose pieces are (tokens, version) pairs."""
    made = tuple(Piece(tuple(range(n)), (-0.5,) * n, v) for n, v in pieces)
    return OpenSample(limit, made, finish)


def _group(*samples: OpenSample, born: int = 0) -> OpenGroup:
    return OpenGroup({"prompt": "ab"}, "ab", (1, 2), born, samples)


def test_stale_samples_are_dropped_with_their_group_or_restarted() -> None:
    fresh = _group(_sample(8, (3, 4)), _sample(8, (2, 5), finish="stop"))
    old = _group(_sample(8, (3, 1), (2, 4)), _sample(8, (4, 3), finish="stop"))
    groups = OpenGroups()
    groups.groups = [old, fresh]
    counts = groups.enforce_staleness(trains_with=5, max_staleness=2, on_stale="drop")
    assert (counts.dropped, counts.restarted) == (2, 0)  # version 1 would train 4 versions old
    assert groups.groups == [fresh]
    groups.groups = [old, fresh]
    counts = groups.enforce_staleness(trains_with=5, max_staleness=2, on_stale="restart")
    assert (counts.dropped, counts.restarted) == (0, 1)
    restarted = groups.groups[0].samples[0]
    assert (restarted.pieces, restarted.restarts, restarted.finish_reason) == ((), 1, None)
    assert groups.groups[0].samples[1] == old.samples[1]  # 2 versions old: within the bound


def test_complete_groups_leave_oldest_first_in_multiples() -> None:
    done = [_group(_sample(4, (2, 0), finish="stop"), born=b) for b in range(3)]
    open_ = _group(_sample(4, (2, 0)), born=9)
    groups = OpenGroups()
    groups.groups = [done[0], open_, done[1], done[2]]
    assert groups.unfinished() == [(1, 0)]
    assert groups.take_complete(2) == done[:2]
    assert groups.groups == [open_, done[2]]  # the third complete group waits for a partner


def test_the_state_is_plain_data_and_loads_back_exactly() -> None:
    groups = OpenGroups()
    groups.groups = [_group(_sample(9, (2, 3), (1, 4)), _sample(9, (3, 3), finish="length"), born=2)]
    groups.groups[0].samples[0].pieces[0].log_probs  # noqa: B018 (floats survive JSON exactly)
    state = json.loads(json.dumps(groups.state_dict()))
    again = OpenGroups()
    again.load_state_dict(state)
    assert again.groups == groups.groups


def test_partial_settings_need_a_budget_and_refuse_what_they_do_not_support(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"rollout\.partial needs a budget"):
        PartialSettings(enabled=True, finish_fraction=None)
    with pytest.raises(ValueError, match=r"rollout\.dynamic_sampling\.enabled"):
        RolloutConfig(
            model_path=str(tiny_model),
            task="copy",
            partial=PartialSettings(enabled=True),
            dynamic_sampling={"enabled": True},  # type: ignore[arg-type]
        )
    # Multi-turn rollouts pause too (test_partial_turns.py).
    config = RolloutConfig(
        model_path=str(tiny_model), task="guess_digit", partial=PartialSettings(enabled=True)
    )
    assert config.resolved_rollout_function == "multi_turn"


def _config(tiny_model: Path, **partial: object) -> RolloutConfig:
    return RolloutConfig(
        model_path=str(tiny_model),
        task="copy",
        prompts_per_step=4,
        rollout_function="partial_long_tail",
        sampling=SamplingSettings(
            temperature=1.0, max_new_tokens=40, n_samples_per_prompt=3, ignore_eos=True
        ),
        multi_turn=MultiTurnSettings(max_response_tokens=40),
        partial=PartialSettings(enabled=True, **partial),  # type: ignore[arg-type]
        eval_prompts=0,
        seed=5,
        timeout_s=120.0,
    )


@pytest.fixture(scope="module")
def partial_manager(ray_session: None, tiny_model: Path) -> Iterator[RolloutManager]:
    mgr = RolloutManager(_config(tiny_model, finish_fraction=0.5), None, dp_size=2)
    yield mgr
    mgr.shutdown()


def _responses(batch: object) -> list[tuple[list[int], list[float]]]:
    out = []
    for box in batch.boxes:  # type: ignore[attr-defined]
        fields = unpack_fields(box)
        for tokens, n, lps in zip(
            fields["tokens"], fields["response_length"], fields["rollout_log_probs"], strict=True
        ):
            out.append((tokens[len(tokens) - int(n) :].tolist(), lps.tolist()))
    return out


def test_paused_samples_continue_from_their_tokens_and_train_whole(partial_manager: RolloutManager) -> None:
    partial = partial_manager.generation.partial
    assert partial is not None
    first = partial_manager.generate(step=1)
    m = first.metrics
    assert m["rollout/partial/paused_samples"] > 0  # half the samples finished: the rest paused
    assert m["rollout/partial/trained_groups"] % 2 == 0
    assert m["rollout/partial/trained_groups"] >= 2
    assert m["rollout/samples"] == 3 * m["rollout/partial/trained_groups"]  # whole groups only
    paused = {
        (g.prompt_ids, i): s for g in partial.open.groups for i, s in enumerate(g.samples) if not s.finished
    }
    state = partial_manager.state_dict()
    json.dumps(state)
    second = partial_manager.generate(step=2)
    trained = _responses(second)
    continued = 0
    for sample in paused.values():
        # Its tokens and log-probs so far open one of the next steps' responses (the prompt's group
        # trains once all its samples are done: now, or later).
        hits = [
            r for r in trained if r[0][: sample.made] == list(sample.token_ids) and len(r[0]) == sample.limit
        ]
        continued += bool(hits)
        for _, lps in hits:
            assert lps[: sample.made] == pytest.approx(list(sample.log_probs), abs=0.0)
    assert continued > 0
    # A resumed manager continues the same paused samples exactly.
    partial_manager.load_state_dict(state)
    again = partial_manager.generate(step=2)
    for a, b in zip(second.boxes, again.boxes, strict=True):
        fa, fb = unpack_fields(a), unpack_fields(b)
        for name in FIELDS:
            assert all(torch.equal(x, y) for x, y in zip(fa[name], fb[name], strict=True))
    timings = ("seconds", "per_second", "idle_share")
    assert {k: v for k, v in second.metrics.items() if not any(t in k for t in timings)} == {
        k: v for k, v in again.metrics.items() if not any(t in k for t in timings)
    }
