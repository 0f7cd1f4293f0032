"""DAPO's dynamic sampling and overlong shaping in a whole run: the tiny default with GRPO and no critic
trains 3 steps on groups whose scores vary, and logs the rollout/dynamic metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

PROMPTS = 8


@pytest.mark.timeout(240)
def test_grpo_trains_only_on_groups_whose_scores_vary(tmp_path: Path) -> None:
    overrides = [
        "algorithm.estimator=grpo",
        "algorithm.normalize_advantages=null",
        "placement.critic=none",
        "train.steps=3",
        f"rollout.prompts_per_step={PROMPTS}",
        "rollout.eval_prompts=0",
        "rollout.dynamic_sampling.enabled=true",
        "rollout.dynamic_sampling.max_rounds=4",
        "rollout.dynamic_sampling.over_sample=1.0",
        "rollout.dynamic_sampling.on_exhausted=stop",
        "rollout.overlong.buffer_len=2",
        "rollout.overlong.penalty_factor=0.5",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.interval=0",
    ]
    sets = [arg for o in overrides for arg in ("--set", o)]
    done = run_cli("train", "--run-dir", "run", *sets, cwd=tmp_path, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        # Every trained group has varying scores: none padded in.
        assert r["rollout/dynamic/kept_groups"] == PROMPTS
        assert r["rollout/dynamic/padded_groups"] == 0
        assert 1 <= r["rollout/dynamic/rounds"] <= 4
        # A second round refills what the first dropped.
        assert (r["rollout/dynamic/rounds"] > 1) == (r["rollout/dynamic/samples_generated_per_trained"] > 1)
        constant = r["rollout/dynamic/all_correct_groups"] + r["rollout/dynamic/all_wrong_groups"]
        assert 0.0 <= constant < 1.0
        assert "actor/loss" in r
        assert not any(key.startswith("critic/") for key in r)
    # The random tiny model leaves some groups all wrong: refilling is exercised.
    assert max(r["rollout/dynamic/rounds"] for r in records) >= 2
    assert max(r["rollout/dynamic/all_wrong_groups"] for r in records) > 0
