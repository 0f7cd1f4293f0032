"""PPO with a critic against GRPO, RLOO and DAPO on SmolLM2-135M-Instruct, one GPU: whether the critic
pays for itself, on the tool task and on one-turn arithmetic.

    python packages/ppo_driver/benchmarks/ppo_or_grpo.py run --model MODEL --task tools --steps 30
    python packages/ppo_driver/benchmarks/ppo_or_grpo.py run --model MODEL --task arith --steps 80
    python packages/ppo_driver/benchmarks/ppo_or_grpo.py table runs/ppo_or_grpo/tools runs/ppo_or_grpo/arith

``run`` trains the five variants of a task at once on the one GPU through tool_task.py (``tools-ppo``,
``tools-ppo-warmup``, ``tools-grpo``, ``tools-rloo``, ``tools-dapo``, or the ``arith-`` five), each with
``rollout.eval_before_train``; its folder ($OUT, default ``runs/ppo_or_grpo/<task>``) gets tool_task's
table and each run's ``metrics.jsonl``. Five runs share the GPU, so each wall time is an upper bound on
the run alone; compare the variants at equal steps first.

``table`` reads such folders and prints, per task: held-out greedy accuracy at every evaluation (with the
second it was reached, start-up included); for the runs with a critic, the critic panel (explained
variance at steps 1, 5, 10, 20 and the last, the first step where it reaches 0.5, the advantage variance
against GRPO's and RLOO's on the same samples and the correlation with GRPO's, the critic's share of a
step's time: means over the last ten steps); and the warm-up's effect (accuracy at each evaluation, PPO
with 5 critic-only steps minus PPO without). Exits non-zero when a folder has no runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
VARIANTS = ("ppo", "ppo-warmup", "grpo", "rloo", "dapo")
EV_STEPS = (1, 5, 10, 20)
EV_GOAL = 0.5


def run(args: argparse.Namespace) -> int:
    out = args.out or REPO / "runs" / "ppo_or_grpo" / args.task
    runs = ",".join(f"{args.task}-{v}:{args.seed}" for v in VARIANTS)
    cmd = [sys.executable, str(HERE / "tool_task.py"), "--model", str(args.model), "--runs", runs]
    cmd += ["--set", f"train.steps={args.steps}", "--set", f"rollout.eval_interval={args.eval_interval}"]
    return subprocess.run(cmd, env={**os.environ, "OUT": str(out)}, check=False).returncode


def _records(run_dir: Path) -> list[dict[str, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _mean_last(records: list[dict[str, float]], key: str, n: int = 10) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)][-n:]
    return statistics.fmean(values) if values else None


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def accuracy_table(reports: list[dict]) -> str:
    steps = sorted({s for r in reports for s, _, _ in r["evals"]})
    head = "| run | " + " | ".join(f"step {s}" for s in steps) + " | wall s |"
    rows = [head, "|---|" + "---:|" * (len(steps) + 1)]
    for r in reports:
        at = {s: (a, w) for s, a, w in r["evals"]}
        cells = [f"{at[s][0]:.3f} ({at[s][1]:.0f} s)" if s in at else "-" for s in steps]
        rows.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['wall_s']:.0f} |")
    return "\n".join(rows)


def critic_row(name: str, records: list[dict[str, float]]) -> str | None:
    ev = {int(r["step"]): r["critic/explained_variance"] for r in records if "critic/explained_variance" in r}
    if not ev:
        return None
    shown = [*EV_STEPS, max(ev)]
    first = next((s for s in sorted(ev) if ev[s] >= EV_GOAL), None)
    cells = [_fmt(ev.get(s), 2) for s in shown]
    cells.append("never" if first is None else str(first))
    for key, digits in (
        ("critic/adv_var_ratio_grpo", 2),
        ("critic/adv_var_ratio_rloo", 2),
        ("critic/adv_corr_grpo", 2),
        ("time/critic_share", 2),
    ):
        cells.append(_fmt(_mean_last(records, key), digits))
    return f"| {name} | " + " | ".join(cells) + " |"


def critic_table(folder: Path, reports: list[dict]) -> str:
    head = (
        "| run | " + " | ".join(f"EV step {s}" for s in EV_STEPS) + " | EV last | first step EV >= 0.5 "
        "| adv var / GRPO's | adv var / RLOO's | corr with GRPO's | critic time share |"
    )
    rows = [head, "|---|" + "---:|" * (len(EV_STEPS) + 6)]
    for r in reports:
        row = critic_row(r["name"], _records(folder / f"{r['name']}-s{r['seed']}"))
        if row is not None:
            rows.append(row)
    return "\n".join(rows)


def warm_up_line(reports: list[dict]) -> str:
    by_name = {r["name"].split("-", 1)[1]: {s: a for s, a, _ in r["evals"]} for r in reports}
    plain, warm = by_name.get("ppo"), by_name.get("ppo-warmup")
    if plain is None or warm is None:
        return "warm-up: one of the two PPO runs is missing"
    diffs = [f"step {s}: {warm[s] - plain[s]:+.3f}" for s in sorted(plain) if s in warm]
    return "warm-up (5 critic-only steps) minus none, held-out accuracy: " + ", ".join(diffs)


def table(args: argparse.Namespace) -> int:
    for folder in args.folders:
        summary = folder / "tool_task.json"
        if not summary.is_file():
            print(f"{summary}: no runs (run `ppo_or_grpo.py run` first)", file=sys.stderr)
            return 1
        reports = json.loads(summary.read_text())
        print(f"## {folder.name}\n\n{accuracy_table(reports)}\n\n{critic_table(folder, reports)}\n")
        print(warm_up_line(reports) + "\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="train the five variants of a task at once")
    go.add_argument("--model", type=Path, required=True, help="an imported SmolLM2 folder")
    go.add_argument("--task", choices=("tools", "arith"), default="tools")
    go.add_argument("--steps", type=int, default=30)
    go.add_argument("--eval-interval", type=int, default=10)
    go.add_argument("--seed", type=int, default=1)
    go.add_argument("--out", type=Path, default=None)
    show = sub.add_parser("table", help="the guide's tables from run folders")
    show.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args()
    return run(args) if args.command == "run" else table(args)


if __name__ == "__main__":
    raise SystemExit(main())
