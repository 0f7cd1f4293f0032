"""SmolLM2-135M-Instruct on one GPU: import it, measure held-out accuracy, train with PPO and with GRPO.

    python packages/ppo_driver/benchmarks/real_model.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    python packages/ppo_driver/benchmarks/real_model.py --gguf part-aa part-ab   # a file sent in parts
    python packages/ppo_driver/benchmarks/real_model.py --model models/smollm2-135m-instruct

1. the model folder: ``--model`` when it exists, else ``ppo-driver import-model`` of the GGUF (parts
   are joined in the order given and checked against the file's sha256 when it is the registry's);
2. the held-out accuracy before training, the run's own way (its evaluation rows, chat template,
   reward; greedy and with the training sampling) on the built-in engine;
3. ``ppo-driver train`` of ``configs/smollm2-ppo-1gpu.yaml`` and ``configs/smollm2-grpo-1gpu.yaml``
   (``--config`` picks others), each timed from the command's start (start-up included);
4. a table: accuracy before and after (greedy and sampled), steps, wall seconds, the first evaluated
   step at or above ``--goal`` and when it was reached (start-up included), written to
   ``$OUT/real_model.md`` too; each run's log as ``$OUT/<config>.log``, its ``summary.json`` and
   ``metrics.jsonl`` under ``$OUT/<config>/``.

Exits non-zero when anything fails: the import, a run (its exit status, non-finite values, engines'
weights that differ from the actor's) or a run missing its final evaluation. ``--require-goal`` also
fails when a run's final held-out greedy accuracy is below ``--goal`` or took longer than
``--budget-s``. Runs from the repository root with ``PYTHONPATH`` holding every ``packages/*/src``
(set here) or in the workspace's environment.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
CONFIGS = ("configs/smollm2-ppo-1gpu.yaml", "configs/smollm2-grpo-1gpu.yaml")
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass(frozen=True)
class Accuracy:
    greedy: float
    sampled: float
    greedy_length: float


@dataclass(frozen=True)
class RunRow:
    config: str
    ok: bool
    steps: int
    wall_s: float
    after: Accuracy | None
    goal_step: int | None
    goal_s: float | None
    note: str


def _env() -> dict[str, str]:
    src = os.pathsep.join(str(p) for p in sorted((REPO / "packages").glob("*/src")))
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": src + (os.pathsep + old if old else "")}


def _driver(*args: str, log: Path | None = None, timeout: float = 1800) -> int:
    cmd = [sys.executable, "-m", "ppo_driver", *args]
    print("$", " ".join(cmd), flush=True)
    with log.open("w") if log else open(os.devnull, "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return 124


def _join_parts(parts: list[Path], into: Path) -> Path:
    with into.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    digest = hashlib.sha256(into.read_bytes()).hexdigest()
    print(f"joined {len(parts)} parts into {into} (sha256 {digest[:16]}...)", flush=True)
    if len(parts) > 1 and digest != GGUF_SHA256:
        raise SystemExit(
            f"the joined file's sha256 {digest} is not SmolLM2-135M-Instruct.Q4_1.gguf's {GGUF_SHA256}"
        )
    return into


def model_folder(args: argparse.Namespace, work: Path) -> Path:
    if args.model is not None and (args.model / "config.json").is_file():
        return args.model
    if not args.gguf:
        raise SystemExit("give --gguf FILE (or its parts) or --model FOLDER (an imported model)")
    gguf = (
        args.gguf[0]
        if len(args.gguf) == 1
        else _join_parts(args.gguf, work / "SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    out = args.model or work / "smollm2-135m-instruct"
    t0 = time.perf_counter()
    if _driver("import-model", str(gguf), str(out), "--force", timeout=900) != 0:
        raise SystemExit("import-model failed")
    print(f"import-model took {time.perf_counter() - t0:.1f} s", flush=True)
    return out


def accuracy_before(config_path: Path, model: Path, overrides: list[str]) -> Accuracy:
    """The run's held-out evaluation of the untrained model: its rows, renderer, reward, sampling."""
    import statistics

    import torch
    from transformers import AutoTokenizer

    from ppo_driver.config import load_config
    from ppo_rollout.config import SamplingConfig, SamplingSettings
    from ppo_rollout.data import PromptRenderer, open_prompts
    from ppo_rollout.engine.builtin import BuiltinEngine
    from ppo_rollout.manager import CORRECT_REWARD
    from ppo_rollout.rewards import RewardInput, resolve_reward
    from ppo_rollout.tasks import get_task

    config = load_config(config_path, [*overrides, f"model.path={model}"])
    r = config.rollout
    tokenizer = AutoTokenizer.from_pretrained(model)
    renderer = PromptRenderer(
        tokenizer, r.prompt_field, chat_template=r.chat_template, system_prompt=r.system_prompt
    )
    rows = open_prompts(r, config.train.seed).eval_rows(r.eval_prompts)
    texts = [renderer.render(row) for row in rows]
    prompts = [renderer.encode(t) for t in texts]
    reward = resolve_reward(r.reward or get_task(r.task or "").reward)
    device = config.placement.device
    engine = BuiltinEngine(model, device, "bfloat16" if device == "cuda" else "float32")
    greedy = SamplingSettings(
        temperature=0.0, max_new_tokens=r.sampling.max_new_tokens, n_samples_per_prompt=1
    )
    out: dict[str, tuple[float, float]] = {}
    for name, settings in (("greedy", greedy), ("sampled", r.sampling)):
        outputs = engine.generate(
            prompts, SamplingConfig.of(settings, config.train.seed), seed=config.train.seed
        )
        samples = [
            RewardInput(
                prompt=texts[o.prompt_position],
                response=str(tokenizer.decode(list(o.token_ids), skip_special_tokens=True)),
                response_token_ids=o.token_ids,
                finish_reason=o.finish_reason,
                row=rows[o.prompt_position],
                prompt_index=o.prompt_position,
            )
            for o in outputs
        ]
        rewards = list(reward(samples))
        acc = sum(x >= CORRECT_REWARD for x in rewards) / len(rewards)
        out[name] = (acc, statistics.fmean(len(o.token_ids) for o in outputs))
    del engine
    # The runs start in processes of their own on the same GPU: hand this one's cached memory back.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Accuracy(out["greedy"][0], out["sampled"][0], out["greedy"][1])


def run_config(config: str, model: Path, work: Path, goal: float, extra: list[str]) -> RunRow:
    name = Path(config).stem
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    rc = _driver(
        "train", "--config", config, "--run-dir", str(run_dir), "--set", f"model.path={model}",
        "--set", "logging.progress=false", *extra, log=work / f"{name}.log",
    )  # fmt: skip
    wall = time.perf_counter() - t0
    metrics_file = run_dir / "metrics.jsonl"
    records: list[dict[str, Any]] = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    )
    evals = [m for m in records if "eval/accuracy" in m]
    after = (
        Accuracy(
            evals[-1]["eval/accuracy"],
            evals[-1]["eval/sampled_accuracy"],
            evals[-1]["eval/response_length_mean"],
        )
        if evals
        else None
    )
    # When the goal was reached: the run's wall time less the steps after that one (their time/step
    # plus what ran after the last step: the final save, the checksums, the summary).
    goal_step = next((m["step"] for m in evals if m["eval/accuracy"] >= goal), None)
    goal_s = None
    if goal_step is not None:
        later = sum(float(m.get("time/step_s", 0.0)) for m in records if m["step"] > goal_step)
        goal_s = wall - later
    ok = rc == 0 and after is not None
    note = "" if ok else (f"exit {rc}" if rc != 0 else "no evaluation in metrics.jsonl")
    return RunRow(name, ok, len(records), wall, after, goal_step, goal_s, note)


def table(before: Accuracy, rows: list[RunRow], goal: float) -> str:
    lines = [
        "| config | held-out greedy acc before | after | sampled acc before | after | greedy length before "
        f"| after | steps | wall s | first eval >= {goal:g} (step, s) | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        a = row.after
        reached = "-" if row.goal_step is None else f"step {row.goal_step}, {row.goal_s:.0f} s"
        after = ("-",) * 3 if a is None else (f"{a.greedy:.3f}", f"{a.sampled:.3f}", f"{a.greedy_length:.1f}")
        status = "ok" if row.ok else "FAILED: " + row.note
        lines.append(
            f"| {row.config} | {before.greedy:.3f} | {after[0]} | {before.sampled:.3f} | {after[1]} | "
            f"{before.greedy_length:.1f} | {after[2]} | {row.steps} | {row.wall_s:.0f} | {reached} "
            f"| {status} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, nargs="+", help="the GGUF file, or its parts in order")
    parser.add_argument(
        "--model", type=Path, help="an imported model folder (used when it exists, else written)"
    )
    parser.add_argument(
        "--config", action="append", help="a config to run (repeatable; default: both smollm2)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        help="passed to every run and the 'before' evaluation",
    )
    parser.add_argument("--goal", type=float, default=0.8, help="held-out greedy accuracy to reach")
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall seconds to reach it in")
    parser.add_argument("--require-goal", action="store_true", help="fail when a run misses the goal")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="real-model-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="real-model-work-"))
    sys.path[:0] = [str(p) for p in sorted((REPO / "packages").glob("*/src"))]
    model = model_folder(args, work)
    configs = args.config or list(CONFIGS)
    before = accuracy_before(REPO / configs[0], model, args.overrides)
    print(
        f"before training: held-out greedy accuracy {before.greedy:.3f}, sampled {before.sampled:.3f}",
        flush=True,
    )
    extra = [item for o in args.overrides for item in ("--set", o)]
    rows = [run_config(c, model, work, args.goal, extra) for c in configs]
    text = table(before, rows, args.goal)
    print(text)
    (out / "real_model.md").write_text(text + "\n")
    for row in rows:  # each run's log, and its summary (start-up table) and metrics beside it
        log = work / f"{row.config}.log"
        if log.is_file():
            shutil.copy(log, out / log.name)
        for name in ("summary.json", "metrics.jsonl"):
            src = work / row.config / name
            if src.is_file():
                (out / row.config).mkdir(exist_ok=True)
                shutil.copy(src, out / row.config / name)
    failed = [r for r in rows if not r.ok]
    if args.require_goal:
        failed += [
            r
            for r in rows
            if r.ok
            and (
                r.after is None or r.after.greedy < args.goal or r.goal_s is None or r.goal_s > args.budget_s
            )
        ]
    for r in failed:
        print(
            f"FAILED: {r.config} {r.note or f'missed the goal ({args.goal:g} within {args.budget_s:.0f} s)'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
