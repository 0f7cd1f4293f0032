"""One-step-off-policy training against the synchronous loop: steps per hour and reward per step.

Both runs use the same config and seed (a disaggregated placement: engines on their own devices);
only ``train.async`` differs (``one_step_off`` also sets ``algorithm.tis_cap``). Steps per hour
count the steps' own time (``time/step`` summed), not start-up. Prints a Markdown table and, with
``--json``, writes the rows.

    uv run python packages/ppo_driver/benchmarks/bench_one_step_off.py --steps 12
    python packages/ppo_driver/benchmarks/bench_one_step_off.py --config configs/2gpu-disaggregate.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CPU_BASE = ["placement.mode=disaggregate", "placement.critic=shared"]
QUIET = [
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.interval=0",
    "checkpoint.save_final=false",
]
MODES = {
    "sync": ["train.async=off"],
    "one_step_off": ["train.async=one_step_off", "algorithm.tis_cap=2.0"],
}


def run(config_path: str | None, overrides: Sequence[str], steps: int, run_dir: Path) -> dict[str, Any]:
    from rich.console import Console

    from ppo_driver.config import load_config
    from ppo_driver.loop import train

    config = load_config(config_path, [*overrides, *QUIET, f"train.steps={steps}"])
    result = train(config, run_dir, console=Console(quiet=True))
    history = result.history
    step_seconds = [float(r["time/step"]) for r in history]
    # The first step has no batch generated ahead in either mode: report the rest too.
    steady = step_seconds[1:] or step_seconds
    return {
        "steps": len(history),
        "seconds": sum(step_seconds),
        "steps_per_hour": 3600.0 * len(history) / sum(step_seconds),
        "steady_steps_per_hour": 3600.0 * len(steady) / sum(steady),
        "generate_s": statistics.fmean(float(r.get("time/generate", 0.0)) for r in history),
        "generate_wait_s": statistics.fmean(float(r.get("time/generate_wait", 0.0)) for r in history),
        "rewards": [round(float(r["rollout/reward_mean"]), 4) for r in history],
        "reward_mean": statistics.fmean(float(r["rollout/reward_mean"]) for r in history),
        "weights_match": result.weights_match,
    }


def compare(
    config_path: str | None, overrides: Sequence[str], steps: int, root: Path
) -> dict[str, dict[str, Any]]:
    return {mode: run(config_path, [*overrides, *extra], steps, root / mode) for mode, extra in MODES.items()}


def table(rows: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| mode | steps | steps/hour | steps/hour (steps 2+) | generate s/step | wait s/step "
        "| mean reward | reward per step |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {r['steps']} | {r['steps_per_hour']:.0f} | {r['steady_steps_per_hour']:.0f} | "
            f"{r['generate_s']:.3f} | {r['generate_wait_s']:.3f} | {r['reward_mean']:.3f} | "
            f"{' '.join(f'{x:.2f}' for x in r['rewards'])} |"
        )
    sync, off = rows["sync"], rows["one_step_off"]
    lines.append("")
    lines.append(
        f"speed-up (steps/hour, one_step_off / sync): {off['steps_per_hour'] / sync['steps_per_hour']:.2f}x "
        f"(steps 2+: {off['steady_steps_per_hour'] / sync['steady_steps_per_hour']:.2f}x)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default=None, help="YAML config (default: the CPU default, disaggregated)"
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a.b=c, repeatable")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    base = CPU_BASE if args.config is None else []
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(args.config, [*base, *args.overrides], args.steps, Path(tmp))
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if not all(r["weights_match"] for r in rows.values()):
        print("FAILED: the engines do not hold the actor's final weights")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
