"""An early stop (``rollout.partial``) ends a generate call once its budget is reached: the unfinished
samples come back paused with exactly the tokens and log-probs the uninterrupted call made first, on
every decode path (decode loop, static batch, continuous slots)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppo_rollout.config import SamplingConfig
from ppo_rollout.engine.continuous import GenerationRequest
from ppo_rollout.engine.core import GenerationCore
from ppo_rollout.engine.early_stop import PAUSED, EarlyStop, StopRule

SAMPLING = SamplingConfig(temperature=1.0, max_new_tokens=40, n_samples_per_prompt=4)
PROMPTS = [[1, 5, 6, 7], [1, 8, 9], [1, 4, 4, 5, 6]]


@pytest.fixture(scope="module", params=["loop", "static-eager"])
def core(request: pytest.FixtureRequest, tiny_model: Path) -> GenerationCore:
    return GenerationCore(tiny_model, decode=request.param, max_running=4, refill_every=2)


def _assert_prefixes(full: list, early: list) -> None:
    for a, b in zip(full, early, strict=True):
        if b.finish_reason == PAUSED:
            assert a.token_ids[: len(b.token_ids)] == b.token_ids
            assert a.log_probs[: len(b.log_probs)] == b.log_probs
            assert len(b.token_ids) < len(a.token_ids) or a.finish_reason != "stop"
        else:
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason)


def test_a_batch_call_ends_once_enough_samples_finished(core: GenerationCore) -> None:
    full = core.generate(PROMPTS, SAMPLING, seed=3)
    done = sum(o.finish_reason == "stop" for o in full)
    assert 2 <= done < len(full)  # the tiny copy model stops some rows early, others run on
    early = core.generate(PROMPTS, SAMPLING, seed=3, until=EarlyStop(finished=2))
    paused = [o for o in early if o.finish_reason == PAUSED]
    assert paused
    assert sum(o.finish_reason != PAUSED for o in early) >= 2
    _assert_prefixes(full, early)


def test_slots_end_at_a_refill_with_running_and_waiting_requests_paused(tiny_model: Path) -> None:
    core = GenerationCore(tiny_model, decode="static-eager", max_running=3, refill_every=2)
    requests = [GenerationRequest(tuple(PROMPTS[i % 3]), 30 + i, seed=i) for i in range(8)]
    full = core.generate_requests(requests, SAMPLING)
    early = core.generate_requests(requests, SAMPLING, until=EarlyStop(tokens=12))
    made = sum(len(o.token_ids) for o in early)
    assert 12 <= made < sum(len(o.token_ids) for o in full)
    assert any(o.finish_reason == PAUSED and not o.token_ids for o in early)  # never took a slot
    assert any(o.finish_reason == PAUSED and o.token_ids for o in early)  # cut while running
    _assert_prefixes(full, early)


def test_a_stop_rule_splits_its_budget_over_the_calls() -> None:
    assert StopRule(finish_fraction=0.75).for_call(8, 16) == EarlyStop(finished=6)
    assert StopRule(token_budget=1000).for_call(8, 16) == EarlyStop(tokens=500)
    assert StopRule(0.5, 100).for_call(3, 3) == EarlyStop(2, 100)
    with pytest.raises(ValueError, match="finished or tokens"):
        EarlyStop()
