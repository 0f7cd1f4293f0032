"""Time plan_layout and create_placement_groups on a local Ray with logical GPUs (CPU machine).

Run: python packages/placement/benchmarks/bench_placement.py
"""

from __future__ import annotations

import os
import platform
import time

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray

from ppo_placement import PlacementSpec, create_placement_groups, plan_layout, remove_placement_groups


def main() -> None:
    spec = PlacementSpec(actor_gpus=8, rollout_gpus=8, critic="shared", cpus_per_bundle=0.25)
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        plan_layout(spec)
    per_call_us = (time.perf_counter() - start) / n * 1e6

    ray.init(num_cpus=4, num_gpus=16, object_store_memory=256 * 1024**2, include_dashboard=False)
    rows = []
    for bundles in (4, 16, 16):
        half = bundles // 2
        s = PlacementSpec(actor_gpus=half, rollout_gpus=half, critic="shared", cpus_per_bundle=0.25)
        start = time.perf_counter()
        placements = create_placement_groups(s, timeout_s=120)
        made = time.perf_counter() - start
        remove_placement_groups(placements)
        rows.append((bundles, made))
    ray.shutdown()

    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("| what | time |")
    print("|---|---|")
    print(f"| plan_layout (8 actor + shared critic + 8 rollout) | {per_call_us:.1f} us |")
    for i, (bundles, made) in enumerate(rows):
        note = " (workers already started)" if i == 2 else ""
        print(f"| create_placement_groups, {bundles} bundles, probe + sort{note} | {made:.2f} s |")


if __name__ == "__main__":
    main()
