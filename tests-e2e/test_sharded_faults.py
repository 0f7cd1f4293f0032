"""Background checkpoints of FSDP2 roles in whole runs: actor and shared critic sharded over two CPU
ranks (`train.data_parallel=fsdp2`, `placement.actor_gpus=2`). Their saves are written asleep, the
shards gathered to rank 0 over each role's save group; a rank killed while the actor's checkpoint is
being written leaves no COMPLETE checkpoint of that step, and the re-run ends with the weights of an
uninterrupted run, bit for bit. The run helpers are test_faults.py's.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_faults import Run, expect_clean_failure, final_checksum, latest

from ppo_driver import checkpoint as ck

FSDP2 = ("--set", "train.data_parallel=fsdp2", "--set", "placement.actor_gpus=2")


@pytest.mark.timeout(1800)
def test_kill_during_a_sharded_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    reference = Run(tmp_path / "reference" / "run", *FSDP2)
    assert reference.finish() == 0, reference.text()
    root = reference.run_dir / "checkpoints"
    assert [s for s, _ in ck.complete_checkpoints(root)] == [2, 4, 6, 8]
    for role in ("actor", "critic"):
        state = json.loads((root / "step_000008" / role / "trainer_state.json").read_text())
        assert (state["data_parallel"], state["world_size"]) == ("fsdp2", 2)
    # Written in the background: the loop's blocking seconds are recorded next to the writers'.
    metrics = [json.loads(line) for line in (reference.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("time/save_background" in m for m in metrics)

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    run = Run(run_dir, *FSDP2)
    victim = run.pids()["actor"][1]  # rank 1: rank 0's writer waits for its shards

    def actor_writing() -> list[Path]:
        if not root.is_dir():
            return []
        return [p for p in root.glob(".tmp-step_*") if (p / "actor.partial").is_dir()]

    run.wait_until("a background save of the actor", lambda: bool(actor_writing()))
    writing = actor_writing()
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "actor rank ")
    unfinished_step = int(writing[0].name.removeprefix(".tmp-step_"))
    found = latest(run_dir)
    assert found is None or found[0] < unfinished_step  # never marked complete
    if found is not None:
        ck.verify(found[1])

    run = Run(run_dir, *FSDP2)
    assert run.finish() == 0, run.text()
    if found is not None:
        assert f"resumed from {found[1]} (step {found[0]})" in run.text()
    assert not list(root.glob(".tmp-step_*"))
    assert [s for s, _ in ck.complete_checkpoints(root)] == [2, 4, 6, 8]
    assert final_checksum(run_dir) == final_checksum(reference.run_dir)
