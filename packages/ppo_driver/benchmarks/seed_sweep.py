"""Run the default recipe (or a config) over several seeds and print how reliably it learns.

`python packages/ppo_driver/benchmarks/seed_sweep.py [--seeds 0-9] [--jobs 1] [--config FILE]
[--set KEY=VALUE ...] [--out DIR]`

Each seed is one real `ppo-driver train` run (a local Ray, the engine, actor and critic processes)
with `--set train.seed=N`; runs go one after another unless `--jobs` is raised (on a machine with
cores to spare: each run then competes for them and its wall time says so). Printed per seed: the
mean reward of the last 5 steps, the final greedy evaluation, the first step at which the 5-step
mean reached 0.8, the largest fall of the 5-step mean after it first passed 0.6 (a collapse), and
the run's wall time; then min / median / max of each column and how many seeds met the bar
(last-5 >= 0.8, eval >= 0.8, no fall > 0.2). The header names the CPU (`lscpu`) and the date.
Exits 1 when a run fails outright (not when a seed misses the bar: the table says that).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WINDOW = 5
LEARNT = 0.8
COLLAPSE_FROM = 0.6
COLLAPSE_DROP = 0.2


@dataclass(frozen=True)
class SeedResult:
    seed: int
    last5: float
    eval_reward: float
    first_learnt_step: int | None
    largest_drop: float
    wall_s: float

    @property
    def meets_bar(self) -> bool:
        return self.last5 >= LEARNT and self.eval_reward >= LEARNT and self.largest_drop <= COLLAPSE_DROP


def rolling_means(values: list[float], window: int = WINDOW) -> list[float]:
    """Mean of the last ``window`` values at each step (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window) : i + 1]) for i in range(len(values))]


def largest_drop(means: list[float]) -> float:
    """Largest fall of the rolling mean below its running peak, counted once the mean passed 0.6."""
    peak, drop, armed = float("-inf"), 0.0, False
    for value in means:
        armed = armed or value >= COLLAPSE_FROM
        peak = max(peak, value)
        if armed:
            drop = max(drop, peak - value)
    return drop


def summarise(seed: int, metrics_file: Path, wall_s: float) -> SeedResult:
    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rewards = [float(r["rollout/reward_mean"]) for r in records]
    means = rolling_means(rewards)
    learnt = next((i + 1 for i, m in enumerate(means) if i + 1 >= WINDOW and m >= LEARNT), None)
    evals = [float(r["eval/reward_mean"]) for r in records if "eval/reward_mean" in r]
    return SeedResult(
        seed=seed,
        last5=statistics.fmean(rewards[-WINDOW:]),
        eval_reward=evals[-1] if evals else float("nan"),
        first_learnt_step=learnt,
        largest_drop=largest_drop(means),
        wall_s=wall_s,
    )


def run_seed(seed: int, config: str | None, overrides: list[str], out: Path) -> SeedResult:
    run_dir = out / f"seed_{seed}"
    command = [
        sys.executable,
        "-m",
        "ppo_driver",
        "train",
        "--run-dir",
        str(run_dir),
        "--set",
        f"train.seed={seed}",
    ]
    command += ["--set", "logging.progress=false"]
    if config:
        command += ["--config", config]
    for override in overrides:
        command += ["--set", override]
    start = time.perf_counter()
    with open(out / f"seed_{seed}.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(
            f"seed {seed}: ppo-driver train exited {done.returncode}; see {out}/seed_{seed}.log"
        )
    return summarise(seed, run_dir / "metrics.jsonl", wall)


def cpu_model() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    for line in lscpu.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high) + 1)) if high else [int(low)]
    return seeds


def print_table(results: list[SeedResult], header: str) -> None:
    print(header)
    print()
    print("| seed | last-5 reward | greedy eval | step 5-step mean >= 0.8 | largest drop | wall s | bar |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for r in results:
        step = "-" if r.first_learnt_step is None else str(r.first_learnt_step)
        mark = "yes" if r.meets_bar else "no"
        print(
            f"| {r.seed} | {r.last5:.3f} | {r.eval_reward:.3f} | {step} | {r.largest_drop:.3f} "
            f"| {r.wall_s:.0f} | {mark} |"
        )
    steps = [float(r.first_learnt_step) for r in results if r.first_learnt_step is not None]
    columns = {
        "last5": [r.last5 for r in results],
        "eval": [r.eval_reward for r in results],
        "drop": [r.largest_drop for r in results],
        "wall": [r.wall_s for r in results],
    }
    for name, pick in (("min", min), ("median", statistics.median), ("max", max)):
        step = f"{pick(steps):.0f}" if steps else "-"
        last5, evals, drop, wall = (pick(values) for values in columns.values())
        print(f"| {name} | {last5:.3f} | {evals:.3f} | {step} | {drop:.3f} | {wall:.0f} | |")
    met = sum(r.meets_bar for r in results)
    print()
    print(
        f"{met} of {len(results)} seeds met the bar (last-5 >= {LEARNT}, greedy eval >= {LEARNT}, "
        f"no fall of the 5-step mean > {COLLAPSE_DROP} after it passed {COLLAPSE_FROM})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,1,1234 (default 0-9)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (default 1: one after another)")
    parser.add_argument("--config", default=None, help="YAML config (default: the embedded default)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="seed-sweep-"))
    out.mkdir(parents=True, exist_ok=True)
    seeds = parse_seeds(args.seeds)
    header = (
        f"seed sweep, {datetime.date.today().isoformat()}, {cpu_model()}, {os.cpu_count()} CPUs, "
        f"jobs {args.jobs}; config {args.config or 'embedded default'}"
        + (f"; overrides {' '.join(args.overrides)}" if args.overrides else "")
        + f"; runs in {out}"
    )
    print(header, flush=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {seed: pool.submit(run_seed, seed, args.config, args.overrides, out) for seed in seeds}
        results: list[SeedResult] = []
        for seed in seeds:
            result = futures[seed].result()
            print(
                f"seed {seed}: last-5 {result.last5:.3f}, eval {result.eval_reward:.3f}, "
                f"drop {result.largest_drop:.3f}, {result.wall_s:.0f} s",
                flush=True,
            )
            results.append(result)
    print()
    print_table(results, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
