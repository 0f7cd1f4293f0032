"""metrics.jsonl and TensorBoard events written by MetricsLog, read back from the files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_driver.metrics import METRICS_FILE, MetricsLog, read_metrics


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    # nox's ppo_driver session installs the tensorboard extra, so this runs in CI.
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = accumulator.EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_numbers_go_to_jsonl_and_tensorboard_lists_only_to_jsonl(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra")
    log = MetricsLog(tmp_path)
    assert log.tensorboard_enabled
    log.log(1, {"rollout/reward_mean": 0.25, "actor/loss": -1.5, "transitions": ["critic:wake"]})
    log.log(2, {"rollout/reward_mean": 0.5, "actor/loss": -1.0, "ok": True})
    log.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "rollout/reward_mean": 0.25, "actor/loss": -1.5, "transitions": ["critic:wake"]},
        {"step": 2, "rollout/reward_mean": 0.5, "actor/loss": -1.0, "ok": True},
    ]
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars == {
        "rollout/reward_mean": [(1, 0.25), (2, 0.5)],
        "actor/loss": [(1, -1.5), (2, -1.0)],
    }


def test_tensorboard_off_writes_no_events(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path, tensorboard=False)
    log.log(1, {"x": 1.0})
    log.close()
    assert not log.tensorboard_enabled
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / METRICS_FILE).read_text()) == {"step": 1, "x": 1.0}


def test_a_resumed_log_keeps_the_steps_up_to_its_checkpoint(tmp_path: Path) -> None:
    first = MetricsLog(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        first.log(step, {"x": float(step)})
    first.close()
    resumed = MetricsLog(tmp_path, tensorboard=False, start_step=2)
    resumed.log(3, {"x": 30.0})
    resumed.close()
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


BLOCK_TENSORBOARD = """
import sys, tempfile
from pathlib import Path
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorboard" or name.startswith("tensorboard."):
            raise ImportError("tensorboard is blocked in this test")
        return None
sys.meta_path.insert(0, _Block())
from ppo_driver.metrics import MetricsLog
with tempfile.TemporaryDirectory() as tmp:
    log = MetricsLog(Path(tmp))
    log.log(1, {"x": 1.0})
    log.close()
    print(log.tensorboard_enabled, (Path(tmp) / "tensorboard").exists())
"""


def test_without_tensorboard_the_log_still_writes_jsonl() -> None:
    command = [sys.executable, "-c", BLOCK_TENSORBOARD]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
