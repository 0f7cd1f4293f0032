"""``ppo-driver train`` with ``rollout.engine: vllm`` on CPU: two steps of the tiny model, the engine a real
vLLM server the run launches, every weight update checked by reading the server's weights back
(``train.check_weights``), and the run's end: the engine holds the actor's final weights. The run
starts in the background before the engine tests (``conftest.vllm_run``); this test waits for it."""

from __future__ import annotations

import json

import pytest
from conftest import RUN_STEPS, BackgroundRun


@pytest.mark.timeout(900)
def test_a_short_run_on_vllm_ends_with_the_actors_weights(vllm_run: BackgroundRun) -> None:
    code, output = vllm_run.wait()
    assert code == 0, output[-6000:]
    assert "engines hold the actor's final weights: match" in output, output[-2000:]
    records = [json.loads(line) for line in (vllm_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/check_weights_s" in r]
    assert [r["step"] for r in steps] == list(range(1, RUN_STEPS + 1))
    assert all(r["time/check_weights_s"] > 0 for r in steps)  # read back after every update
