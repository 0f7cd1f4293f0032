"""The megatron backend on one GPU, against the torch backend: exits non-zero when a check fails.

Stages (each prints a line; a failed check prints FAIL and the script goes on to the next stage):

1. parity: a Qwen2-style model (GQA, QKV biases, tied embeddings) saved in bf16; the torch and
   megatron actors (and critics) load it. Same batch: log-probs and values (max abs difference), the
   loss at step 0, and the log-probs after each of a few PPO steps.
2. round trip: the megatron actor's weights in Hugging Face names (bf16) against the saved file, bit
   for bit, and the weight-sync checksum against the torch actor's.
3. sleep/wake: the megatron actor under ``Lifecycle`` with the pinned backend (its process groups
   destroyed and rebuilt): ``torch.cuda.memory_allocated`` before and after, identical log-probs after
   waking, and a training step on the rebuilt groups.
4. benchmark: one ``train_actor`` step (forward for the old log-probs, then forward/backward and the
   optimizer step) on a Llama-style model, torch backend against megatron, same batch.
5. workers (``--workers``): actor and critic taking turns on the GPU through Ray ``TrainGroup``s with
   ``backend='megatron'`` and torch_memory_saver (``gpu_workers.run``).

Run: ``python benchmarks/gpu_megatron.py [--hidden 2048 --layers 16] [--workers]``. Needs CUDA and
megatron-core (Python >= 3.12).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import torch

GIB = 1024**3
FAILURES: list[str] = []


def stage(what: str) -> None:
    print(f"[gpu_megatron {time.strftime('%H:%M:%S')}] {what}", flush=True)


def check(ok: bool, what: str) -> None:
    print(("ok:   " if ok else "FAIL: ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def _gpu_workers() -> Any:
    path = Path(__file__).resolve().parent / "gpu_workers.py"
    spec = importlib.util.spec_from_file_location("gpu_workers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_workers", module)
    spec.loader.exec_module(module)
    return module


def make_model(
    folder: Path, arch: str, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int, tied: bool
) -> Path:
    """A random model saved in bf16 (built on the GPU: seconds even at a billion parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kwargs: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": hidden * 11 // 4 // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
    }
    torch.manual_seed(0)
    with torch.device("cuda"):
        if arch == "qwen2":
            model: Any = Qwen2ForCausalLM(Qwen2Config(**kwargs))
        else:
            model = LlamaForCausalLM(LlamaConfig(**kwargs))
        with torch.no_grad():  # norms and biases away from ones and zeros: every tensor matters
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def init_groups() -> Any:
    from ppo_lifecycle import ReloadableProcessGroups
    from ppo_weight_sync import free_port

    torch.cuda.set_device(0)
    groups = ReloadableProcessGroups()
    groups.init_default("nccl", f"tcp://127.0.0.1:{free_port()}", 1, 0, timedelta(seconds=300))
    return groups


def config(model: Path, role: Any, backend: Any, **extra: Any) -> Any:
    from ppo_trainer import AlgorithmConfig, TrainerConfig

    fields: dict[str, Any] = {
        "algorithm": AlgorithmConfig(lam=1.0, num_mini_batches=1),
        "micro_batch_size": 8,
        "actor_lr": 1e-5,
        "critic_lr": 1e-5,
        **extra,
    }
    return TrainerConfig(
        role=role,
        model_path=str(model),
        device="cuda",
        backend=backend,
        **fields,
    )


def trainer(model: Path, role: str, backend: str, groups: Any, region: Any = None, **extra: Any) -> Any:
    from ppo_trainer.backend import DataParallel
    from ppo_trainer.backend_protocol import make_trainer

    noop = region or (lambda tag: __import__("contextlib").nullcontext())
    return make_trainer(config(model, role, backend, **extra), DataParallel(), noop, groups)


def samples(n: int, prompt: int, response: int, vocab: int, seed: int) -> Any:
    from ppo_trainer import Samples

    return Samples.from_fields(_gpu_workers().make_batch(n, prompt, response, vocab, seed))


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).max())


# ---------------------------------------------------------------------------------------- stages
def parity_and_round_trip(folder: Path, groups: Any, steps: int) -> Any:
    """Stages 1 and 2; returns the megatron actor for stage 3."""
    from safetensors.torch import load_file

    from ppo_weight_sync import checksum

    vocab = 4096
    model = make_model(folder / "parity", "qwen2", 512, 4, 8, 2, vocab, tied=True)
    batch = samples(32, 48, 48, vocab, seed=1)
    mask = batch.response_mask
    stage("parity: building the torch and megatron actors")
    torch_actor = trainer(model, "actor", "torch", groups)
    mega_actor = trainer(model, "actor", "megatron", groups)

    stage("round trip: Hugging Face -> megatron -> Hugging Face")
    saved = load_file(str(model / "model.safetensors"))
    ours = dict(mega_actor.named_weights(torch.bfloat16))
    saved_names = set(saved)
    extra_names = set(ours) - saved_names
    check(extra_names <= {"lm_head.weight"}, f"round trip names: extra {sorted(extra_names)[:4]}")
    check(saved_names <= set(ours), f"round trip names: missing {sorted(saved_names - set(ours))[:4]}")
    unequal = [n for n in saved_names & set(ours) if not torch.equal(ours[n].cpu(), saved[n])]
    check(not unequal, f"round trip: {len(saved)} tensors bit for bit equal (unequal: {unequal[:4]})")
    torch_weights = [(n, t.to(torch.bfloat16)) for n, t in torch_actor.named_weights()]
    same = checksum(torch_weights) == checksum(list(ours.items()))
    check(same, "weight-sync checksum (bf16) of the megatron actor equals the torch actor's")
    del ours, torch_weights

    stage("parity: log-probs, loss at step 0, PPO steps")
    lp_t = torch_actor.compute_log_probs(batch)
    lp_m = mega_actor.compute_log_probs(batch)
    diff0 = masked_max(lp_t, lp_m, mask)
    mean_abs = float(((lp_t - lp_m).abs() * mask).sum() / mask.sum())
    print(
        f"log-probs max abs diff {diff0:.4f}, mean abs diff {mean_abs:.5f} "
        f"(mean log-prob {float((lp_t * mask).sum() / mask.sum()):.3f})"
    )
    check(
        diff0 < 0.1 and mean_abs < 0.01, f"log-probs match: max {diff0:.4f} < 0.1, mean {mean_abs:.5f} < 0.01"
    )
    values = torch.zeros_like(mask)
    rows = []
    for step in range(steps):
        m_t = torch_actor.train_actor(batch, values)
        m_m = mega_actor.train_actor(batch, values)
        lp_t = torch_actor.compute_log_probs(batch)
        lp_m = mega_actor.compute_log_probs(batch)
        rows.append(
            (
                step,
                m_t["pg_loss"],
                m_m["pg_loss"],
                m_t["entropy"],
                m_m["entropy"],
                m_t["grad_norm"],
                m_m["grad_norm"],
                masked_max(lp_t, lp_m, mask),
            )
        )
    print(
        "| step | pg_loss torch | pg_loss megatron | entropy torch | entropy megatron "
        "| grad norm torch | grad norm megatron | log-prob max abs diff after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r[0]} | {r[1]:.5f} | {r[2]:.5f} | {r[3]:.4f} | {r[4]:.4f} "
            f"| {r[5]:.4f} | {r[6]:.4f} | {r[7]:.4f} |"
        )
    check(abs(rows[0][1] - rows[0][2]) < 0.02, f"step-0 pg_loss {rows[0][1]:.5f} vs {rows[0][2]:.5f}")
    check(abs(rows[0][3] - rows[0][4]) < 0.02 * max(1.0, abs(rows[0][3])), "step-0 entropy matches")
    check(
        abs(rows[0][5] - rows[0][6]) < 0.1 * rows[0][5],
        f"step-0 grad norm {rows[0][5]:.4f} vs {rows[0][6]:.4f}",
    )
    check(max(r[7] for r in rows) < 3 * max(diff0, 0.02), "log-probs still track after the PPO steps")
    del torch_actor

    stage("parity: critics")
    torch_critic = trainer(model, "critic", "torch", groups)
    mega_critic = trainer(model, "critic", "megatron", groups)
    v_t = torch_critic.compute_values(batch)
    v_m = mega_critic.compute_values(batch)
    vdiff = masked_max(v_t, v_m, mask)
    print(
        f"values max abs diff {vdiff:.4f} "
        f"(values mean abs {float((v_t.abs() * mask).sum() / mask.sum()):.3f})"
    )
    check(vdiff < 0.1, f"critic values match: max abs diff {vdiff:.4f} < 0.1")
    c_t, _, _ = torch_critic.train_critic(batch)
    c_m, _, _ = mega_critic.train_critic(batch)
    print(f"value_loss at step 0: torch {c_t['value_loss']:.5f}, megatron {c_m['value_loss']:.5f}")
    check(
        abs(c_t["value_loss"] - c_m["value_loss"]) < 0.02 * max(1.0, c_t["value_loss"]),
        "step-0 value loss matches",
    )
    del torch_critic, mega_critic
    return mega_actor, batch


def sleep_wake(actor: Any, batch: Any, groups: Any) -> None:
    """Stage 3 (the actor holds the only megatron objects still alive in this process)."""
    from ppo_lifecycle import Lifecycle, PinnedHostBackend

    memory = PinnedHostBackend(torch.device("cuda", 0))
    memory.track(actor.WEIGHTS_TAG, actor.weight_tensors)
    memory.track(actor.OPTIMIZER_TAG, actor.optimizer_tensors)
    life = Lifecycle(memory, groups, name="megatron-actor")
    life.add_pre_sleep_hook("release_gathered_params", actor.release_gathered)
    life.add_post_wake_hook("rebind_process_groups", actor.after_groups_rebuilt)
    before_lp = actor.compute_log_probs(batch)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    awake = torch.cuda.memory_allocated()
    tracked = sum(
        t.untyped_storage().nbytes()
        for t in {
            id(t.untyped_storage()): t for t in actor.weight_tensors() + actor.optimizer_tensors()
        }.values()
    )
    life.sleep()
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    print(
        f"memory_allocated awake {awake / GIB:.3f} GiB, asleep {asleep / GIB:.3f} GiB "
        f"(tracked {tracked / GIB:.3f} GiB)"
    )
    check(
        awake - asleep > 0.9 * tracked,
        f"sleep frees the tracked weights and optimizer state ({(awake - asleep) / GIB:.3f} GiB)",
    )
    check(not dist_alive(), "sleep destroyed the process groups")
    life.wake_up()
    after_lp = actor.compute_log_probs(batch)
    check(torch.equal(before_lp, after_lp), "log-probs after waking equal those before sleeping")
    metrics = actor.train_actor(batch, torch.zeros_like(batch.response_mask))
    check(
        metrics["grad_norm"] > 0, f"a PPO step on the rebuilt groups (grad norm {metrics['grad_norm']:.4f})"
    )
    life.sleep()
    life.wake_up()
    check(bool(torch.isfinite(actor.compute_log_probs(batch)).all()), "a second sleep/wake cycle")


def dist_alive() -> bool:
    import torch.distributed as dist

    return dist.is_initialized()


def benchmark(
    folder: Path, groups: Any, hidden: int, layers: int, repeats: int
) -> list[tuple[str, float, float, float]]:
    """Stage 4: median seconds of one train_actor step, tokens/s, peak GiB."""
    heads = max(1, hidden // 128)
    vocab = 32000
    model = make_model(folder / "bench", "llama", hidden, layers, heads, heads, vocab, tied=False)
    batch = samples(32, 256, 256, vocab, seed=2)
    tokens = sum(t.numel() for t in batch.tokens)
    out = []
    for backend in ("torch", "megatron"):
        stage(f"benchmark: {backend}, hidden {hidden}, {layers} layers")
        torch.cuda.reset_peak_memory_stats()
        t = trainer(model, "actor", backend, groups)
        values = torch.zeros_like(batch.response_mask)
        times = []
        for i in range(repeats + 1):
            torch.cuda.synchronize()
            start = time.perf_counter()
            t.train_actor(batch, values)
            torch.cuda.synchronize()
            if i:  # the first is warm-up
                times.append(time.perf_counter() - start)
        median = statistics.median(times)
        out.append((backend, median, tokens / median, torch.cuda.max_memory_allocated() / GIB))
        del t
        torch.cuda.empty_cache()
    print(f"\n| backend | train_actor step (s, median of {repeats}) | tokens/s | peak allocated (GiB) |")
    print("|---|---|---|---|")
    for name, median, rate, peak in out:
        print(f"| {name} | {median:.3f} | {rate:,.0f} | {peak:.1f} |")
    return out


def workers(folder: Path) -> None:
    import ray

    gpu = _gpu_workers()
    model = gpu.make_model(folder / "workers", hidden=512, layers=4, vocab=32000)
    ray.init(num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        for backend in gpu.available_backends()[::-1]:
            result = gpu.run(backend, model, steps=2, settings={"backend": "megatron"})
            gpu.print_report(result)
            check(
                min(result["critic_freed_gib"] + result["actor_freed_gib"]) > 0.2,
                f"workers {backend}: every sleep frees > 0.2 GiB",
            )
            check(
                result["value_losses"][-1] < result["value_losses"][0],
                f"workers {backend}: value loss goes down {result['value_losses']}",
            )
    finally:
        ray.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", action="store_true", help="also run stage 5 (Ray worker groups)")
    parser.add_argument("--skip-benchmark", action="store_true")
    parser.add_argument("--skip-parity", action="store_true", help="skip stages 1-3")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    import tempfile

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        groups = init_groups()
        actor: Any = None
        batch: Any = None
        try:
            if not args.skip_parity:
                actor, batch = parity_and_round_trip(folder, groups, args.steps)
        except Exception:
            traceback.print_exc()
            check(False, "parity and round trip raised")
        if actor is not None:
            try:
                sleep_wake(actor, batch, groups)
            except Exception:
                traceback.print_exc()
                check(False, "sleep/wake raised")
        del actor
        torch.cuda.empty_cache()
        if not args.skip_benchmark:
            try:
                benchmark(folder, groups, args.hidden, args.layers, args.repeats)
            except Exception:
                traceback.print_exc()
                check(False, "benchmark raised")
        groups.destroy()
        if args.workers:
            try:
                workers(folder)
            except Exception:
                traceback.print_exc()
                check(False, "workers raised")
    print(f"\n{len(FAILURES)} failure(s)" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
