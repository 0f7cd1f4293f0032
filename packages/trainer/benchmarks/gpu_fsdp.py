"""Replicated vs FSDP2 data parallelism on two GPUs, with actor and critic taking turns on both.

Both roles have two ranks, one per GPU (``gpu_share=0.4`` each); an engine on GPU 1 receives the
actor's weights over NCCL from actor rank 0 on GPU 0. Each step: the critic wakes, trains, sleeps;
the actor wakes, trains with the critic's values, sleeps; the asleep actor updates the engine (every
rank wakes; sharded, every rank gathers; rank 0 sends). For each kind of data parallelism it reports
the device memory each role holds per GPU while resident (what its sleep frees), the train and
update times, and whether the engine ends with the actor's weights.

Run: ``python benchmarks/gpu_fsdp.py [--hidden 1536] [--layers 12] [--steps 3]`` (needs 2 GPUs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

sys.path.insert(0, str(Path(__file__).parent))
from gpu_workers import GIB, cpu_dry_run_model, make_batch, make_model, stage

from ppo_trainer.models import count_parameters


@dataclass(frozen=True)
class TwoGpus:
    """Each role's rank r on bundle r (one GPU each)."""

    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...] = (0, 1)
    gpu_share: float = 0.4
    cpu_share: float = 0.0


def run(
    kind: str, backend: str, model: Path, steps: int, vocab: int = 32000, device: str = "cuda"
) -> dict[str, Any]:
    """``device="cpu"`` (backend ``host``) runs the same sequence on CPU: a dry run of this script."""
    on_gpu = device == "cuda"
    from transformers import AutoConfig, AutoModelForCausalLM

    from ppo_trainer.config import AlgorithmConfig, TrainerConfig
    from ppo_trainer.group import TrainGroup
    from ppo_value_transport import pack_fields, pair_values
    from ppo_weight_sync import RayEngineEndpoint
    from ppo_weight_sync.testing.engine import TensorEngine

    pg = placement_group([{"GPU": 1, "CPU": 1} if on_gpu else {"CPU": 1}] * 2, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    common: dict[str, Any] = {
        "model_path": str(model),
        "algorithm": AlgorithmConfig(lam=1.0, num_mini_batches=1),
        "device": device,
        "memory_backend": backend,
        "micro_batch_size": 8,
        "actor_lr": 1e-5,
        "critic_lr": 1e-5,
        "weight_sync_backend": "nccl" if on_gpu else "gloo",
        "data_parallel": kind,
    }
    label = f"{kind}/{backend}"
    stage(label, "starting the critic and actor groups (2 ranks each)")
    slots = TwoGpus(pg, gpu_share=0.4 if on_gpu else 0.0)
    critic = TrainGroup("critic", slots, TrainerConfig(role="critic", **common), timeout_s=300)
    actor = TrainGroup("actor", slots, TrainerConfig(role="actor", **common), timeout_s=300)
    resolved = actor.data_parallel
    if critic.data_parallel != resolved or kind not in ("auto", resolved):
        raise RuntimeError(f"asked for {kind}, got actor {resolved} and critic {critic.data_parallel}")
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    spec = {n: ("float32", list(p.shape)) for n, p in shapes.named_parameters()}
    engine = (
        ray.remote(TensorEngine)
        .options(
            num_gpus=0.2 if on_gpu else 0,
            num_cpus=0,
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=1
            ),
        )
        .remote(spec, seed=1, device=device)
    )

    def free_per_gpu(group: TrainGroup) -> list[float]:
        return [info.get("device_free", 0.0) / GIB for info in group.memory_info()]

    try:
        critic.sleep()
        actor.sleep()
        actor.connect_engines([RayEngineEndpoint(engine, num_gpus=1, name="engine-0")])
        # 32 samples per rank, 128 prompt + 128 response tokens each.
        n, length = (32, 128) if on_gpu else (8, 8)
        halves = [pack_fields(make_batch(n, length, length, vocab, seed=s)) for s in (0, 1)]
        # Both roles split the batch the same way: rank r holds samples [r * n, (r + 1) * n).
        sample_ids = [list(range(r * n, (r + 1) * n)) for r in (0, 1)]
        out: dict[str, list[float]] = {
            k: [] for k in ("critic_gib", "actor_gib", "critic_s", "actor_s", "update_s", "value_loss")
        }
        for step in range(1, steps + 1):
            for name, group in (("critic", critic), ("actor", actor)):
                stage(label, f"step {step}: {name} wake + train")
                asleep = free_per_gpu(group)
                group.wake_up()
                start = time.perf_counter()
                if name == "critic":
                    result = group.train(step, halves)
                    assert result.values is not None, "the critic returned no values"
                    values = pair_values(result.values, sample_ids, sample_ids)
                    out["value_loss"].append(result.metrics["value_loss"])
                else:
                    group.train(step, halves, values)
                out[f"{name}_s"].append(time.perf_counter() - start)
                awake = free_per_gpu(group)
                group.sleep()
                # What this role held on each GPU while resident (weights, optimizer state, cache).
                out[f"{name}_gib"].append(max(a - b for a, b in zip(asleep, awake, strict=True)))
            stage(label, f"step {step}: update_weights (asleep)")
            start = time.perf_counter()
            actor.update_weights(str(step))
            out["update_s"].append(time.perf_counter() - start)
        match = ray.get(engine.state.remote())["checksum"] == actor.weights_checksum()
        shown = kind if kind == resolved else f"{kind} ({resolved})"
        return {"kind": resolved, "shown": shown, "backend": backend, "weights_match": match, **out}
    finally:
        for group in (actor, critic):
            group.shutdown()
        ray.kill(engine)
        remove_placement_group(pg)


def print_report(results: list[dict[str, Any]], params: int) -> None:
    print(f"\n### 2 GPUs, {params / 1e6:.0f}M-parameter Llama, actor and critic 2 ranks each")
    print(
        "| data parallel | actor resident per GPU (GiB) | critic resident per GPU (GiB) "
        "| actor train step (s) | critic train step (s) | asleep weight update (s) | engine matches |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        later = slice(1, None) if len(r["actor_s"]) > 1 else slice(None)  # the first step warms up
        print(
            f"| {r['shown']} | {max(r['actor_gib']):.2f} | {max(r['critic_gib']):.2f} "
            f"| {statistics.median(r['actor_s'][later]):.2f} | {statistics.median(r['critic_s'][later]):.2f} "
            f"| {statistics.median(r['update_s'][later]):.2f} | {r['weights_match']} |"
        )
    for r in results:
        print(f"{r['shown']}: critic value loss by step {[round(v, 4) for v in r['value_loss']]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="torch_memory_saver")
    parser.add_argument(
        "--kinds", nargs="*", default=["replicate", "fsdp2"], help="replicate, fsdp2 and/or auto"
    )
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the sequence on CPU, tiny model")
    args = parser.parse_args()
    if args.cpu_dry_run:
        with cpu_dry_run_model() as model:
            results = [run(kind, "host", model, 2, vocab=256, device="cpu") for kind in args.kinds]
            print_report(results, count_parameters(model))
        return 0 if all(r["weights_match"] for r in results) else 1
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs: nothing to run")
        return 0
    ray.init(num_gpus=2, include_dashboard=False, log_to_driver=False)
    failures = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_model(Path(tmp) / "model", args.hidden, args.layers, 32000)
            params = count_parameters(model)
            results = [run(kind, args.backend, model, args.steps) for kind in args.kinds]
        print_report(results, params)
        for r in results:
            if not r["weights_match"]:
                print(f"FAIL: {r['kind']}: the engine's weights differ from the actor's")
                failures += 1
            if r["value_loss"][-1] >= r["value_loss"][0]:
                print(f"FAIL: {r['kind']}: critic value loss did not go down {r['value_loss']}")
                failures += 1
        by_kind = {r["kind"]: r for r in results}
        if {"replicate", "fsdp2"} <= by_kind.keys():
            saved = max(by_kind["replicate"]["actor_gib"]) - max(by_kind["fsdp2"]["actor_gib"])
            print(f"FSDP2 holds {saved:.2f} GiB less per GPU for the actor while resident")
            if saved <= 0:
                print("FAIL: FSDP2 did not reduce the actor's resident memory")
                failures += 1
    finally:
        ray.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
