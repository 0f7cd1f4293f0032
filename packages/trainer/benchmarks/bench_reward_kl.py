"""What reward-level KL costs the critic: its train step with and without the reference forward.

With ``kl_coef > 0`` the critic holds the reference model and, once per step before it trains, runs
a no-grad forward of it over the batch to shape the token rewards (the actor then needs none). The
table gives the critic's step with ``kl_coef = 0`` and ``> 0``, and the reference forward alone.

Run: ``uv run python packages/trainer/benchmarks/bench_reward_kl.py`` (CPU); prints a Markdown table.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_train_step import SIZES, cpu_name, make_model, make_samples

from ppo_trainer.backend import TorchTrainer
from ppo_trainer.config import AlgorithmConfig, TrainerConfig


def seconds(fn: object, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    hidden, layers, heads, vocab, n, prompt, response, micro = SIZES["cpu"]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "m", hidden, layers, heads, vocab)
        samples = make_samples(n, prompt, response, vocab)
        rows = []
        for kl_coef in (0.0, 0.05):
            config = TrainerConfig(
                role="critic",
                model_path=str(model),
                algorithm=AlgorithmConfig(kl_coef=kl_coef),
                micro_batch_size=micro,
            )
            critic = TorchTrainer(config)
            step = seconds(lambda critic=critic: critic.train_critic(samples))
            ref = (
                seconds(lambda critic=critic: critic.token_rewards(samples))
                if critic.reference is not None
                else 0.0
            )
            rows.append((kl_coef, step, ref))
    base = rows[0][1]
    print(f"critic step, {n} samples x ({prompt} + {response}) tokens, hidden {hidden} x {layers} layers,")
    print(f"1 thread of {cpu_name()}; median of 5:\n")
    print("| kl_coef | critic step (s) | reference forward (s) | step vs kl_coef=0 |")
    print("|---:|---:|---:|---:|")
    for kl_coef, step, ref in rows:
        print(f"| {kl_coef} | {step:.3f} | {ref:.3f} | {step / base:.2f}x |")


if __name__ == "__main__":
    main()
