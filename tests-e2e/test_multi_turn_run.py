"""Multi-turn PPO with a shared critic, started as a user would: the environment of the guide
(docs/guide/environments.md, its Python block saved as a module) with the tiny model on CPU; every
step's metrics say how the trajectories went, and the engines end with the actor's weights."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, ppo_driver_exe

GUIDE = REPO / "docs" / "guide" / "environments.md"
STEPS = 3


def _guide_environment() -> str:
    """The guide's environment class, as its Python block holds it."""
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.M | re.S)
    found = [b for b in blocks if "class GuessTheNumber" in b]
    assert len(found) == 1, "the guide's GuessTheNumber block is gone"
    return found[0]


@pytest.mark.timeout(420)
def test_multi_turn_ppo_with_the_guides_environment(tmp_path: Path) -> None:
    (tmp_path / "my_env.py").write_text(_guide_environment())
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH", "")) if p)
    sets = [
        f"train.steps={STEPS}",
        "train.check_weights=true",
        "rollout.environment=my_env:GuessTheNumber",
        "rollout.environment_args={max_guesses: 3}",
        "rollout.eval_prompts=8",
        "rollout.eval_before_train=true",
    ]
    args = [ppo_driver_exe(), "train", "--config", str(REPO / "configs" / "cpu-guess-multiturn.yaml")]
    args += ["--run-dir", "run", *(x for s in sets for x in ("--set", s))]
    done = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "engines hold the actor's final weights: match" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS + 1))  # step 0: the untrained model's evaluation
    assert "eval/turns_mean" in records[0]
    for r in records[1:]:
        assert 1.0 <= r["rollout/turns_mean"] <= r["rollout/turns_max"] <= 3.0  # max_guesses ends it at 3
        statuses = [r[f"rollout/status/{s}"] for s in ("done", "max_turns", "length", "env_error")]
        assert sum(statuses) == pytest.approx(1.0)
        assert r["rollout/status/env_error"] == 0.0
        # Every trajectory the environment ended says whether it was solved; none is counted twice.
        assert 0.0 <= r.get("rollout/env/solved", 0.0) <= r["rollout/status/done"] + 1e-9
        assert 0.0 <= r["rollout/engine_idle_share"] <= 1.0
        assert r["rollout/samples"] == 128.0
    assert max(r["rollout/turns_max"] for r in records[1:]) > 1.0  # several turns, not one
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["weights_match"] is True
    assert summary["engine_checksums"] == [summary["actor_checksum"]]
