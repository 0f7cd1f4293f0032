"""Per-phase time of a finished run, from its metrics.jsonl: `python benchmarks/step_breakdown.py RUN_DIR...`.

Prints a markdown table per run: mean seconds per step of each phase (steps after the first, which
includes warm-up), the reward of the first and last 5 steps, and the bytes and rate of the weight update.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from ppo_driver.metrics import read_metrics

PHASES = ("generate", "critic_train", "actor_train", "save", "weight_update", "eval", "step")


def main(run_dirs: list[str]) -> None:
    for run_dir in run_dirs:
        records = read_metrics(Path(run_dir))
        steady = records[1:] or records
        print(f"\n{run_dir}: {len(records)} steps")
        print("| phase | mean s/step | max s |")
        print("|---|---|---|")
        for phase in PHASES:
            values = [r[f"time/{phase}"] for r in steady if f"time/{phase}" in r]
            if values:
                print(f"| {phase} | {statistics.fmean(values):.3f} | {max(values):.3f} |")
        rewards = [r["rollout/reward_mean"] for r in records]
        first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
        print(f"reward first 5 steps {first:.3f}, last 5 {last:.3f}")
        sync = [r for r in steady if "weight_sync/bytes" in r]
        if sync:
            mb = statistics.fmean(r["weight_sync/bytes"] for r in sync) / 1e6
            rate = statistics.fmean(r["weight_sync/gb_per_s"] for r in sync)
            print(f"weight update (every transport): {mb:.2f} MB per step at {rate:.3f} GB/s")
        ipc = [r for r in steady if r.get("weight_sync/ipc_bytes")]
        if ipc:
            # Colocated engines (CUDA IPC): bytes and the pipeline's seconds; control = pause/flush/continue.
            mb = statistics.fmean(r["weight_sync/ipc_bytes"] for r in ipc) / 1e6
            secs = statistics.fmean(r["weight_sync/ipc_seconds"] for r in ipc)
            control = statistics.fmean(r.get("weight_sync/control_seconds", 0.0) for r in ipc)
            print(
                f"weight update over CUDA IPC: {mb:.2f} MB per step in {secs * 1e3:.1f} ms "
                f"({mb / 1e3 / secs:.1f} GB/s); control calls {control * 1e3:.1f} ms"
            )
        moves = statistics.fmean(len(r.get("offload/transitions", [])) for r in records)
        print(f"sleep/wake transitions per step: {moves:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
