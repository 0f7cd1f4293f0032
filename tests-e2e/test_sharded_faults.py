"""Background checkpoints of FSDP2 roles in whole runs: actor and shared critic sharded over two CPU
ranks (`train.data_parallel=fsdp2`, `placement.actor_gpus=2`). Their saves are written asleep, the
shards gathered to rank 0 over each role's save group; a rank killed while the actor's checkpoint is
being written leaves no COMPLETE checkpoint of that step, and the re-run ends with the weights of an
uninterrupted run, bit for bit. The run helpers are conftest.py's, shared with test_faults.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DRILL_STEPS, Run, check_completed_like, kill_during_background_save

from ppo_driver import checkpoint as ck

FSDP2 = ("--set", "train.data_parallel=fsdp2", "--set", "placement.actor_gpus=2")
CHECKPOINTS = list(range(2, DRILL_STEPS + 1, 2))


@pytest.mark.timeout(1800)
def test_kill_during_a_sharded_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    reference = Run(tmp_path / "reference" / "run", *FSDP2)
    assert reference.finish() == 0, reference.text()
    root = reference.run_dir / "checkpoints"
    assert [s for s, _ in ck.complete_checkpoints(root)] == CHECKPOINTS
    for role in ("actor", "critic"):
        state = json.loads((root / f"step_{DRILL_STEPS:06d}" / role / "trainer_state.json").read_text())
        assert (state["data_parallel"], state["world_size"]) == ("fsdp2", 2)
    # Written in the background: the loop's blocking seconds are recorded next to the writers'.
    metrics = [json.loads(line) for line in (reference.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("time/save_background" in m for m in metrics)

    # Rank 1 dies: rank 0's writer waits for its shards.
    run_dir = tmp_path / "run"
    found = kill_during_background_save(run_dir, *FSDP2, rank=1, fault="actor rank ")

    run = Run(run_dir, *FSDP2)
    assert run.finish() == 0, run.text()
    if found is not None:
        assert f"resumed from {found[1]} (step {found[0]})" in run.text()
    check_completed_like(run_dir, reference.run_dir, CHECKPOINTS)
