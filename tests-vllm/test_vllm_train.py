"""``ppo-driver train`` with ``rollout.engine: vllm`` on CPU: two steps of the tiny model, the engine a real
vLLM server the run launches, every weight update checked by reading the server's weights back
(``train.check_weights``), and the run's end: the engine holds the actor's final weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = 2


@pytest.mark.timeout(900)
def test_a_short_run_on_vllm_ends_with_the_actors_weights(vllm_python: Path, tmp_path: Path) -> None:
    overrides = [
        "rollout.engine=vllm",
        f"rollout.vllm.python={vllm_python}",
        "rollout.vllm.kv_cache_memory_bytes=67108864",
        "model.tiny.num_heads=2",  # head size 32: vLLM's CPU attention takes no 16
        f"train.steps={STEPS}",
        "rollout.prompts_per_step=8",
        "rollout.sampling.n_samples_per_prompt=4",
        "rollout.eval_prompts=4",
        "train.check_weights=true",
        "logging.progress=false",
        "logging.tensorboard=false",
    ]
    driver = Path(sys.executable).with_name("ppo-driver")
    args = [str(driver), "train", "--run-dir", "run", *[a for o in overrides for a in ("--set", o)]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    done = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "engines hold the actor's final weights: match" in done.stdout, done.stdout[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/check_weights_s" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["time/check_weights_s"] > 0 for r in steps)  # read back after every update
