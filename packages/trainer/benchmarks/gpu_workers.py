"""Actor and critic taking turns on one GPU (NCCL, a GPU memory backend), with the memory freed measured.

One placement-group bundle holds one GPU; the actor and the critic TrainGroups both sit on it
(``gpu_share=0.5`` each). Each step: the critic wakes, trains, sleeps; the actor wakes, trains with the
critic's values, sleeps; the actor then sends its weights over NCCL to an engine on the second GPU
(asleep: wake, reconnect, send, sleep). Device free memory is read after every transition.

Run: ``python benchmarks/gpu_workers.py [--backends pinned torch_memory_saver] [--steps 3]``
(needs CUDA; a second GPU for the weight update, which is skipped with one GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

GIB = 1024**3


def stage(backend: str, what: str) -> None:
    """One line per stage, flushed at once: a run that hangs or dies shows where it was."""
    print(f"[gpu_workers {time.strftime('%H:%M:%S')}] {backend}: {what}", flush=True)


@dataclass(frozen=True)
class OneGpu:
    """Both roles on bundle 0 of a one-GPU placement group."""

    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...] = (0,)
    gpu_share: float = 0.5
    cpu_share: float = 0.0


def make_model(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@contextmanager
def cpu_dry_run_model() -> Iterator[Path]:
    """A CPU-only local Ray instance and a tiny Llama (vocab 256) for a script's dry run."""
    ray.init(num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            yield make_model(Path(tmp) / "model", 64, 2, 256)
    finally:
        ray.shutdown()


def make_batch(n: int, prompt: int, response: int, vocab: int, seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {
        k: []
        for k in ("tokens", "response_length", "loss_mask", "reward", "rollout_log_probs", "prompt_index")
    }
    for i in range(n):
        tokens = torch.randint(0, vocab, (prompt + response,), generator=g)
        out["tokens"].append(tokens)
        out["response_length"].append(torch.tensor([response]))
        out["loss_mask"].append(torch.ones(response))
        out["reward"].append(torch.tensor([float(int(tokens[prompt]) % 2)]))
        out["rollout_log_probs"].append(torch.full((response,), -5.0))
        out["prompt_index"].append(torch.tensor([i // 4]))
    return out


def run(
    backend: str,
    model: Path,
    steps: int = 3,
    vocab: int = 32000,
    device: str = "cuda",
    settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` PPO steps with ``backend``; returns the measurements (GiB) and the value losses.

    ``device="cpu"`` (with ``backend="host"``) runs the same sequence on CPU as a dry run of this script.
    ``settings``: more ``TrainerConfig`` fields for both roles (e.g. ``{"backend": "megatron"}``).
    """
    on_gpu = device == "cuda"
    from transformers import AutoConfig

    from ppo_trainer.config import AlgorithmConfig, TrainerConfig
    from ppo_trainer.group import TrainGroup
    from ppo_value_transport import pack_fields, pair_values
    from ppo_weight_sync import RayEngineEndpoint
    from ppo_weight_sync.testing.engine import TensorEngine

    pg = placement_group([{"GPU": 1, "CPU": 1}] if on_gpu else [{"CPU": 1}])
    ray.get(pg.ready(), timeout=120)
    slots = OneGpu(pg, gpu_share=0.5 if on_gpu else 0.0)
    alg = AlgorithmConfig(lam=1.0, num_mini_batches=1)
    common: dict[str, Any] = {
        "model_path": str(model),
        "algorithm": alg,
        "device": device,
        "memory_backend": backend,
        "micro_batch_size": 8,
        "actor_lr": 1e-5,
        "critic_lr": 1e-5,
        "weight_sync_backend": "nccl" if on_gpu else "gloo",
        **(settings or {}),
    }
    stage(backend, "starting the critic group")
    critic = TrainGroup("critic", slots, TrainerConfig(role="critic", **common), timeout_s=300)
    stage(backend, "starting the actor group")
    actor = TrainGroup("actor", slots, TrainerConfig(role="actor", **common), timeout_s=300)
    engine_handle = None
    rows: list[tuple[str, float]] = []

    def free() -> float:
        return actor.memory_info()[0]["device_free"] / GIB if on_gpu else 0.0

    try:
        rows.append(("both resident (after setup)", free()))
        stage(backend, "both groups up; putting both to sleep")
        critic.sleep()
        actor.sleep()
        asleep_before = free()
        rows.append(("both asleep", asleep_before))
        after_first_step = asleep_before  # the first step's last transition overwrites it
        if torch.cuda.device_count() > 1 or not on_gpu:
            cfg = AutoConfig.from_pretrained(model)
            from transformers import AutoModelForCausalLM

            with torch.device("meta"):
                shapes = AutoModelForCausalLM.from_config(cfg)
            spec = {n: ("float32", list(p.shape)) for n, p in shapes.named_parameters()}
            stage(backend, "starting the engine and connecting the (asleep) actor")
            engine_handle = (
                ray.remote(TensorEngine)
                .options(num_gpus=1 if on_gpu else 0, num_cpus=0, max_concurrency=4)
                .remote(spec, seed=1, device=device)
            )
            actor.connect_engines([RayEngineEndpoint(engine_handle, num_gpus=1, name="engine-0")])
        value_losses, critic_freed, actor_freed, update_s = [], [], [], []
        samples = 32 if on_gpu else 8
        tokens = 128 if on_gpu else 8
        box = pack_fields(make_batch(samples, tokens, tokens, vocab, seed=0))
        # One rank on each side holding the same samples: the critic's rows map one to one.
        sample_ids = [list(range(samples))]
        for step in range(1, steps + 1):
            stage(backend, f"step {step}: critic wake + train")
            critic.wake_up()
            c = critic.train(step, [box])
            awake = free()
            stage(backend, f"step {step}: critic sleep")
            critic.sleep()
            asleep = free()
            critic_freed.append(asleep - awake)
            if step == 1:
                rows.append(("both asleep, after the critic's first step", asleep))
            value_losses.append(c.metrics["value_loss"])
            stage(backend, f"step {step}: actor wake + train")
            actor.wake_up()
            assert c.values is not None, "the critic returned no values"
            actor.train(step, [box], pair_values(c.values, sample_ids, sample_ids))
            awake = free()
            stage(backend, f"step {step}: actor sleep")
            actor.sleep()
            asleep = free()
            actor_freed.append(asleep - awake)
            if step == 1:
                rows.append(("both asleep, after the actor's first step", asleep))
                after_first_step = asleep
            if engine_handle is not None:
                stage(backend, f"step {step}: update_weights (asleep: wake, reconnect, send, sleep)")
                start = time.perf_counter()
                actor.update_weights(str(step))
                update_s.append(time.perf_counter() - start)
                stage(backend, f"step {step}: update_weights done in {update_s[-1]:.2f} s")
                if step == 1:
                    after_first_step = free()
                    rows.append(("both asleep, after the first weight update", after_first_step))
        after_training = free()
        rows.append(("both asleep (after training)", after_training))
        if on_gpu:
            # What torch's allocator still holds per role (0 when the rest is outside torch's cache).
            for role, group in (("critic", critic), ("actor", actor)):
                info = group.memory_info()[0]
                rows.append((f"{role} asleep: torch reserved", info["reserved"] / GIB))
                rows.append((f"{role} asleep: torch allocated", info["allocated"] / GIB))
        weights_match = None
        if engine_handle is not None:
            stage(backend, "comparing the engine's weights with the actor's")
            weights_match = ray.get(engine_handle.state.remote())["checksum"] == actor.weights_checksum()
        metrics = actor.pop_metrics()
        return {
            "backend": backend,
            "rows": rows,
            # Device memory the asleep roles hold after training that they did not hold before it. The
            # first step costs a one-time amount outside torch's cache (kernels loaded on first use, NCCL
            # set-up, cuBLAS handles); after it, what a step leaves behind must not grow.
            "first_step_cost_gib": asleep_before - after_first_step,
            "growth_after_first_step_gib": after_first_step - after_training,
            "critic_freed_gib": critic_freed,
            "actor_freed_gib": actor_freed,
            "value_losses": value_losses,
            "update_s": update_s,
            "weights_match": weights_match,
            "actor_sleep_gb_per_s": metrics.get("sleep/gb_per_s", 0.0),
            "actor_wake_gb_per_s": metrics.get("wake/gb_per_s", 0.0),
        }
    finally:
        stage(backend, "shutting down")
        for group in (actor, critic):
            group.shutdown()
        if engine_handle is not None:
            ray.kill(engine_handle)
        remove_placement_group(pg)


def print_report(result: dict[str, Any]) -> None:
    print(f"\n### backend = {result['backend']}")
    print("| state | device free (GiB) |\n|---|---|")
    for name, value in result["rows"]:
        print(f"| {name} | {value:.2f} |")
    print(
        "| step | critic sleep frees (GiB) | actor sleep frees (GiB) | critic value loss "
        "| weight update (s) |"
    )
    print("|---|---|---|---|---|")
    for i, (c, a, v) in enumerate(
        zip(result["critic_freed_gib"], result["actor_freed_gib"], result["value_losses"], strict=True)
    ):
        u = f"{result['update_s'][i]:.2f}" if result["update_s"] else "n/a"
        print(f"| {i + 1} | {c:.2f} | {a:.2f} | {v:.4f} | {u} |")
    print(
        f"asleep after the first step: {result['first_step_cost_gib']:.2f} GiB used once (not torch's cache),"
        f" {result['growth_after_first_step_gib']:.2f} GiB more over the later steps"
    )
    print(
        f"actor sleep {result['actor_sleep_gb_per_s']:.1f} GB/s, "
        f"wake {result['actor_wake_gb_per_s']:.1f} GB/s; "
        f"engine weights match the actor: {result['weights_match']}"
    )


def available_backends() -> list[str]:
    out = ["pinned"]
    if importlib.util.find_spec("torch_memory_saver") is not None:
        out.append("torch_memory_saver")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backends", nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the sequence on CPU, tiny model")
    args = parser.parse_args()
    if args.cpu_dry_run:
        with cpu_dry_run_model() as model:
            print_report(run("host", model, steps=2, vocab=256, device="cpu"))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to run")
        return 0
    backends = args.backends or available_backends()
    if "torch_memory_saver" not in backends:
        print("torch_memory_saver is not installed here: measuring the pinned backend only")
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    failures = 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_model(Path(tmp) / "model", args.hidden, args.layers, 32000)
            for backend in backends:
                result = run(backend, model, steps=args.steps)
                print_report(result)
                # Each role holds its fp32 weights and Adam state (~12 bytes/param): most of it must go.
                if min(result["critic_freed_gib"] + result["actor_freed_gib"]) <= 0.5:
                    print(f"FAIL: {backend}: a sleep freed <= 0.5 GiB")
                    failures += 1
                if result["value_losses"][-1] >= result["value_losses"][0]:
                    print(f"FAIL: {backend}: critic value loss did not go down {result['value_losses']}")
                    failures += 1
                if result["growth_after_first_step_gib"] > 0.1:
                    grew = result["growth_after_first_step_gib"]
                    print(f"FAIL: {backend}: asleep, the roles hold {grew:.2f} GiB more after later steps")
                    failures += 1
                if result["weights_match"] is False:
                    print(f"FAIL: {backend}: engine weights differ from the actor's")
                    failures += 1
    finally:
        ray.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
