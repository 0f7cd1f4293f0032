"""Shared helpers of the whole-system tests: run the `ppo-driver` console script as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it, run on the GPU machine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def ppo_driver_exe() -> str:
    """The installed console script of this environment."""
    local = Path(sys.executable).with_name("ppo-driver")
    found = str(local) if local.is_file() else shutil.which("ppo-driver")
    if found is None:
        raise RuntimeError("the ppo-driver console script is not installed in this environment")
    return found


def run_cli(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run(
        [ppo_driver_exe(), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# The step budget (ppo_driver.budget): every part's key, for the roles a run has.
BUDGET_WORK = ("generate", "critic_train", "actor_train", "save", "generate_wait", "eval")
# What no named part covers may be at most this share of the steps' time (mean over steps): the loop's
# own bookkeeping between phases, a few Ray calls. More means a phase went untimed.
OTHER_SHARE_MAX = 0.10


def check_step_budget(records: list[dict[str, Any]], roles: tuple[str, ...], engines_move: bool) -> None:
    """Every budget key in every step; the parts add up to the step with little ``other``; the bytes
    of what moved are there; each inclusive phase time is its own part plus the parts inside it."""
    transitions = [f"{role}/{action}" for role in roles for action in ("sleep", "wake")]
    parts = [*BUDGET_WORK, *transitions, "weight_update", "handoff", "check_weights"]
    time_keys = [f"time/{p}_s" for p in (*parts, "other", "step")]
    byte_keys = [f"bytes/{t}" for t in transitions] + ["bytes/handoff", "bytes/weight_update"]
    others, steps = [], []
    for r in records:
        missing = [k for k in (*time_keys, *byte_keys, "time/overhead_fraction") if k not in r]
        assert not missing, (r["step"], missing)
        named = sum(r[f"time/{p}_s"] for p in parts)
        assert all(r[f"time/{p}_s"] >= 0 for p in parts), r["step"]
        assert named + r["time/other_s"] == pytest.approx(r["time/step_s"], abs=1e-9)
        assert r["time/other_s"] >= -1e-6, (r["step"], r["time/other_s"])  # no part counted twice
        others.append(r["time/other_s"])
        steps.append(r["time/step_s"])
        overhead = sum(r[f"time/{p}_s"] for p in (*transitions, "weight_update", "handoff"))
        method_s = r["time/step_s"] - r["time/check_weights_s"]  # a check the run asked for: left out
        assert r["time/overhead_fraction"] == pytest.approx(overhead / method_s)
        # The inclusive phase times hold their transitions and handoff halves: nothing lost, nothing twice.
        # (A step that saves wakes the critic once more, in the save: its wakes are not all nested here.)
        nested = r["time/critic/wake_s"] + (r["time/engines/sleep_s"] if engines_move else 0.0)
        assert "time/save" in r or r["time/critic_train"] == pytest.approx(
            r["time/critic_train_s"] + nested + r["critic/handoff_put_s"], rel=1e-6, abs=1e-6
        )
        # Both trainers moved every step, the critic's values went to the actor, the weights to the engines.
        for t in transitions:
            moved = engines_move or not t.startswith("engines/")
            assert (r[f"bytes/{t}"] > 0) == moved, (r["step"], t, r[f"bytes/{t}"])
            assert (r[f"time/{t}_s"] > 0) == moved, (r["step"], t)
        assert r["bytes/handoff"] > 0, r["step"]
        assert r["time/handoff_s"] > 0, r["step"]
        assert r["bytes/weight_update"] == r["weight_sync/bytes"] > 0, r["step"]
    assert sum(others) <= OTHER_SHARE_MAX * sum(steps), (others, steps)
