"""Background checkpoints of an FSDP2 role in whole runs: the actor sharded over two CPU ranks
(`train.data_parallel=fsdp2`, `placement.actor_gpus=2`), GRPO without a critic (the critic's sharded
saves: packages/trainer/tests/test_sharded_save.py). Its saves are written asleep, the shards gathered
to rank 0 over the role's save group; a rank killed while the actor's checkpoint is being written
leaves no COMPLETE checkpoint of that step, the previous one stays, and the re-run resumes from it and
ends with the weights of an uninterrupted run, bit for bit. The run helpers are conftest.py's, shared
with test_faults.py.

Three runs, each mostly its start-up: the uninterrupted reference; its folder cut back to what a run
stopped after step 4's checkpoint leaves, resumed and killed in step 6's background save; the re-run,
which resumes from step 4 again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import DRILL_STEPS, Run, check_completed_like, kill_during_background_save

from ppo_driver import checkpoint as ck

FSDP2 = ("--set", "train.data_parallel=fsdp2", "--set", "placement.actor_gpus=2")
# The fault is the actor's: GRPO, without a critic, one role's processes fewer to start (as in
# test_faults.py's drills whose fault is not the critic's).
WITHOUT_CRITIC = ("--set", "placement.critic=none", "--set", "algorithm.estimator=grpo")
SETTINGS = (*FSDP2, *WITHOUT_CRITIC)
CHECKPOINTS = list(range(2, DRILL_STEPS + 1, 2))
STOPPED_AT = 4  # the reference's folder is cut back to this checkpoint


def _stopped_after(reference: Path, run_dir: Path, step: int) -> None:
    """``run_dir`` as a run of the reference's settings stopped right after step ``step``'s save leaves
    it: the checkpoints up to it, the metrics up to it, no summary, no exported model."""
    shutil.copytree(reference, run_dir)
    for s, folder in ck.complete_checkpoints(run_dir / "checkpoints"):
        if s > step:
            shutil.rmtree(folder)
    shutil.rmtree(run_dir / "model", ignore_errors=True)
    (run_dir / "summary.json").unlink()
    metrics = run_dir / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines() if json.loads(line)["step"] <= step]
    metrics.write_text("".join(line + "\n" for line in kept))


@pytest.mark.timeout(1800)
def test_kill_during_a_sharded_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    reference = Run(tmp_path / "reference" / "run", *SETTINGS)
    assert reference.finish() == 0, reference.text()
    root = reference.run_dir / "checkpoints"
    assert [s for s, _ in ck.complete_checkpoints(root)] == CHECKPOINTS
    assert not (root / f"step_{DRILL_STEPS:06d}" / "critic").exists()
    state = json.loads((root / f"step_{DRILL_STEPS:06d}" / "actor" / "trainer_state.json").read_text())
    assert (state["data_parallel"], state["world_size"]) == ("fsdp2", 2)
    # Written in the background: the loop's blocking seconds are recorded next to the writers'.
    metrics = [json.loads(line) for line in (reference.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("time/save_background" in m for m in metrics)

    # Rank 1 dies in step 6's background save: rank 0's writer waits for its shards. Step 4's stays.
    run_dir = tmp_path / "run"
    _stopped_after(reference.run_dir, run_dir, STOPPED_AT)
    found = kill_during_background_save(run_dir, *SETTINGS, rank=1, fault="actor rank ")
    assert found is not None
    assert found[0] == STOPPED_AT, found

    run = Run(run_dir, *SETTINGS)
    assert run.finish() == 0, run.text()
    assert f"resumed from {found[1]} (step {STOPPED_AT})" in run.text()
    check_completed_like(run_dir, reference.run_dir, CHECKPOINTS)
