"""The megatron backend on one GPU with a real checkpoint: one case per process (megatron's
``parallel_state``, NCCL and torch_memory_saver are process-wide), its measurements as JSON.

Run by ``test_gpu_megatron.py`` (which asserts on the JSON); by hand:

    python tests/_megatron_gpu_cases.py CASE OUT.json [--memory-backend pinned|torch_memory_saver]

Cases:

* ``kl_sleep_wake``: the actor with ``use_kl_loss`` (so a reference model) wired as ``TrainWorker.setup``
  wires it (memory backend from the config, the tensors tracked at setup, the lifecycle's hooks):
  every tensor of both models on the GPU, PPO steps with the KL term, two sleep/wake cycles with
  every held tensor and the log-probs of both models bit for bit after each wake.
* ``resume``: N steps, a megatron checkpoint, M more steps; a fresh trainer loads the checkpoint and
  takes the same M steps: the weights (float32 main and bf16), Adam's state, the log-probs bit for bit.
  Adam's state exists at setup and the pinned backend pins all of it at ``track()``.
* ``packed_parity``: ``train.pack_sequences`` against padded micro-batches, both megatron, same checkpoint
  and batch (ragged prompts and responses): the actor's log-probs, the reference's, the critic's values,
  and the first PPO step's metrics within bf16's rounding; the packed forwards take the varlen flash
  kernel (its per-sample SDPA fallback raises in this process).
* ``round_trip_parity``: the checkpoint into the megatron actor and back out (``named_weights``,
  ``hf_state_dict``, a written checkpoint's ``hf/model.safetensors``) bit for bit; log-probs at step 0
  of megatron against the torch backend on the same batch.

The model: ``$PPO_REAL_MODEL`` (a Hugging Face folder, e.g. SmolLM2-135M-Instruct) if set, else a Llama
with SmolLM2-135M's layout (hidden 576, 9 query heads over 3 KV heads of 64, MLP 1536, tied
embeddings, vocabulary 49152) and 4 layers, random bf16 weights saved by transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

# Deterministic cuBLAS for the bit-for-bit checks (before CUDA starts).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

STEPS_BEFORE_SAVE = 2
STEPS_AFTER_SAVE = 2


def smollm2_shaped(folder: Path, layers: int = 4) -> Path:
    """A random Llama with SmolLM2-135M's layout, saved by transformers in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layout: dict[str, Any] = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "num_hidden_layers": layers,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    }
    config = LlamaConfig(**layout)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model: Any = LlamaForCausalLM(config)
        with torch.no_grad():  # norms away from ones: a norm in the wrong slot or device shows
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def model_folder(tmp: Path) -> Path:
    real = os.environ.get("PPO_REAL_MODEL")
    return Path(real) if real else smollm2_shaped(tmp / "smollm2_shaped")


def vocab_of(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def batch(n: int, prompt: int, response: int, vocab: int, seed: int) -> Any:
    """Random tokens; rewards by a token's parity; rollout log-probs near the model's."""
    return samples_of([(prompt, response)] * n, vocab, torch.Generator().manual_seed(seed))


def samples_of(lengths: Iterable[tuple[int, int]], vocab: int, g: torch.Generator) -> Any:
    """A sample per (prompt, response) length pair: random tokens, a reward by a token's parity,
    rollout log-probs of -10, four samples per prompt index. ``lengths`` is read one pair at a time,
    between the samples' token draws (a lazy iterable may draw its pairs from ``g`` too)."""
    from ppo_trainer.batch import Samples

    fields: dict[str, list[torch.Tensor]] = {
        "tokens": [],
        "response_length": [],
        "loss_mask": [],
        "reward": [],
        "rollout_log_probs": [],
        "prompt_index": [],
    }
    for i, (prompt, response) in enumerate(lengths):
        tokens = torch.randint(0, vocab, (prompt + response,), generator=g)
        fields["tokens"].append(tokens)
        fields["response_length"].append(torch.tensor([response]))
        fields["loss_mask"].append(torch.ones(response))
        fields["reward"].append(torch.tensor([float(int(tokens[prompt]) % 2)]))
        fields["rollout_log_probs"].append(torch.full((response,), -10.0))
        fields["prompt_index"].append(torch.tensor([i // 4]))
    return Samples.from_fields(fields)


def init_groups() -> Any:
    from ppo_lifecycle.process_groups import ReloadableProcessGroups
    from ppo_weight_sync import free_port

    torch.cuda.set_device(0)
    groups = ReloadableProcessGroups()
    groups.init_default("nccl", f"tcp://127.0.0.1:{free_port()}", 1, 0, timedelta(seconds=300))
    return groups


def config(
    model: Path, backend: Any, memory_backend: Any = "auto", role: Any = "actor", packed: bool = False
) -> Any:
    from ppo_trainer.config import AlgorithmConfig, TrainerConfig

    return TrainerConfig(
        pack_sequences=packed,
        role=role,
        model_path=str(model),
        device="cuda",
        backend=backend,
        memory_backend=memory_backend,
        # The setting: the KL to the reference as a loss term (the actor holds the reference).
        algorithm=AlgorithmConfig(lam=1.0, num_mini_batches=1, use_kl_loss=True, kl_loss_coef=0.1),
        micro_batch_size=8,
        # Large enough for Adam's steps to move bf16 weights (a step of 1e-5 rarely crosses a bf16
        # rounding boundary of a weight near 0.02): the policy leaves the reference, the KL shows.
        actor_lr=1e-4,
        critic_lr=1e-5,
    )


def plain_trainer(model: Path, backend: str, groups: Any, role: str = "actor", packed: bool = False) -> Any:
    from ppo_trainer.backend_protocol import DataParallel
    from ppo_trainer.backends import make_trainer

    made = config(model, backend, role=role, packed=packed)
    return make_trainer(made, DataParallel(), lambda tag: contextlib.nullcontext(), groups)


def ragged_batch(n: int, vocab: int, seed: int) -> Any:
    """Prompts of 8-64 tokens and responses of 4-64: what packing removes the padding of."""
    g = torch.Generator().manual_seed(seed)

    def draw(low: int) -> int:
        return int(torch.randint(low, 65, (1,), generator=g))

    return samples_of(((draw(8), draw(4)) for _ in range(n)), vocab, g)


def packed_parity(tmp: Path) -> dict[str, Any]:
    from ppo_trainer import objective, packing

    def no_fallback(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("packed attention fell back to one SDPA call per sample on the GPU")

    packing.block_causal_sdpa = no_fallback  # the varlen kernel or nothing
    model = model_folder(tmp)
    groups = init_groups()
    samples = ragged_batch(64, vocab_of(model), seed=11)
    mask = samples.response_mask
    out: dict[str, Any] = {
        "tokens": int(sum(t.numel() for t in samples.tokens)),
        "response_tokens": int(mask.sum()),
    }
    results: dict[bool, dict[str, Any]] = {}
    for packed in (False, True):
        actor = plain_trainer(model, "megatron", groups, packed=packed)
        log_probs = actor.compute_log_probs(samples).float().cpu()
        reference = objective.score(actor, samples, reference=True).float().cpu()
        metrics = actor.train_actor(samples, zeros(samples))
        del actor
        torch.cuda.empty_cache()
        critic = plain_trainer(model, "megatron", groups, role="critic", packed=packed)
        values = critic.compute_values(samples).float().cpu()
        del critic
        torch.cuda.empty_cache()
        results[packed] = {
            "log_probs": log_probs,
            "reference": reference,
            "values": values,
            "metrics": metrics,
        }
    padded, packed_ = results[False], results[True]
    for key in ("log_probs", "reference", "values"):
        diff = (padded[key] - packed_[key]).abs() * mask
        out[f"{key}_max_abs_diff"] = float(diff.max())
        out[f"{key}_mean_abs_diff"] = float(diff.sum() / mask.sum())
        out[f"{key}_zero_on_padding"] = bool((packed_[key] * (1 - mask)).abs().max() == 0)
    out["log_prob_mean"] = float((padded["log_probs"] * mask).sum() / mask.sum())
    out["metrics_padded"] = {k: float(v) for k, v in padded["metrics"].items()}
    out["metrics_packed"] = {k: float(v) for k, v in packed_["metrics"].items()}
    groups.destroy()
    return out


def zeros(samples: Any) -> torch.Tensor:
    return torch.zeros_like(samples.response_mask)


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu", copy=True) for t in tensors]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def unequal(before: list[torch.Tensor], after: list[torch.Tensor]) -> int:
    """How many tensors differ in a bit (their bytes compared: NaN-safe, dtype-exact)."""
    if len(before) != len(after):
        return max(len(before), len(after))
    return sum(
        1
        for a, b in zip(before, after, strict=True)
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(_bytes(a), _bytes(b))
    )


def load_folder(model: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files (one or several shards)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(file)))
    if not out:
        raise FileNotFoundError(f"{model} holds no *.safetensors files")
    return out


def clear_rope_cache() -> None:
    """megatron caches RoPE's embedding per length (``lru_cache``): cleared, the next forward
    recomputes it from ``inv_freq``, so a lost ``inv_freq`` shows in the log-probs."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()


def device_free() -> int:
    """Free device memory once torch's cache is handed back (as ``TrainWorker.sleep`` does): what
    another process on the GPU could use. torch_memory_saver unmaps memory torch still counts as
    allocated, so ``memory_allocated`` would not show its sleep."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info()[0])


def unique_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


# ---------------------------------------------------------------------------------------- cases
def kl_sleep_wake(tmp: Path, memory_backend: str) -> dict[str, Any]:
    from ppo_lifecycle.lifecycle import Lifecycle
    from ppo_trainer import objective
    from ppo_trainer.backend_protocol import DataParallel
    from ppo_trainer.backends import make_trainer
    from ppo_trainer.megatron_backend import held_tensors, misplaced_tensors
    from ppo_trainer.worker import make_memory_backend

    model = model_folder(tmp)
    vocab = vocab_of(model)
    groups = init_groups()
    device = torch.device("cuda", 0)
    cfg = config(model, "megatron", memory_backend)
    # As TrainWorker.setup: the memory backend, the trainer built in its regions, tracked at once.
    memory = make_memory_backend(cfg, device)
    trainer: Any = make_trainer(cfg, DataParallel(), memory.region, groups)  # MegatronTrainer
    memory.track(trainer.WEIGHTS_TAG, trainer.weight_tensors)
    memory.track(trainer.OPTIMIZER_TAG, trainer.optimizer_tensors)
    life = Lifecycle(memory, groups, name="megatron-kl-actor")
    life.add_pre_sleep_hook("release_gathered_params", trainer.release_gathered)
    life.add_post_wake_hook("rebind_process_groups", trainer.after_groups_rebuilt)

    out: dict[str, Any] = {
        "memory_backend": type(memory).__name__,
        "has_reference": trainer.reference is not None,
        "misplaced_at_setup": misplaced_tensors(trainer._modules(), device),
        "reference_devices": sorted({str(t.device) for t in held_tensors(trainer.reference)}),
        "steps": [],
        "cycles": [],
    }
    batches = [batch(16, 32, 32, vocab, seed=20 + i) for i in range(3)]
    probe = batch(8, 24, 48, vocab, seed=99)  # another length than the steps' (72, not 64)
    out["steps"].append(trainer.train_actor(batches[0], zeros(batches[0])))
    for cycle in range(2):
        held = snapshot(trainer.weight_tensors() + trainer.optimizer_tensors())
        lp = trainer.compute_log_probs(probe)
        ref_lp = objective.score(trainer, probe, reference=True)
        tracked = unique_bytes(trainer.weight_tensors() + trainer.optimizer_tensors())
        awake = device_free()
        life.sleep()
        asleep = device_free()
        life.wake_up()
        clear_rope_cache()
        out["cycles"].append(
            {
                "freed_bytes": asleep - awake,
                "tracked_bytes": tracked,
                "held_tensors": len(held),
                "held_unequal_after_wake": unequal(
                    held, trainer.weight_tensors() + trainer.optimizer_tensors()
                ),
                "misplaced_after_wake": misplaced_tensors(trainer._modules(), device),
                "log_probs_equal": bool(torch.equal(lp, trainer.compute_log_probs(probe))),
                "reference_log_probs_equal": bool(
                    torch.equal(ref_lp, objective.score(trainer, probe, reference=True))
                ),
            }
        )
        out["steps"].append(trainer.train_actor(batches[cycle + 1], zeros(batches[cycle + 1])))
    del trainer
    close = getattr(memory, "close", None)  # the pinned buffers (both backends here have them)
    if close is not None:
        close()
    groups.destroy()
    return out


def _deterministic() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    # Deterministic mode would also fill torch.empty with NaN; megatron's buffers are not all written.
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]


def resume(tmp: Path) -> dict[str, Any]:
    from ppo_lifecycle.memory.pinned import PinnedHostBackend
    from ppo_trainer.checkpoint import megatron_io

    _deterministic()
    model = model_folder(tmp)
    vocab = vocab_of(model)
    groups = init_groups()
    n, m = STEPS_BEFORE_SAVE, STEPS_AFTER_SAVE
    batches = [batch(16, 32, 32, vocab, seed=40 + i) for i in range(n + m)]
    probe = batch(8, 24, 48, vocab, seed=98)
    out: dict[str, Any] = {"n": n, "m": m}

    first = plain_trainer(model, "megatron", groups)
    out["adam_entries_at_setup"] = first.optimizer_state_entries()
    out["adam_shards"] = sum(len(g["params"]) for o in first._optimizers() for g in o.optimizer.param_groups)
    memory = PinnedHostBackend(torch.device("cuda", 0))
    memory.track(first.WEIGHTS_TAG, first.weight_tensors)
    memory.track(first.OPTIMIZER_TAG, first.optimizer_tensors)
    out["pinned_at_track"] = memory.pinned_bytes
    metrics = [first.train_actor(b, zeros(b)) for b in batches[:n]]
    out["tracked_after_steps"] = unique_bytes(first.weight_tensors() + first.optimizer_tensors())
    memory.close()
    folder = tmp / "checkpoint" / "actor"
    megatron_io.save_shard(first, folder, step=n)
    metrics += [first.train_actor(b, zeros(b)) for b in batches[n:]]
    whole = {
        "main": first.hf_state_dict(),
        "bf16": {k: v.detach().cpu().clone() for k, v in first.named_weights()},
        "adam": first.hf_optimizer_state(),
        "log_probs": first.compute_log_probs(probe).cpu(),
    }
    del first
    torch.cuda.empty_cache()

    resumed = plain_trainer(model, "megatron", groups)
    out["loaded_step"] = megatron_io.load_shard(resumed, folder)
    resumed_metrics = [resumed.train_actor(b, zeros(b)) for b in batches[n:]]
    again = {
        "main": resumed.hf_state_dict(),
        "bf16": {k: v.detach().cpu().clone() for k, v in resumed.named_weights()},
        "adam": resumed.hf_optimizer_state(),
        "log_probs": resumed.compute_log_probs(probe).cpu(),
    }
    out["kl_loss_after_save"] = [x["kl_loss"] for x in metrics[n:]]
    out["metrics_equal"] = metrics[n:] == resumed_metrics
    for key in ("main", "bf16"):
        a, b = whole[key], again[key]
        out[f"{key}_names_equal"] = sorted(a) == sorted(b)
        out[f"{key}_unequal"] = [k for k in a if k in b and not torch.equal(a[k], b[k])]
    sa, sb = whole["adam"]["state"], again["adam"]["state"]
    out["adam_names_equal"] = sorted(sa) == sorted(sb)
    out["adam_steps"] = sorted({float(e["step"]) for e in sb.values()})
    out["adam_unequal"] = [
        k
        for k in sa
        if k in sb and not all(torch.equal(sa[k][x], sb[k][x]) for x in ("exp_avg", "exp_avg_sq"))
    ]
    out["log_probs_equal"] = bool(torch.equal(whole["log_probs"], again["log_probs"]))
    # The run moved away from the checkpoint's model: the comparison is not of two untouched copies.
    initial = load_folder(model)
    name = next(k for k in initial if k.endswith("layers.0.self_attn.q_proj.weight"))
    out["main_changed_since_setup"] = not torch.equal(whole["main"][name], initial[name].float())
    groups.destroy()
    return out


def round_trip_parity(tmp: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from ppo_trainer import objective
    from ppo_trainer.checkpoint import megatron_io

    model = model_folder(tmp)
    vocab = vocab_of(model)
    groups = init_groups()
    saved = load_folder(model)
    out: dict[str, Any] = {
        "file_tensors": len(saved),
        "file_dtypes": sorted({str(t.dtype) for t in saved.values()}),
    }
    # megatron holds bf16 weights made from the file: a bf16 checkpoint round-trips exactly; a float32
    # one (the imported SmolLM2) as its bf16 rounding. The float32 main weights are the file's values.
    file_float = {k: v.float() for k, v in saved.items()}
    saved = {k: v.to(torch.bfloat16) for k, v in saved.items()}

    mega = plain_trainer(model, "megatron", groups)
    bf16 = {k: v.detach().cpu() for k, v in mega.named_weights(torch.bfloat16)}
    out["names_missing"] = sorted(set(saved) - set(bf16))
    out["names_extra"] = sorted(set(bf16) - set(saved))
    out["bf16_unequal"] = [
        k
        for k in saved
        if k in bf16 and not torch.equal(bf16[k].view(torch.int16), saved[k].view(torch.int16))
    ]
    main = mega.hf_state_dict()
    out["main_unequal"] = [k for k in file_float if k in main and not torch.equal(main[k], file_float[k])]
    folder = tmp / "round_trip" / "actor"
    megatron_io.save_shard(mega, folder, step=0)
    written = load_file(str(folder / "hf" / "model.safetensors"))
    out["written_names_equal"] = sorted(written) == sorted(saved)
    out["written_unequal"] = [
        k for k in saved if k in written and not torch.equal(written[k].to(saved[k].dtype), saved[k])
    ]

    # Log-probs at step 0 against the torch backend, same checkpoint, same batch.
    samples = batch(32, 48, 48, vocab, seed=7)
    mask = samples.response_mask
    lp_m = mega.compute_log_probs(samples).float().cpu()
    ref_m = objective.score(mega, samples, reference=True).float().cpu()
    first = mega.train_actor(samples, zeros(samples))
    del mega
    torch.cuda.empty_cache()
    torch_actor = plain_trainer(model, "torch", groups)
    lp_t = torch_actor.compute_log_probs(samples).float().cpu()
    diff = (lp_t - lp_m).abs() * mask
    out["log_prob_max_abs_diff"] = float(diff.max())
    out["log_prob_mean_abs_diff"] = float(diff.sum() / mask.sum())
    out["log_prob_mean"] = float((lp_t * mask).sum() / mask.sum())
    # The reference and the actor hold the same weights at step 0 (the actor's are views into DDP's
    # buffer; cuBLAS may pick other kernels for them, hence a difference, not equality).
    out["reference_vs_actor_max_abs_diff"] = float(((lp_m - ref_m).abs() * mask).max())
    out["ref_kl_at_step_0"] = first.get("ref_kl")
    out["kl_loss_at_step_0"] = first.get("kl_loss")
    del torch_actor
    groups.destroy()
    return out


CASES = {"kl_sleep_wake", "resume", "round_trip_parity", "packed_parity"}


@contextlib.contextmanager
def _folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--memory-backend", default="pinned", choices=["pinned", "torch_memory_saver"])
    args = parser.parse_args()
    start = time.perf_counter()
    with _folder() as tmp:
        if args.case == "kl_sleep_wake":
            result = kl_sleep_wake(tmp, args.memory_backend)
        elif args.case == "resume":
            result = resume(tmp)
        elif args.case == "packed_parity":
            result = packed_parity(tmp)
        else:
            result = round_trip_parity(tmp)
    result["seconds"] = time.perf_counter() - start
    result["model"] = os.environ.get("PPO_REAL_MODEL", "smollm2-shaped (random, 4 layers)")
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, default=str)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
