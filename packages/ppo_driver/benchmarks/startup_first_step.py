"""Start-up to the first step, and the first step against a steady one, with ``startup.warm_up`` on
and off: SmolLM2-135M PPO on one GPU (``configs/smollm2-ppo-1gpu.yaml``).

    python packages/ppo_driver/benchmarks/startup_first_step.py --model models/smollm2-135m-instruct
    python packages/ppo_driver/benchmarks/startup_first_step.py --shape DIR   # random weights

``--model``: a real model folder. Without one, ``--shape`` names a folder holding SmolLM2's
``config.json`` and tokenizer files (``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json``: 4 MB), and a model of that shape with random
weights (seed 0) is written: every kernel, shape and start-up part is the real model's; its
responses run to ``max_new_tokens`` more often than the trained model's.

Three runs of ``--steps`` steps (no evaluation, no checkpoint): the built-in task with warm-up on,
then off, then warm-up on with a chat dataset of ``--dataset-rows`` rows (written here, the shape of
the docs' format: a system and a user message per row) in place of the task. Each run's start-up table
(``summary.json``) gives the seconds to the first step and its parts; the first step's seconds and
their ratio to the mean step after it (``first_step_time``). The two task runs' first steps must
compute the same: every rollout figure of step 1 (rewards, response lengths) equal, the train
figures reported with their largest relative difference (a GPU's backward sums in a varying order).

Writes ``$OUT/startup.md`` (``--out``) and each run's log and summary under it; exits non-zero when
a run fails or step 1's rollout figures differ. The goals (first step <= 1.5x a steady one, start-up
<= 15 s) are reported, not enforced.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
# Step 1's figures that depend on nothing but the computation (no clocks, byte counts or rates).
ROLLOUT_KEYS = ("rollout/reward_mean", "rollout/reward_std", "rollout/response_length_mean")
_TIMING = (
    "time/",
    "bytes/",
    "weight_sync/",
    "offload/",
    "/sleep",
    "/wake",
    "tflops",
    "_per_s",
    "seconds",
    "memory",
)


def random_model(shape: Path, out: Path) -> Path:
    """A model of ``shape``'s config with random weights (seed 0), with its tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape))
    model.save_pretrained(out)
    for file in shape.iterdir():
        if file.name != "config.json" and file.is_file():
            shutil.copy(file, out / file.name)
    return out


def chat_dataset(path: Path, rows: int) -> Path:
    """``rows`` arithmetic questions as chats (system + user), labels the answers."""
    r = random.Random(0)
    system = "You are a careful assistant. Answer with the number only."
    with path.open("w") as f:
        for i in range(rows):
            a, b = r.randint(0, 99), r.randint(0, 99)
            words = " ".join(
                r.choice(["please", "compute", "the", "sum", "now", "exactly"]) for _ in range(12)
            )
            user = f"Question {i}: what is {a} + {b}? {words}"
            row = {"prompt": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
            f.write(json.dumps({**row, "label": str(a + b)}) + "\n")
    return path


def run(
    name: str, config: Path, model: Path, out: Path, steps: int, sets: list[str], timeout_s: float
) -> dict[str, Any]:
    run_dir = out / name
    command = [
        sys.executable, "-m", "ppo_driver", "train",
        "--config", str(config),
        "--run-dir", str(run_dir),
        "--set", f"model.path={model}",
        "--set", f"train.steps={steps}",
        "--set", "rollout.eval_prompts=0",
        "--set", "checkpoint.interval=0",
        "--set", "checkpoint.save_final=false",
        "--set", "logging.progress=false",
        *[arg for s in sets for arg in ("--set", s)],
    ]  # fmt: skip
    print(f"== {name}: {' '.join(command[3:])}", flush=True)
    t0 = time.time()
    with (out / f"{name}.log").open("w") as log:
        rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    wall = time.time() - t0
    print((out / f"{name}.log").read_text()[-3000:], flush=True)
    if rc != 0:
        raise SystemExit(f"{name}: ppo-driver train exited {rc} (log: {out / f'{name}.log'})")
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"name": name, "wall_s": wall, "summary": summary, "step1": history[0], "steps": history}


def compare_first_steps(on: dict[str, Any], off: dict[str, Any]) -> tuple[list[str], float, str]:
    """(rollout figures of step 1 that differ, the largest relative difference of the train figures,
    which one)."""
    a, b = on["step1"], off["step1"]
    differ = [k for k in ROLLOUT_KEYS if a.get(k) != b.get(k)]
    worst, which = 0.0, "-"
    for key, value in a.items():
        if key in ROLLOUT_KEYS or any(t in key for t in _TIMING) or key.endswith("_s"):
            continue
        other = b.get(key)
        if not isinstance(value, int | float) or not isinstance(other, int | float):
            continue
        rel = abs(value - other) / max(abs(value), abs(other), 1e-12)
        if rel > worst:
            worst, which = rel, key
    return differ, worst, which


def row(result: dict[str, Any]) -> str:
    s = result["summary"]
    startup = s["startup"]
    parts = {p["part"]: p["seconds"] for p in startup["parts"]}
    first = s.get("first_step_time") or {}
    warm = startup.get("alongside", {}).get("warm-up (after roles)", {})
    warm_text = ", ".join(f"{k} {v:.2f}" for k, v in warm.items()) or "-"
    return (
        f"| {result['name']} | {startup['total_s']:.2f} | {parts.get('config + pre-flight', 0):.2f} | "
        f"{parts.get('driver imports', 0):.2f} | {parts.get('ray', 0):.2f} | {parts.get('roles', 0):.2f} | "
        f"{parts.get('dataset check (after roles)', 0):.2f} | {parts.get('warm-up (after roles)', 0):.2f} "
        f"({warm_text}) | {first.get('seconds', float('nan')):.2f} | "
        f"{first.get('over_steady', float('nan')):.2f} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="a real model folder (SmolLM2-135M-Instruct)")
    parser.add_argument("--shape", type=Path, help="config.json + tokenizer files: random weights")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dataset-rows", type=int, default=8100)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "startup-out")))
    parser.add_argument("--timeout-s", type=float, default=170.0, help="per run")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "smollm2-ppo-1gpu.yaml")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="more --set for every run (a CPU smoke run)"
    )
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.model is not None and (args.model / "config.json").is_file():
        model, weights = args.model.resolve(), "the real weights"
    elif args.shape is not None:
        # Outside --out: $OUT comes back from a lent machine, the weights need not.
        folder = Path(tempfile.gettempdir()) / "startup-first-step-model"
        model, weights = random_model(args.shape, folder), "random weights (SmolLM2's shape)"
    else:
        raise SystemExit("give --model (a model folder) or --shape (config.json + tokenizer files)")
    results = [
        run(
            "task-warm",
            args.config,
            model,
            out,
            args.steps,
            [*args.sets, "startup.warm_up=true"],
            args.timeout_s,
        ),
        run(
            "task-cold",
            args.config,
            model,
            out,
            args.steps,
            [*args.sets, "startup.warm_up=false"],
            args.timeout_s,
        ),
    ]
    data = chat_dataset(out / "chat.jsonl", args.dataset_rows)
    dataset_sets = [
        *args.sets, "startup.warm_up=true", "rollout.task=null", f"rollout.dataset={data}",
        "rollout.reward=math_answer",
    ]  # fmt: skip
    name = f"chat{args.dataset_rows}-warm"
    results.append(run(name, args.config, model, out, args.steps, dataset_sets, args.timeout_s))
    differ, worst, which = compare_first_steps(results[0], results[1])
    lines = [
        f"SmolLM2-135M PPO ({weights}), {args.config.name}, {args.steps} steps, no evaluation"
        + (f", --set {' '.join(args.sets)}" if args.sets else ""),
        "",
        "| run | to the first step s | config + pre-flight | driver imports | ray | roles | dataset check "
        "(after roles) | warm-up (after roles) (each role) | first step s | first / steady |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
        *[row(r) for r in results],
        "",
        f"step 1 with warm-up on and off: rollout figures "
        f"{'DIFFER: ' + ', '.join(differ) if differ else 'equal'}; "
        f"train figures: largest relative difference {worst:.2e} ({which})",
    ]
    text = "\n".join(lines) + "\n"
    (out / "startup.md").write_text(text)
    (out / "startup.json").write_text(
        json.dumps({r["name"]: {"wall_s": r["wall_s"], **r["summary"]} for r in results}, indent=1) + "\n"
    )
    print(text, flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
