"""Partial rollouts against the synchronous step, in one call, at a long-tailed workload on one GPU.

Two runs of ``gpu_budget.py``'s 1-GPU colocated scenario (``configs/2gpu-colocate.yaml`` with
``placement.actor_gpus=1``: engine, actor and shared critic take turns on the GPU) with the 0.82B
model of random weights, 32 prompts x 8 samples = 256 samples a step, each sample's response length
drawn from a lognormal (median ``--median``, at most ``--max`` tokens; eos ignored), packed training:

- ``sync``: every step generates its 256 samples to the end;
- ``partial``: ``rollout.partial`` (``finish_fraction`` ``--finish-fraction``, ``max_staleness``
  ``--max-staleness``): a step trains the groups complete by the budget, the rest continue.

Printed per run, over the steps after the first: trained tokens/s (the response tokens the actor
trained on over the steps' seconds), the mean step and generate seconds, the engines' idle share of
the rollout's wall time (``rollout/engine_idle_share``), the share of trained tokens by staleness;
then the partial run's trained tokens/s over the synchronous run's. Checks: losses finite, the engines
end with the actor's weights, every trained token at most ``max_staleness`` versions old.

    python packages/ppo_driver/benchmarks/partial_rollouts.py                 # one GPU (about 8 min)
    python packages/ppo_driver/benchmarks/partial_rollouts.py --cpu-smoke     # the same path, tiny, CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_budget  # the scenario, model and long-tail settings live there


def run(mode: str, root: Path, args: argparse.Namespace, tail: gpu_budget.LongTail) -> list[dict[str, Any]]:
    """One training run; its metrics, each step's."""
    from rich.console import Console

    from ppo_driver.config import load_config
    from ppo_driver.loop import train

    scenario = gpu_budget.SCENARIOS["colocate-1gpu"]
    sets = [*gpu_budget.overrides(args.cpu_smoke, args.steps, tail), *scenario.extra, "algorithm.tis_cap=2.0"]
    if args.cpu_smoke:
        sets += ["rollout.prompts_per_step=4", "rollout.sampling.n_samples_per_prompt=4"]
    if mode == "partial":
        sets += [
            "rollout.partial.enabled=true",
            f"rollout.partial.finish_fraction={args.finish_fraction}",
            f"rollout.partial.max_staleness={args.max_staleness}",
        ]
    config = load_config(gpu_budget.REPO / scenario.config, sets)
    result = train(config, root / mode, console=Console(stderr=True))
    gpu_budget.check(result.weights_match, f"{mode}: the engines end with the actor's weights")
    for r in result.history:
        losses = [r["actor/loss"], r["critic/loss"]]
        gpu_budget.check(all(math.isfinite(x) for x in losses), f"{mode} step {r['step']}: losses finite")
        gpu_budget.check(r["rollout/staleness"] <= args.max_staleness, f"{mode} step {r['step']}: staleness")
    return result.history


def summary(history: Sequence[dict[str, Any]]) -> dict[str, float]:
    rest = list(history[1:]) or list(history)
    seconds = sum(r["time/step_s"] for r in rest)
    tokens = sum(r["rollout/samples"] * r["rollout/response_length_mean"] for r in rest)
    out = {
        "trained_tokens_per_s": tokens / seconds,
        "step_s": statistics.fmean(r["time/step_s"] for r in rest),
        "generate_s": statistics.fmean(r["time/generate_s"] for r in rest),
        "engine_idle_share": statistics.fmean(float(r.get("rollout/engine_idle_share", 0.0)) for r in rest),
        "samples": statistics.fmean(r["rollout/samples"] for r in rest),
    }
    for age in ("0", "1", "2plus"):
        key = f"rollout/partial/token_share_{age}"
        out[f"token_share_{age}"] = statistics.fmean(
            float(r.get(key, 1.0 if age == "0" else 0.0)) for r in rest
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU: the same path and checks"
    )
    parser.add_argument("--steps", type=int, default=None, help="default 4 (3 with --cpu-smoke)")
    parser.add_argument("--median", type=float, default=512.0)
    parser.add_argument("--max", type=int, default=2048)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--finish-fraction", type=float, default=0.75)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="run folders and partial.json")
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.cpu_smoke else 4)
    tail = (
        gpu_budget.LongTail(8.0, 24, args.sigma)
        if args.cpu_smoke
        else gpu_budget.LongTail(args.median, args.max, args.sigma)
    )
    from ppo_rollout.rollout_fns import register_rollout_function
    from ppo_rollout.testing.long_tail import LongTailRollout

    register_rollout_function("long_tail")(LongTailRollout(tail.median, tail.longest, tail.sigma))
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="partial-"))
    out.mkdir(parents=True, exist_ok=True)
    results = {mode: summary(run(mode, out, args, tail)) for mode in ("sync", "partial")}
    print(
        f"\n{gpu_budget.machine()}; lognormal lengths median {tail.median:g}, max {tail.longest}; "
        f"finish_fraction {args.finish_fraction}, max_staleness {args.max_staleness}; steps 2-{args.steps}\n"
    )
    print("| run | trained tokens/s | step s | generate s | engines idle | samples/step | tokens by age |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for mode, s in results.items():
        print(
            f"| {mode} | {s['trained_tokens_per_s']:,.0f} | {s['step_s']:.2f} | {s['generate_s']:.2f} | "
            f"{s['engine_idle_share']:.1%} | {s['samples']:.0f} | {s['token_share_0']:.0%} / "
            f"{s['token_share_1']:.0%} / {s['token_share_2plus']:.0%} (0 / 1 / 2+ versions old) |"
        )
    ratio = results["partial"]["trained_tokens_per_s"] / results["sync"]["trained_tokens_per_s"]
    print(f"\npartial over sync: {ratio:.2f}x trained tokens/s", flush=True)
    (out / "partial.json").write_text(json.dumps({"runs": results, "ratio": ratio}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
