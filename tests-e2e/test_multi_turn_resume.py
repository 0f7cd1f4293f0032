"""A multi-turn run resumed from a checkpoint is the uninterrupted run, bit for bit.

`configs/cpu-guess-multiturn.yaml` (the tiny model guesses a digit over up to four turns, its
environment answering every turn), made small: 4 steps of 8 prompts, a checkpoint every 2 steps. One
uninterrupted run; then its folder as a run stopped after step 2's checkpoint leaves it, re-run to step
4. The resumed run ends with the same actor checksum and the same engine weights, and logs the same
figures for steps 3 and 4 (everything but timings), and each run says "match" after its summary.
Turns are scheduled in a fixed order (``rollout.multi_turn.turn_order: fixed``, the default) and the
sampling seeds are a function of (seed, step, engine, call), so nothing depends on timing.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, run_cli

STEPS, CHECKPOINT = 4, 2
SETS = (
    f"train.steps={STEPS}",
    f"checkpoint.interval={CHECKPOINT}",
    "rollout.prompts_per_step=8",  # 32 trajectories a step
    "train.micro_batch_size=8",
    "rollout.eval_prompts=0",
    "rollout.eval_before_train=false",
    "logging.tensorboard=false",
)
# Wall-clock figures (durations, rates, shares of time): the only metrics a resume may change.
TIMING = re.compile(r"^(time|save)/|/step/|(_s|seconds|per_second|tflops|_share)$")
# Figures that must be among those compared (else the comparison says nothing).
MUST_COMPARE = (
    "rollout/reward_mean",
    "rollout/turns_mean",
    "rollout/status/done",
    "rollout/observation_tokens_mean",
    "actor/loss",
    "actor/grad_norm",
    "critic/loss",
    "critic/values_mean",
    "weight_sync/bytes",
)
FINAL_LINE = "engines hold the actor's final weights: match"


def _train(run_dir: Path, first_step: int) -> str:
    """A run of the small config into ``run_dir``, from ``first_step``: its output."""
    args = [
        "train",
        "--config",
        str(REPO / "configs" / "cpu-guess-multiturn.yaml"),
        "--run-dir",
        run_dir.name,
    ]
    done = run_cli(*args, *(x for s in SETS for x in ("--set", s)), cwd=run_dir.parent, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    # After the last step's line, the summary and, last, the weights' verdict: nothing cut short.
    assert f"step {STEPS}/{STEPS} " in done.stdout, out[-4000:]
    assert f"steps {first_step}-{STEPS}; metrics: {run_dir.name}/metrics.jsonl" in done.stdout, out[-4000:]
    assert done.stdout.rstrip().splitlines()[-1].startswith(FINAL_LINE), out[-4000:]
    return out


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stopped_after_checkpoint(full: Path, run_dir: Path) -> None:
    """``run_dir`` as a run of ``full``'s settings stopped right after step CHECKPOINT's save leaves it:
    that checkpoint, the metrics up to it, no later checkpoint, no summary, no exported model."""
    shutil.copytree(full, run_dir)
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:06d}" for s in (CHECKPOINT, STEPS)]
    shutil.rmtree(root / f"step_{STEPS:06d}")
    shutil.rmtree(run_dir / "model")
    (run_dir / "summary.json").unlink()
    kept = [r for r in _metrics(full) if r["step"] <= CHECKPOINT]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


@pytest.mark.timeout(600)
def test_a_multi_turn_resume_is_the_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    full = tmp_path / "full"
    _train(full, first_step=1)
    full_records = _metrics(full)
    assert [r["step"] for r in full_records] == list(range(1, STEPS + 1))
    assert max(r["rollout/turns_max"] for r in full_records) > 1.0  # several turns, not one

    resumed = tmp_path / "resumed"
    _stopped_after_checkpoint(full, resumed)
    out = _train(resumed, first_step=CHECKPOINT + 1)
    assert f"resumed from {resumed / 'checkpoints' / f'step_{CHECKPOINT:06d}'} (step {CHECKPOINT})" in out

    a, b = (json.loads((d / "summary.json").read_text()) for d in (full, resumed))
    assert b["first_step"] == CHECKPOINT + 1
    assert b["actor_checksum"] == a["actor_checksum"]
    assert a["engine_checksums"] == b["engine_checksums"] == [a["actor_checksum"]]  # the engines' weights

    records = _metrics(resumed)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for mine, theirs in zip(records[CHECKPOINT:], full_records[CHECKPOINT:], strict=True):
        keys = {k for k in (*mine, *theirs) if not TIMING.search(k)}
        assert set(MUST_COMPARE) <= keys
        differ = {k: (mine.get(k), theirs.get(k)) for k in sorted(keys) if mine.get(k) != theirs.get(k)}
        assert not differ, (mine["step"], differ)
