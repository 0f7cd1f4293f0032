"""The torch and megatron backends take the same PPO steps on a real checkpoint: do they move alike?

Both actors (and critics) load the same Hugging Face folder and train on one fixed batch of
chat-templated arithmetic questions with right and wrong answers (rewards 1/0, rollout log-probs the
model's own at step 0). For each of ``--steps`` steps it records the step's metrics (loss, grad norm,
ppo_kl, clip fraction; the critic's value loss and grad norm) and the log-probs after the step; it
prints both backends side by side and the ratio, and writes JSON to ``--out``.

    python packages/trainer/benchmarks/backend_parity.py --model models/smollm2-135m-instruct

Needs CUDA and megatron-core (Python >= 3.12). Exits non-zero when a backend fails to run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

DEVICE = "cuda"


def arithmetic_batch(model: Path, n: int, seed: int) -> Any:
    from transformers import AutoTokenizer

    from ppo_trainer.batch import Samples

    tok = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(seed)
    fields: dict[str, list[torch.Tensor]] = {
        k: []
        for k in ("tokens", "response_length", "loss_mask", "reward", "rollout_log_probs", "prompt_index")
    }
    for i in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        right = i % 2 == 0
        answer = a + b if right else a + b + rng.choice([-3, -2, -1, 1, 2, 3])
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
            add_generation_prompt=True,
            tokenize=True,
        )
        if not isinstance(prompt, list):  # newer transformers return a BatchEncoding
            prompt = list(prompt["input_ids"])
        response = tok(f"{a} + {b} = {answer}<|im_end|>", add_special_tokens=False)["input_ids"]
        fields["tokens"].append(torch.tensor(list(prompt) + list(response)))
        fields["response_length"].append(torch.tensor([len(response)]))
        fields["loss_mask"].append(torch.ones(len(response)))
        fields["reward"].append(torch.tensor([1.0 if right else 0.0]))
        fields["rollout_log_probs"].append(torch.zeros(len(response)))
        fields["prompt_index"].append(torch.tensor([i // 8]))
    return Samples.from_fields(fields)


def trainer(model: Path, backend: str, role: str, groups: Any, lr: float) -> Any:
    from ppo_trainer import AlgorithmConfig, TrainerConfig
    from ppo_trainer.backend_protocol import DataParallel
    from ppo_trainer.backends import make_trainer

    config = TrainerConfig(
        role=role,  # type: ignore[arg-type]
        model_path=str(model),
        device=DEVICE,
        backend=backend,  # type: ignore[arg-type]
        algorithm=AlgorithmConfig(lam=1.0, gamma=1.0, num_mini_batches=2, entropy_coef=0.0),
        micro_batch_size=32,
        actor_lr=lr,
        critic_lr=5 * lr,
        lr_schedule="constant",
    )
    return make_trainer(config, DataParallel(), lambda tag: contextlib.nullcontext(), groups)


def run_backend(model: Path, backend: str, steps: int, lr: float, n: int, groups: Any) -> dict[str, Any]:
    samples = arithmetic_batch(model, n, seed=0)
    mask = samples.response_mask.bool()
    actor = trainer(model, backend, "actor", groups, lr)
    lp0 = actor.compute_log_probs(samples).float().cpu()
    samples = dataclasses.replace(samples, rollout_log_probs=lp0)
    out: dict[str, Any] = {"actor": [], "critic": [], "lp0_mean": float(lp0[mask].mean())}
    values = torch.zeros_like(samples.response_mask)
    for step in range(steps):
        actor.set_step(step + 1)
        metrics = actor.train_actor(samples, values)
        lp = actor.compute_log_probs(samples).float().cpu()
        delta = (lp - lp0)[mask]
        right = samples.reward.bool().unsqueeze(1).expand_as(mask)[mask]
        out["actor"].append(
            metrics
            | {
                "mean_abs_dlogp": float(delta.abs().mean()),
                "dlogp_right": float(delta[right].mean()),
                "dlogp_wrong": float(delta[~right].mean()),
            }
        )
    del actor
    torch.cuda.empty_cache()
    critic = trainer(model, backend, "critic", groups, lr)
    for step in range(steps):
        critic.set_step(step + 1)
        metrics, v, _ = critic.train_critic(samples)
        out["critic"].append(metrics | {"values_mean": float(v.float()[mask].mean())})
    del critic
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--backends", nargs="+", default=["torch", "megatron"])
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the torch backend")
    parser.add_argument("--out", type=Path, default=Path("backend_parity.json"))
    args = parser.parse_args()
    from ppo_lifecycle.process_groups import ReloadableProcessGroups
    from ppo_weight_sync import free_port

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    groups = ReloadableProcessGroups()
    groups.init_default(
        "nccl" if DEVICE == "cuda" else "gloo", f"tcp://127.0.0.1:{free_port()}", 1, 0, timedelta(seconds=300)
    )
    result = {b: run_backend(args.model, b, args.steps, args.lr, args.samples, groups) for b in args.backends}
    args.out.write_text(json.dumps(result, indent=1))
    for role in ("actor", "critic"):
        keys = sorted(set.intersection(*(set(result[b][role][0]) for b in args.backends)))
        print(f"== {role}: {' | '.join(args.backends)} per step")
        for key in keys:
            columns = zip(*([r[key] for r in result[b][role]] for b in args.backends), strict=True)
            print(f"{key:>22}: " + "  ".join("|".join(f"{v:+.4g}" for v in c) for c in columns))
    groups.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
