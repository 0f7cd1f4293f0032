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
5. optimizer state (``--skip-optimizer`` skips it): Adam's state made at setup (present before the
   first step, tracked and pinned at ``track()``; the first step bit for bit the same as with the lazy
   state); a megatron checkpoint resumed by a fresh megatron trainer (actor and critic: the optimizer
   state and the float32 main weights exactly as saved, the next step equal to the uninterrupted
   run's); a torch checkpoint resumed by megatron and a megatron one by torch (state exactly as
   saved); the first sleep against later ones (GB/s, pinned backend).
6. workers (``--workers``): actor and critic taking turns on the GPU through Ray ``TrainGroup``s with
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
# Deterministic cuBLAS for the resume stage's equality checks (set before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

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
    from ppo_lifecycle.process_groups import ReloadableProcessGroups
    from ppo_weight_sync import free_port

    torch.cuda.set_device(0)
    groups = ReloadableProcessGroups()
    groups.init_default("nccl", f"tcp://127.0.0.1:{free_port()}", 1, 0, timedelta(seconds=300))
    return groups


def config(model: Path, role: Any, backend: Any, **extra: Any) -> Any:
    from ppo_trainer.config import AlgorithmConfig, TrainerConfig

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
    from ppo_trainer.backend_protocol import DataParallel
    from ppo_trainer.backends import make_trainer

    noop = region or (lambda tag: __import__("contextlib").nullcontext())
    return make_trainer(config(model, role, backend, **extra), DataParallel(), noop, groups)


def samples(n: int, prompt: int, response: int, vocab: int, seed: int) -> Any:
    from ppo_trainer.batch import Samples

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
    from ppo_lifecycle.lifecycle import Lifecycle
    from ppo_lifecycle.memory import PinnedHostBackend

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


# ---------------------------------------------------------------------------------------- optimizer state
def _same_state(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, str]:
    """Two ``optimizer.pt`` dicts hold the same step and moments, bit for bit (by name)."""
    if set(a["state"]) != set(b["state"]):
        return False, f"names differ: {sorted(set(a['state']) ^ set(b['state']))[:4]}"
    for name, entry in a["state"].items():
        other = b["state"][name]
        if float(entry["step"]) != float(other["step"]):
            return False, f"{name}: step {float(entry['step'])} vs {float(other['step'])}"
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = entry[key].float().cpu(), other[key].float().cpu()
            if not torch.equal(x, y):
                return False, f"{name}.{key}: max abs diff {float((x - y).abs().max()):.3e}"
    return True, f"{len(a['state'])} parameters, step {float(next(iter(a['state'].values()))['step']):.0f}"


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, str]:
    names = set(a) & set(b)
    unequal = [n for n in names if not torch.equal(a[n].float().cpu(), b[n].float().cpu())]
    return not unequal and len(names) > 0, f"{len(names)} tensors, unequal {unequal[:3]}"


def _adam_entries(t: Any) -> int:
    return sum(len(g["params"]) for opt in t._optimizers() for g in opt.optimizer.param_groups)


def optimizer_state(folder: Path, groups: Any, steps: int) -> None:
    """Stage 5 (see the module docstring)."""
    from megatron.core.optimizer import ChainedOptimizer

    from ppo_lifecycle.lifecycle import Lifecycle
    from ppo_lifecycle.memory.pinned import PinnedHostBackend
    from ppo_trainer.checkpoint import megatron_io, torch_io

    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode would also fill torch.empty with NaN; megatron's buffers are not all written.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    vocab = 4096
    model = make_model(folder / "optimizer", "qwen2", 512, 4, 8, 2, vocab, tied=True)
    batches = [samples(32, 48, 48, vocab, seed=10 + i) for i in range(steps + 1)]
    mask = batches[-1].response_mask

    def zeros(b: Any) -> torch.Tensor:
        return torch.zeros_like(b.response_mask)

    stage("optimizer: Adam's state at setup, first step against the lazy state")
    eager = trainer(model, "actor", "megatron", groups)
    print(
        f"megatron's optimizer: {type(eager.optimizer).__name__}, inner "
        f"{type(eager._optimizers()[0].optimizer).__name__}, "
        f"chained {isinstance(eager.optimizer, ChainedOptimizer)}"
    )
    entries = eager.optimizer_state_entries()
    check(entries == _adam_entries(eager) > 0, f"Adam's state exists at setup ({entries} main-weight shards)")
    lazy = trainer(model, "actor", "megatron", groups)
    for opt in lazy._optimizers():
        opt.optimizer.state.clear()  # what megatron had before: the first step makes the state
    check(lazy.optimizer_state_entries() == 0, "the lazy trainer starts without Adam state")
    m_e, m_l = (
        eager.train_actor(batches[0], zeros(batches[0])),
        lazy.train_actor(batches[0], zeros(batches[0])),
    )
    lp_e, lp_l = eager.compute_log_probs(batches[0]), lazy.compute_log_probs(batches[0])
    same, why = _same_state(eager.hf_optimizer_state(), lazy.hf_optimizer_state())
    check(
        m_e == m_l and torch.equal(lp_e, lp_l) and same,
        "first step with the state made at setup is bit for bit the lazy one "
        f"(metrics, log-probs, Adam: {why})",
    )
    del lazy
    torch.cuda.empty_cache()

    stage("optimizer: megatron -> megatron resume")
    for i in range(1, steps):
        eager.train_actor(batches[i], zeros(batches[i]))
    megatron_io.save_shard(eager, folder / "ck_mm" / "actor", step=steps)
    saved_opt, saved_w = eager.hf_optimizer_state(), eager.hf_state_dict()
    saved_bf16 = {n: t.clone() for n, t in eager.named_weights()}
    file_opt = torch.load(folder / "ck_mm" / "actor" / "optimizer.pt", weights_only=True)
    same, why = _same_state(file_opt, saved_opt)
    check(
        same and all(float(e["step"]) == steps for e in file_opt["state"].values()),
        f"optimizer.pt holds the gathered state in HF names at step {steps} ({why})",
    )
    m_a = eager.train_actor(batches[steps], zeros(batches[steps]))
    lp_a = eager.compute_log_probs(batches[steps])
    del eager
    torch.cuda.empty_cache()
    fresh = trainer(model, "actor", "megatron", groups)
    check(megatron_io.load_shard(fresh, folder / "ck_mm" / "actor") == steps, "load returns the step")
    same, why = _same_state(fresh.hf_optimizer_state(), saved_opt)
    check(same, f"resumed Adam state equals the saved one bit for bit ({why})")
    same, why = _same_weights(fresh.hf_state_dict(), saved_w)
    check(same, f"resumed float32 main weights equal the saved ones ({why})")
    same, why = _same_weights(dict(fresh.named_weights()), saved_bf16)
    check(same, f"resumed bf16 model weights equal the saved ones ({why})")
    m_b = fresh.train_actor(batches[steps], zeros(batches[steps]))
    lp_b = fresh.compute_log_probs(batches[steps])
    diff = masked_max(lp_a, lp_b, mask)
    print(
        f"resume: next step pg_loss {m_a['pg_loss']:.6f} / {m_b['pg_loss']:.6f} (uninterrupted / resumed), "
        f"grad norm {m_a['grad_norm']:.6f} / {m_b['grad_norm']:.6f}, "
        f"log-probs after it max abs diff {diff:.3e}"
    )
    check(
        m_a == m_b and torch.equal(lp_a, lp_b),
        "the resumed step equals the uninterrupted run's "
        f"(metrics and log-probs bit for bit; max diff {diff:.3e})",
    )
    del fresh
    torch.cuda.empty_cache()

    stage("optimizer: megatron critic resume")
    critic = trainer(model, "critic", "megatron", groups)
    for i in range(steps):
        critic.train_critic(batches[i])
    megatron_io.save_shard(critic, folder / "ck_mm" / "critic", step=steps)
    saved_opt = critic.hf_optimizer_state()
    c_a, v_a, _ = critic.train_critic(batches[steps])
    del critic
    critic = trainer(model, "critic", "megatron", groups)
    megatron_io.load_shard(critic, folder / "ck_mm" / "critic")
    same, why = _same_state(critic.hf_optimizer_state(), saved_opt)
    check(
        same and "value_head.weight" in saved_opt["state"],
        f"critic: resumed Adam state equals the saved one ({why})",
    )
    c_b, v_b, _ = critic.train_critic(batches[steps])
    check(
        c_a == c_b and torch.equal(v_a, v_b),
        f"critic: the resumed step equals the uninterrupted one "
        f"(value_loss {c_a['value_loss']:.6f} / {c_b['value_loss']:.6f})",
    )
    del critic
    torch.cuda.empty_cache()

    stage("optimizer: torch -> megatron and megatron -> torch")
    source = trainer(model, "actor", "torch", groups)
    for i in range(steps):
        source.train_actor(batches[i], zeros(batches[i]))
    torch_io.save_shard(source, folder / "ck_t" / "actor", step=steps)
    t_opt, t_w = source.hf_optimizer_state(), source.hf_state_dict()
    mega = trainer(model, "actor", "megatron", groups)
    check(
        megatron_io.load_shard(mega, folder / "ck_t" / "actor") == steps,
        "torch checkpoint loads into megatron",
    )
    same, why = _same_state(mega.hf_optimizer_state(), t_opt)
    check(same, f"torch -> megatron: Adam state as the torch backend saved it ({why})")
    same, why = _same_weights(mega.hf_state_dict(), t_w)
    check(same, f"torch -> megatron: float32 main weights as saved ({why})")
    m_t = source.train_actor(batches[steps], zeros(batches[steps]))
    m_m = mega.train_actor(batches[steps], zeros(batches[steps]))
    lp_diff = masked_max(
        source.compute_log_probs(batches[steps]), mega.compute_log_probs(batches[steps]), mask
    )
    print(
        f"torch -> megatron: next step pg_loss {m_t['pg_loss']:.5f} / {m_m['pg_loss']:.5f}, grad norm "
        f"{m_t['grad_norm']:.4f} / {m_m['grad_norm']:.4f}, log-probs after it max abs diff {lp_diff:.4f}"
    )
    check(
        lp_diff < 0.1,
        f"torch -> megatron: the next step tracks the torch run (log-prob max diff {lp_diff:.4f})",
    )
    del source
    megatron_io.save_shard(mega, folder / "ck_m" / "actor", step=steps + 1)
    m_opt, m_w = mega.hf_optimizer_state(), mega.hf_state_dict()
    back = trainer(model, "actor", "torch", groups)
    check(
        torch_io.load_shard(back, folder / "ck_m" / "actor") == steps + 1,
        "megatron checkpoint loads into torch",
    )
    same, why = _same_state(back.hf_optimizer_state(), m_opt)
    check(same, f"megatron -> torch: Adam state as megatron saved it ({why})")
    same, why = _same_weights(back.hf_state_dict(), m_w)
    check(same, f"megatron -> torch: weights are megatron's float32 main weights ({why})")
    metrics = back.train_actor(batches[0], zeros(batches[0]))
    check(
        metrics["grad_norm"] > 0 and metrics["optimizer_steps"] == 1.0,
        "megatron -> torch: the torch trainer steps on",
    )
    del back, mega
    torch.use_deterministic_algorithms(False)
    torch.cuda.empty_cache()

    stage("optimizer: tracked at setup, first sleep against later ones (pinned backend)")
    sleeper = trainer(model, "actor", "megatron", groups)
    memory = PinnedHostBackend(torch.device("cuda", 0))
    # As TrainWorker.setup does: track right after the trainer is built, before any step.
    memory.track(sleeper.WEIGHTS_TAG, sleeper.weight_tensors)
    memory.track(sleeper.OPTIMIZER_TAG, sleeper.optimizer_tensors)
    pinned_at_track = memory.pinned_bytes
    sleeper.train_actor(batches[0], zeros(batches[0]))  # the state as a run holds it

    def unique_bytes(tensors: list[torch.Tensor]) -> int:
        return sum(
            t.untyped_storage().nbytes() for t in {id(t.untyped_storage()): t for t in tensors}.values()
        )

    tracked = unique_bytes(sleeper.weight_tensors() + sleeper.optimizer_tensors())
    opt_bytes = unique_bytes(sleeper.optimizer_tensors())
    print(
        f"tracked after a step {tracked / GIB:.3f} GiB (optimizer {opt_bytes / GIB:.3f} GiB), "
        f"pinned at track() {pinned_at_track / GIB:.3f} GiB"
    )
    check(pinned_at_track >= tracked, "every byte the step holds (Adam's state too) was pinned at track()")
    life = Lifecycle(memory, groups, name="megatron-optimizer")
    life.add_pre_sleep_hook("release_gathered_params", sleeper.release_gathered)
    life.add_post_wake_hook("rebind_process_groups", sleeper.after_groups_rebuilt)
    seconds = []
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        life.sleep()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        life.wake_up()
        sleeper.train_actor(batches[0], zeros(batches[0]))
    check(memory.pinned_bytes == pinned_at_track, "no sleep pinned more host memory")
    first, steady = seconds[0], statistics.median(seconds[1:])
    print(
        f"sleep: first {first:.3f} s ({tracked / first / 1e9:.1f} GB/s), later median {steady:.3f} s "
        f"({tracked / steady / 1e9:.1f} GB/s) over {len(seconds) - 1}"
    )
    # The seconds are reported, not checked: a timing bound failed once in a full gpu_all.sh run (0.692
    # against 0.506 s, 2026-12-03) with every byte pinned at track(). That behaviour, no pinning in a
    # sleep, is what the byte counts above check.
    del sleeper
    memory.close()


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
    parser.add_argument("--workers", action="store_true", help="also run stage 6 (Ray worker groups)")
    parser.add_argument("--skip-benchmark", action="store_true")
    parser.add_argument("--skip-parity", action="store_true", help="skip stages 1-3")
    parser.add_argument("--skip-optimizer", action="store_true", help="skip stage 5")
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
        if not args.skip_optimizer:
            try:
                optimizer_state(folder, groups, args.steps)
            except Exception:
                traceback.print_exc()
                check(False, "optimizer state raised")
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
