"""Multi-turn tool use on one GPU: SmolLM2-135M-Instruct with the calculator, and without it.

    python packages/ppo_driver/benchmarks/tool_task.py --model models/smollm2-135m-instruct
    python packages/ppo_driver/benchmarks/tool_task.py --gguf part-aa part-ab --runs tools-ppo:1,notool-ppo:1
    python packages/ppo_driver/benchmarks/tool_task.py --model M --set train.steps=20   # every run

Each run is ``ppo-driver train`` of a variant (below) with ``rollout.eval_before_train`` on, so its
``metrics.jsonl`` starts with the untrained model's held-out accuracy (step 0). Runs named together with
``--runs NAME:SEED,...`` go in parallel on the one GPU (each is a 135M model: the GPU has room; each
run's wall time is then an upper bound on its time alone). While a run goes, its ``metrics.jsonl`` is
read every second, so the wall time of each evaluation (start-up included) is known.

The table (``$OUT/tool_task.md`` and ``tool_task.json``): per run, held-out greedy accuracy at step 0,
at the end and at best, the first evaluation meeting the goal (at least ``--gain`` above step 0 and
``--goal`` absolute) with its step and wall second, the tool calls per trajectory and their validity
over the last ten steps, and the run's steps and wall seconds. Exits non-zero when a run fails (its
exit status, a missing evaluation, engines whose weights differ from the actor's).

Variants: ``tools-ppo`` (configs/smollm2-tools-ppo-1gpu.yaml), ``tools-grpo`` (the GRPO config),
``tools-ppo-gae-through`` (the PPO config with ``algorithm.gae_through_observations=true``: GAE decays
through the calculator's tokens, as slime and OpenRLHF do), ``notool-ppo`` (the PPO config as one turn on
the same arithmetic without the tool or its system prompt: task ``arithmetic_5``); ``tools-ppo-warmup`` (5
critic-only steps first), ``tools-rloo``, ``tools-dapo`` (the GRPO config with RLOO's baseline, or with
DAPO's dynamic sampling, clip-higher and token-mean loss); ``arith-ppo``, ``arith-ppo-warmup``,
``arith-grpo``, ``arith-rloo``, ``arith-dapo``: the same comparison on one-turn two-digit arithmetic
(configs/smollm2-ppo-1gpu.yaml and its GRPO and DAPO siblings). docs/guide/ppo-or-grpo.md reads these.
``tools-ppo-partial``, ``arith-ppo-partial``: PPO with partial rollouts (finish fraction 0.75,
staleness at most 2, truncated importance weights at 2); ``tools-ppo-sglang``, ``tools-ppo-vllm``: the
tool task through a real SGLang or vLLM server (vLLM's Python: ``--set rollout.vllm.python=...``);
``gsm-ppo``, ``gsm-grpo``, ``gsm-dapo``: reasoning-gym's gsm_symbolic; ``bfcl-ppo``:
BFCL multi-turn base (its rows written first: configs/smollm2-bfcl-multi-turn-ppo-1gpu.yaml);
``gemma-arith-ppo``: the arithmetic PPO config for a model without a chat template (Gemma 3 270M base:
pass its folder as --model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import REPO, _env, model_folder  # the sibling benchmark's import steps

PPO = "configs/smollm2-tools-ppo-1gpu.yaml"
GRPO = "configs/smollm2-tools-grpo-1gpu.yaml"
WARM_UP = ("train.num_critic_only_steps=5",)  # the critic alone for 5 steps: the actor and engines wait
DAPO = (  # configs/smollm2-dapo-1gpu.yaml's parts but overlong shaping (a tool turn is not an answer)
    "rollout.dynamic_sampling.enabled=true",
    "rollout.dynamic_sampling.std_tolerance=1.0e-6",
    "rollout.dynamic_sampling.max_rounds=8",
    "rollout.dynamic_sampling.over_sample=1.5",
    "rollout.dynamic_sampling.on_exhausted=pad",
    "algorithm.eps_clip_high=0.28",
    "algorithm.loss_aggregation=token_mean",
)
ARITH_PPO = "configs/smollm2-ppo-1gpu.yaml"
PARTIAL = (  # a step trains the groups finished once 3/4 of its samples have; the rest continue
    "rollout.partial.enabled=true",
    "rollout.partial.finish_fraction=0.75",
    "rollout.partial.max_staleness=2",
    "algorithm.tis_cap=2.0",  # tokens of older weights: their importance weights, truncated at 2
)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tools-ppo": (PPO, ()),
    "tools-ppo-warmup": (PPO, WARM_UP),
    "tools-grpo": (GRPO, ()),
    "tools-rloo": (GRPO, ("algorithm.estimator=rloo",)),
    "tools-dapo": (GRPO, DAPO),
    # one-turn arithmetic (two-digit sums, no tool): the same comparison on the easier task
    "arith-ppo": (ARITH_PPO, ()),
    "arith-ppo-warmup": (ARITH_PPO, WARM_UP),
    "arith-grpo": ("configs/smollm2-grpo-1gpu.yaml", ()),
    "arith-rloo": ("configs/smollm2-grpo-1gpu.yaml", ("algorithm.estimator=rloo",)),
    "arith-dapo": ("configs/smollm2-dapo-1gpu.yaml", ()),
    "tools-ppo-gae-through": (PPO, ("algorithm.gae_through_observations=true",)),
    "tools-ppo-partial": (PPO, PARTIAL),
    "arith-ppo-partial": (ARITH_PPO, PARTIAL),
    "tools-ppo-sglang": ("configs/smollm2-sglang-tools-ppo-1gpu.yaml", ()),
    "tools-ppo-vllm": ("configs/smollm2-vllm-tools-ppo-1gpu.yaml", ()),
    "gsm-ppo": ("configs/smollm2-gsm-symbolic-ppo-1gpu.yaml", ()),
    "gsm-grpo": ("configs/smollm2-gsm-symbolic-grpo-1gpu.yaml", ()),
    "gsm-dapo": ("configs/smollm2-gsm-symbolic-dapo-1gpu.yaml", ()),
    "bfcl-ppo": ("configs/smollm2-bfcl-multi-turn-ppo-1gpu.yaml", ()),
    "gemma-arith-ppo": (ARITH_PPO, ("rollout.chat_template=false",)),
    "notool-ppo": (
        PPO,
        (
            "rollout.task=arithmetic_5",
            "rollout.system_prompt=null",
            "rollout.rollout_function=single_turn",
        ),
    ),
}


@dataclass
class RunReport:
    name: str
    seed: int
    rc: int = -1
    wall_s: float = 0.0
    steps: int = 0
    evals: list[tuple[int, float, float]] = field(default_factory=list)  # (step, accuracy, wall s)
    tool_calls: float | None = None
    tool_validity: float | None = None
    weights_match: bool | None = None
    error: str = ""

    @property
    def start(self) -> float | None:
        return next((acc for step, acc, _ in self.evals if step == 0), None)

    @property
    def end(self) -> float | None:
        return self.evals[-1][1] if self.evals else None

    def goal(self, gain: float, goal: float) -> tuple[int, float] | None:
        """(step, wall s) of the first evaluation at least ``gain`` above step 0 and ``goal`` absolute."""
        if self.start is None:
            return None
        for step, acc, wall in self.evals:
            if acc >= goal and acc >= self.start + gain:
                return step, wall
        return None


def _watch(metrics: Path, report: RunReport, started: float, done: threading.Event) -> None:
    """Records the wall time at which each evaluation appears in ``metrics``."""
    seen = 0
    while True:
        finished = done.is_set()
        if metrics.is_file():
            lines = metrics.read_text().splitlines()
            for line in lines[seen:]:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line still being written: read it next time
                seen += 1
                if "eval/accuracy" in record:
                    report.evals.append(
                        (record["step"], record["eval/accuracy"], time.perf_counter() - started)
                    )
        if finished:
            return
        time.sleep(1.0)


def _run(name: str, seed: int, model: Path, work: Path, out: Path, sets_all: list[str]) -> RunReport:
    config, extra = VARIANTS[name]
    report = RunReport(name, seed)
    run_dir = work / f"{name}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"model.path={model}", f"train.seed={seed}", "rollout.eval_before_train=true", *extra, *sets_all]
    cmd = [sys.executable, "-m", "ppo_driver", "train", "--config", config, "--run-dir", str(run_dir)]
    for item in sets:
        cmd += ["--set", item]
    done = threading.Event()
    started = time.perf_counter()
    watcher = threading.Thread(target=_watch, args=(run_dir / "metrics.jsonl", report, started, done))
    watcher.start()
    with (work / f"{name}-s{seed}.log").open("w") as log:
        report.rc = subprocess.run(
            cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT, check=False
        ).returncode
    report.wall_s = time.perf_counter() - started
    done.set()
    watcher.join()
    _read_run(run_dir, report)
    kept = out / run_dir.name
    kept.mkdir(parents=True, exist_ok=True)
    for name_ in ("metrics.jsonl", "summary.json"):
        if (run_dir / name_).is_file():
            shutil.copy(run_dir / name_, kept / name_)
    shutil.copy(work / f"{run_dir.name}.log", kept / "train.log")
    return report


def _read_run(run_dir: Path, report: RunReport) -> None:
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    train = [r for r in records if r.get("step", 0) > 0]
    report.steps = len(train)
    last = train[-10:]
    calls = [r["rollout/env/tool_calls"] for r in last if "rollout/env/tool_calls" in r]
    valid = [r["rollout/tool_call_validity"] for r in last if "rollout/tool_call_validity" in r]
    report.tool_calls = statistics.fmean(calls) if calls else None
    report.tool_validity = statistics.fmean(valid) if valid else None
    summary = run_dir / "summary.json"
    if summary.is_file():
        report.weights_match = json.loads(summary.read_text()).get("weights_match")
    if report.rc != 0:
        report.error = f"exit status {report.rc}"
    elif report.start is None or len(report.evals) < 2:
        report.error = "missing evaluations"
    elif report.weights_match is False:
        report.error = "the engines' weights differ from the actor's"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(reports: list[RunReport], gain: float, goal: float) -> str:
    head = (
        "| run | seed | step 0 | end | best | goal met (step, s) | tool calls / trajectory | valid calls "
        "| steps | wall s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = []
    for r in reports:
        met = r.goal(gain, goal)
        best = max((acc for _, acc, _ in r.evals), default=None)
        rows.append(
            f"| {r.name} | {r.seed} | {_fmt(r.start)} | {_fmt(r.end)} | {_fmt(best)} | "
            f"{'-' if met is None else f'{met[0]}, {met[1]:.0f}'} | {_fmt(r.tool_calls, 2)} | "
            f"{_fmt(r.tool_validity, 2)} | {r.steps} | {r.wall_s:.0f} |"
        )
    return "\n".join([head, *rows])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=None, help="an imported model folder")
    parser.add_argument(
        "--gguf", type=Path, nargs="*", default=[], help="the GGUF file, or its parts in order"
    )
    parser.add_argument("--runs", default="tools-ppo:1234,notool-ppo:1234", help="NAME:SEED,... run together")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="a.b=c for every run")
    parser.add_argument("--gain", type=float, default=0.3)
    parser.add_argument("--goal", type=float, default=0.6)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", REPO / "runs" / "tool_task"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TOOL_TASK_WORK", "/tmp/tool_task"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_folder(args, work)
    wanted = [(n, int(s)) for n, s in (item.split(":") for item in args.runs.split(","))]
    unknown = [n for n, _ in wanted if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; choose from {sorted(VARIANTS)}")
    reports: list[RunReport] = [RunReport(n, s) for n, s in wanted]
    threads = [
        threading.Thread(
            target=lambda i=i, n=n, s=s: reports.__setitem__(i, _run(n, s, model, work, out, args.sets))
        )
        for i, (n, s) in enumerate(wanted)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    text = table(reports, args.gain, args.goal)
    print(text)
    (out / "tool_task.md").write_text(text + "\n")
    (out / "tool_task.json").write_text(json.dumps([asdict(r) for r in reports], indent=1))
    for r in reports:
        print(f"{r.name} seed {r.seed}: evaluations {[(s, round(a, 3), round(w)) for s, a, w in r.evals]}")
    failed = [f"{r.name} seed {r.seed}: {r.error}" for r in reports if r.error]
    for line in failed:
        print("FAILED", line, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
