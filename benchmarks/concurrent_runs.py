"""Several ``ppo-driver train`` runs at once on one machine (each its own local Ray), then a table.

    python benchmarks/concurrent_runs.py --out DIR --timeout 500 \
        --run "torch-s1=configs/smollm2-ppo-1gpu.yaml train.seed=1" \
        --run "mega-s1=configs/smollm2-ppo-1gpu.yaml train.seed=1 train.backend=megatron"

Each ``--run`` is ``NAME=CONFIG [KEY=VALUE ...]`` (``--set`` overrides); ``--set-all`` adds overrides
to every run. Runs sharing a GPU slow each other: the table's wall times are not solo figures, the
rewards and accuracies are what each run learnt. Prints per run: steps done, the training reward of
the last 5 steps, every evaluation (step: greedy accuracy @ seconds since the command, start-up
included, seen by polling each second), wall seconds; exits non-zero when a run
failed or was cut by ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    paths = [str(p) for p in sorted(REPO.glob("packages/*/src"))]
    old = os.environ.get("PYTHONPATH")
    return os.environ | {
        "PYTHONPATH": os.pathsep.join(paths + ([old] if old else [])),
        "PYTHONUNBUFFERED": "1",
    }


def _rows(metrics: Path) -> list[dict[str, float]]:
    if not metrics.exists():
        return []
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a cut last line
    return rows


def _eval_steps(run_dir: Path) -> list[int]:
    return [int(r["step"]) for r in _rows(run_dir / "metrics.jsonl") if "eval/accuracy" in r]


def _summary(name: str, run_dir: Path, wall: float, code: int | None, seen: dict[int, float]) -> str:
    rows = _rows(run_dir / "metrics.jsonl")
    rewards = [r["rollout/reward_mean"] for r in rows if "rollout/reward_mean" in r]
    last5 = sum(rewards[-5:]) / max(1, len(rewards[-5:]))
    evals = " ".join(
        f"{int(r['step'])}:{r['eval/accuracy']:.3f}@{seen.get(int(r['step']), float('nan')):.0f}s"
        for r in rows
        if "eval/accuracy" in r
    )
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    steady = sorted(steps[1:])[len(steps[1:]) // 2] if len(steps) > 1 else float("nan")
    status = "ok" if code == 0 else f"exit {code}"
    return (
        f"| {name} | {status} | {len(rewards)} | {last5:.3f} | {evals} | "
        f"{steps[0] if steps else float('nan'):.1f} | {steady:.2f} | {wall:.0f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", action="append", required=True, help="NAME=CONFIG [KEY=VALUE ...]")
    parser.add_argument("--set-all", nargs="*", default=[], help="overrides for every run")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=540.0)
    args = parser.parse_args()
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, float]] = {}
    for spec in args.run:
        name, _, rest = spec.partition("=")
        config, *overrides = rest.split()
        run_dir = args.out / name
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "ppo_driver", "train", "--config", config, "--run-dir", str(run_dir)]
        for item in [*args.set_all, *overrides]:
            cmd += ["--set", item]
        log = (args.out / f"{name}.log").open("wb")
        procs[name] = (
            subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT),
            run_dir,
            time.monotonic(),
        )
    deadline = time.monotonic() + args.timeout
    walls: dict[str, float] = {}
    # When each evaluation's row appeared, from the run's command (start-up included): 1 s resolution.
    seen: dict[str, dict[int, float]] = {name: {} for name in procs}
    while len(walls) < len(procs) and time.monotonic() < deadline:
        for name, (proc, run_dir, started) in procs.items():
            for step in _eval_steps(run_dir):
                seen[name].setdefault(step, time.monotonic() - started)
            if name not in walls and proc.poll() is not None:
                walls[name] = time.monotonic() - started
        time.sleep(1.0)
    failed = False
    print(
        "| run | status | steps | reward last 5 | eval greedy accuracy (step:acc@s since the command) "
        "| first step s | steady step s | wall s |"
    )
    print("|---|---|---:|---:|---|---:|---:|---:|")
    for name, (proc, run_dir, started) in procs.items():
        if name not in walls:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            walls[name] = time.monotonic() - started
        failed |= proc.returncode != 0
        print(_summary(name, run_dir, walls[name], proc.returncode, seen[name]), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
