"""The step budget at a realistic scale on 2 GPUs: both seed scenarios, every second of a step.

Runs ``configs/2gpu-colocate.yaml`` (engines, actor and shared critic take turns on both GPUs) and
``configs/2gpu-disaggregate.yaml`` (GPU 0 trains actor and shared critic, GPU 1 serves) with a
0.82B-parameter model built from the config (hidden 2048, 16 layers, 16 heads, MLP 5632), responses
of exactly 256 tokens (``rollout.sampling.ignore_eos``), 32 prompts x 8 samples = 256 samples per
step, 5 steps, no checkpoint saves (their cost is a separate budget). Training must stay sane: losses
finite every step, every engine's weights checksum equal to the actor's after every update
(``train.check_weights``, the budget's ``check_weights`` part), and at the end. Prints, per scenario,
the step budget (``ppo_driver.budget``) as a Markdown table for the benchmark pages' performance
section, and writes them to ``$OUT/budget.md`` (or ``--out``), each also to ``budget-<scenario>.md`` as soon
as it is done. The colocated scenario on one H200 (``--scenario colocate-1gpu``) took 166 s with start-up
(2026-12-01); under a 10-minute limit per command, run one ``--scenario`` per call.

Long-tailed responses (``--response-median M``, with ``--response-max`` and ``--response-sigma``):
each sample's length is drawn from a lognormal distribution (``ppo_rollout.testing.long_tail``,
seeded by the step and the prompt), eos ignored, every request with its own ``max_new_tokens``, all
of a step's requests in one wave that the engines serve continuously; the actor and critic train
packed within a token budget; no evaluation; 3 steps by default. The checks add that every response
has its drawn length, and the section a phases' table: the generate phase's seconds against the
memory-bandwidth bound of its decode steps (weights once a step, each token's keys and values over
its context, over a device copy's rate) with the engines' slot idle share, and each train phase's
TFLOP/s against the matmul limit, both ceilings measured after the run on its device. The rollout
function runs in this process (registered as ``long_tail``), which the driver's rollout manager
shares; the run itself needs Ray like every driver run.

    python packages/ppo_driver/benchmarks/gpu_budget.py                 # both scenarios, 2 GPUs
    python packages/ppo_driver/benchmarks/gpu_budget.py --cpu-smoke     # the same path, tiny, on CPU
    python packages/ppo_driver/benchmarks/gpu_budget.py --scenario colocate --steps 8
    python packages/ppo_driver/benchmarks/gpu_budget.py --scenario colocate-1gpu --response-median 512

Exits non-zero when any scenario fails or any check does not hold (the others still run).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: --help answers without torch
    from ppo_rollout.testing.long_tail import LongTailRollout, RecordedRequest

REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Scenario:
    name: str
    config: str
    title: str
    gpus: int = 2
    extra: tuple[str, ...] = ()  # overrides on top of the config (the 1-GPU variant's placement)


SCENARIOS = {
    "colocate": Scenario(
        "colocate", "configs/2gpu-colocate.yaml", "colocated, shared critic (configs/2gpu-colocate.yaml)"
    ),
    "disaggregate": Scenario(
        "disaggregate",
        "configs/2gpu-disaggregate.yaml",
        "disaggregated, shared critic (configs/2gpu-disaggregate.yaml)",
    ),
    # The colocated seed scenario where only one GPU is lent: engine, actor and shared critic all take
    # turns on it (not in the default set; ask for it with --scenario colocate-1gpu).
    "colocate-1gpu": Scenario(
        "colocate-1gpu",
        "configs/2gpu-colocate.yaml",
        "colocated on 1 GPU, shared critic (configs/2gpu-colocate.yaml, placement.actor_gpus=1)",
        gpus=1,
        extra=("placement.actor_gpus=1",),
    ),
}
DEFAULT_SCENARIOS = ("colocate", "disaggregate")

MODEL = (  # 0.82B parameters with the copy task's tokenizer
    "model.tiny.hidden_size=2048",
    "model.tiny.num_layers=16",
    "model.tiny.num_heads=16",
    "model.tiny.intermediate_size=5632",
    "model.tiny.max_positions=320",  # prompt + 256 response tokens
)
WORKLOAD = (
    "rollout.sampling.max_new_tokens=256",
    "rollout.sampling.ignore_eos=true",  # every response is 256 tokens long
    "rollout.prompts_per_step=32",
    "rollout.sampling.n_samples_per_prompt=8",  # 256 samples per step
    "rollout.eval_prompts=8",
)
COMMON = (
    "train.check_weights=true",
    "checkpoint.interval=0",
    "checkpoint.save_final=false",
    "checkpoint.resume=false",
    "logging.progress=false",
    "logging.tensorboard=false",
)
# --cpu-smoke: the same scenarios, checks and tables with tiny sizes on CPU (a minute or two).
CPU_SMOKE = (
    "placement.device=cpu",
    "offload.backend=auto",
    "rollout.sampling.max_new_tokens=8",
    "rollout.sampling.ignore_eos=true",
    "rollout.prompts_per_step=8",
    "rollout.sampling.n_samples_per_prompt=2",
    "rollout.eval_prompts=2",
    "train.micro_batch_size=2",
)


@dataclass(frozen=True)
class Load:
    """What a scenario must reach: the checks' thresholds."""

    response_tokens: int
    samples: int
    steps: int


GPU_LOAD = Load(response_tokens=256, samples=256, steps=5)
CPU_LOAD = Load(response_tokens=8, samples=16, steps=2)


@dataclass(frozen=True)
class LongTail:
    """``--response-median``: every sample's own response length, lognormal (``median``, ``sigma``)
    clipped to ``longest`` tokens (``ppo_rollout.testing.long_tail``), eos ignored; the engine serves
    the step's requests continuously, each with its own ``max_new_tokens``."""

    median: float
    longest: int
    sigma: float

    def overrides(self, cpu_smoke: bool) -> list[str]:
        out = [
            "rollout.rollout_function=long_tail",  # registered in this process by main()
            f"rollout.sampling.max_new_tokens={self.longest}",
            "rollout.sampling.ignore_eos=true",
            f"rollout.multi_turn.max_response_tokens={self.longest}",  # a rollout function's limit
            # An evaluation would decode the long tail again, outside the steps this budget is about.
            "rollout.eval_prompts=0",
            # Long samples train packed within a token budget (the trainer benchmark's best variant).
            "train.pack_sequences=true",
            f"train.max_tokens_per_micro_batch={max(16384, 2 * self.longest) if not cpu_smoke else 256}",
        ]
        if not cpu_smoke:
            out.append(f"model.tiny.max_positions={self.longest + 64}")  # prompt + the longest response
        return out


# 3 steps by default (the first and two after it), 2 at the least: a long-tailed step decodes for as
# long as its longest response, and a run has to fit one command's time on a lent GPU.
LONG_TAIL_GPU_STEPS = 3


class CheckFailed(AssertionError):
    pass


def check(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)
    print(f"  ok: {what}", flush=True)


def overrides(cpu_smoke: bool, steps: int, long_tail: LongTail | None = None) -> list[str]:
    load = list(CPU_SMOKE) if cpu_smoke else [*MODEL, *WORKLOAD]
    tail = long_tail.overrides(cpu_smoke) if long_tail is not None else []
    return [*load, *tail, *COMMON, f"train.steps={steps}"]


def parameters(model_dir: Path) -> int:
    """Parameters of the model the run built (counted on the meta device: nothing is allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def run_scenario(
    scenario: Scenario,
    root: Path,
    *,
    cpu_smoke: bool,
    steps: int,
    sets: Sequence[str] = (),
    long_tail: tuple[LongTail, LongTailRollout] | None = None,
) -> str:
    """Train one scenario, check it, return its Markdown section (heading, load, budget table; with
    ``long_tail`` (its settings and the registered rollout function) the phases' table too)."""
    from rich.console import Console

    from ppo_driver.budget import markdown_table
    from ppo_driver.config import load_config
    from ppo_driver.loop import train

    load = CPU_LOAD if cpu_smoke else GPU_LOAD
    load = Load(load.response_tokens, load.samples, steps)
    tail, fn = long_tail if long_tail is not None else (None, None)
    config = load_config(REPO / scenario.config, [*overrides(cpu_smoke, steps, tail), *scenario.extra, *sets])
    check(config.placement.critic == "shared", f"{scenario.name}: the critic is shared")
    run_dir = root / scenario.name
    print(f"=== {scenario.title}: {run_dir}", flush=True)
    made_before = len(fn.requests) if fn is not None else 0
    t0 = time.monotonic()
    result = train(config, run_dir, console=Console(stderr=True))
    wall = time.monotonic() - t0
    history = result.history
    check(len(history) == load.steps, f"{scenario.name}: {load.steps} steps ran (got {len(history)})")
    for r in history:
        step = r["step"]
        losses = {k: r.get(k) for k in ("actor/loss", "critic/loss")}
        check(
            all(isinstance(v, int | float) and math.isfinite(v) for v in losses.values()),
            f"{scenario.name} step {step}: losses finite {losses}",
        )
        check(
            r["rollout/samples"] >= load.samples,
            f"{scenario.name} step {step}: {r['rollout/samples']:.0f} samples >= {load.samples}",
        )
        if fn is None:
            check(
                r["rollout/response_length_mean"] >= load.response_tokens,
                f"{scenario.name} step {step}: responses {r['rollout/response_length_mean']:.0f} tokens "
                f">= {load.response_tokens}",
            )
        check(r["time/check_weights_s"] > 0, f"{scenario.name} step {step}: engines checked after the update")
        parts = sum(  # hidden seconds (overlapped transitions) are inside other parts: not added
            v
            for k, v in r.items()
            if k.startswith("time/")
            and k.endswith("_s")
            and k != "time/step_s"
            and not k.endswith("_hidden_s")
        )
        check(
            abs(parts - r["time/step_s"]) < 1e-6 and r["time/other_s"] > -1e-6,
            f"{scenario.name} step {step}: the parts add up to the step ({r['time/step_s']:.3f} s, "
            f"other {r['time/other_s']:.3f} s)",
        )
    check(result.weights_match, f"{scenario.name}: the engines end with the actor's weights")
    tail_lines: list[str] = []
    if tail is not None and fn is not None:
        made = fn.requests[made_before:]
        tail_lines = long_tail_section(scenario.name, config, run_dir, history, made, tail)
    params = parameters(run_dir / "model")
    if not cpu_smoke:
        check(0.5e9 <= params <= 1e9, f"{scenario.name}: a 0.5-1B model ({params / 1e9:.2f}B)")
    workload = (
        f"{load.response_tokens} response tokens"
        if tail is None
        else f"lognormal response lengths (median {tail.median:g}, max {tail.longest}, sigma {tail.sigma:g}; "
        "eos ignored, each request its own max_new_tokens)"
    )
    first, *rest = history
    mean_step = sum(r["time/step_s"] for r in rest) / len(rest) if rest else first["time/step_s"]
    lines = [
        f"### {scenario.title}",
        "",
        f"{params / 1e9:.2f}B parameters, {load.samples} samples x {workload} "
        f"per step, {load.steps} steps (mean step {mean_step:.2f} s after the first, "
        f"{first['time/step_s']:.2f} s for the first; {wall:.0f} s for the whole run with start-up).",
        "",
        f"Transitions {'overlapped' if history[-1].get('offload/overlap') else 'sequential'} "
        f"(offload.overlap={config.offload.overlap}).",
        "",
        markdown_table(history),
        "",
        transition_breakdown(rest or [first]),
        *tail_lines,
    ]
    return "\n".join(lines)


def long_tail_section(
    name: str,
    config: Any,
    run_dir: Path,
    history: Sequence[dict[str, float]],
    made: Sequence[RecordedRequest],
    tail: LongTail,
) -> list[str]:
    """Checks that every step decoded its drawn lengths, then the phases' table: the generate phase
    against the memory-bandwidth bound of its decode steps (with the engines' slot idle share), the
    train phases' TFLOP/s against the matmul limit; both ceilings measured here, after the run, on the
    device it used."""
    import statistics

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ppo_driver.budget import phase_tflops
    from ppo_driver.build import rollout_config
    from ppo_rollout.engine.builtin import BuiltinEngine
    from ppo_rollout.engine.continuous import idle_share
    from ppo_rollout.engine.static_decode import batch_bucket
    from ppo_rollout.testing.long_tail import copy_rate, decode_bytes, decode_sizes
    from ppo_trainer.throughput import matmul_limit

    by_step: dict[int, list[RecordedRequest]] = {}
    for r in made:
        by_step.setdefault(r.step, []).append(r)
    check(
        len(by_step) == len(history),
        f"{name}: the rollout function ran once per step ({len(by_step)} for {len(history)})",
    )
    for record, (step, requests) in zip(history, sorted(by_step.items()), strict=True):
        drawn = statistics.fmean(r.new_tokens for r in requests)
        got = record["rollout/response_length_mean"]
        check(
            abs(got - drawn) < 1e-6 * drawn and record["rollout/samples"] == len(requests),
            f"{name} step {step}: every response has its drawn length (mean {got:.1f} tokens, "
            f"longest {max(r.new_tokens for r in requests)})",
        )
    device = torch.device("cuda", 0) if config.placement.device == "cuda" else torch.device("cpu")
    itemsize = torch.empty((), dtype=getattr(torch, rollout_config(config, run_dir / "model").dtype)).itemsize
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run_dir / "model"))
    weight_bytes, kv_token_bytes = decode_sizes(model, itemsize)
    slots_max = int(inspect.signature(BuiltinEngine).parameters["max_running"].default)
    engines = config.placement.num_engines
    rate = copy_rate(device)
    limit, what = matmul_limit(device)
    # Each step after the first (the first alone in a one-step run): its requests in submission order.
    measured = list(zip(history, [r for _, r in sorted(by_step.items())], strict=True))
    rows: list[tuple[float, int, int, float]] = []
    idles: list[float | None] = []
    engine_idle: list[float] = []  # the share of the rollout's wall time no engine call ran
    for record, requests in measured[1:] or measured:
        # The client sends a wave of requests to the idle engines in contiguous, near-equal chunks
        # (generate_client); each engine decodes its chunk until its longest request is done.
        bounds = [round(k * len(requests) / engines) for k in range(engines + 1)]
        chunks = [requests[bounds[k] : bounds[k + 1]] for k in range(engines) if bounds[k + 1] > bounds[k]]
        steps = [max(r.new_tokens for r in c) - 1 for c in chunks]
        bound_s = max(
            decode_bytes(weight_bytes, kv_token_bytes, n, [(r.prompt_tokens, r.new_tokens) for r in c]) / rate
            for c, n in zip(chunks, steps, strict=True)
        )
        # Exact where a chunk fits the engine's slots at once (no refills): every slot decodes until
        # the chunk's longest request is done.
        fits = all(len(c) <= slots_max for c in chunks)
        idles.append(
            statistics.fmean(
                idle_share([r.new_tokens for r in c], batch_bucket(len(c)), n)
                for c, n in zip(chunks, steps, strict=True)
            )
            if fits
            else None
        )
        rows.append((record["time/generate_s"], sum(r.new_tokens for r in requests), max(steps), bound_s))
        engine_idle.append(float(record.get("rollout/engine_idle_share", 0.0)))
    generate_s, tokens, decode_steps, bound_s = (statistics.fmean(r[i] for r in rows) for i in range(4))
    idle = "-" if None in idles else f"{statistics.fmean(x for x in idles if x is not None):.1%}"
    tflops = phase_tflops(history)
    lines = [
        "",
        f"Phases (mean of steps 2+; device copy {rate / 1e9:.0f} GB/s and matmul limit {limit:.3g} TFLOP/s "
        f"({what}), both measured after the run on {machine_device(device)}):",
        "",
        "| phase | s | work | rate | ceiling | share of the ceiling |",
        "|---|---:|---|---:|---|---:|",
        f"| generate | {generate_s:.3f} | {tokens:.0f} tokens, {decode_steps:.0f} decode steps, slot idle "
        f"share {idle}, engines idle {statistics.fmean(engine_idle):.1%} of the rollout | "
        f"{tokens / generate_s:,.0f} tokens/s | bandwidth bound {bound_s:.3f} s | "
        f"{bound_s / generate_s:.1%} |",
    ]
    for phase, value in tflops.items():
        lines.append(
            f"| {phase} | {statistics.fmean(r[f'time/{phase}_s'] for r in history[1:] or history):.3f} | "
            f"model FLOPs (rank 0) | {value:.3g} TFLOP/s | matmul limit | {value / limit:.1%} |"
        )
    return lines


def machine_device(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU"


def transition_breakdown(records: Sequence[dict[str, float]]) -> str:
    """Inside each trainer sleep and wake (rank 0, mean per step): the lifecycle's steps, torch's cache
    release, and what the driver saw beyond the worker's own seconds (Ray round trip, queueing)."""
    rows = ["| role/transition | driver s | worker s | steps inside (s) |", "|---|---:|---:|---|"]
    for role in ("actor", "critic"):
        for kind in ("sleep", "wake"):

            def mean(key: str) -> float:
                return sum(float(r.get(key, 0.0)) for r in records) / len(records)

            driver = mean(f"time/{role}/{kind}_s") + mean(f"time/{role}/{kind}_hidden_s")
            worker = mean(f"{role}/{kind}/seconds")
            inner = sorted(
                {
                    k
                    for r in records
                    for k in r
                    # the lifecycle's steps (<role>/<kind>/step/<name>) and the worker's own
                    # (<role>/<kind>/empty_cache/seconds)
                    if k.startswith((f"{role}/{kind}/step/", f"{role}/{kind}/empty_cache/seconds"))
                }
            )
            names = [k.split("/", 2)[2].removeprefix("step/").removesuffix("/seconds") for k in inner]
            steps = ", ".join(f"{name} {mean(k):.3f}" for name, k in zip(names, inner, strict=True))
            rows.append(f"| {role}/{kind} | {driver:.3f} | {worker:.3f} | {steps} |")
    return "\n".join(rows)


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpus = f"{len(names)}x {names[0]}" if len(set(names)) == 1 else ", ".join(names)
    else:
        gpus = "no GPU (CPU smoke run)"
    return f"{gpus}, {os.cpu_count()} CPU cores, {platform.system()}, torch {torch.__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny sizes on CPU: the same path and checks"
    )
    parser.add_argument(
        "--scenario", choices=sorted(SCENARIOS), action="append", help="default: colocate and disaggregate"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="default: 5 (2 with --cpu-smoke, 3 with --response-median)"
    )
    parser.add_argument(
        "--response-median",
        type=float,
        default=None,
        help="long-tailed responses: each sample's length drawn from a lognormal with this median "
        "(eos ignored, each request its own max_new_tokens, served continuously); adds the phases' table",
    )
    parser.add_argument(
        "--response-max", type=int, default=2048, help="the longest response (--response-median)"
    )
    parser.add_argument("--response-sigma", type=float, default=1.0, help="the lognormal's sigma (its tail)")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], help="a config override, e.g. offload.overlap=off"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="run folders and budget.md; default $OUT or a temp dir"
    )
    args = parser.parse_args(argv)
    tail = (
        None
        if args.response_median is None
        else LongTail(args.response_median, args.response_max, args.response_sigma)
    )
    gpu_steps = GPU_LOAD.steps if tail is None else LONG_TAIL_GPU_STEPS
    steps = args.steps if args.steps is not None else (CPU_LOAD.steps if args.cpu_smoke else gpu_steps)
    if steps < 2:
        raise SystemExit("--steps must be at least 2: the table shows the first step and the mean after it")
    names = args.scenario or list(DEFAULT_SCENARIOS)
    if not args.cpu_smoke:
        import torch

        needed = max(SCENARIOS[name].gpus for name in names)
        if torch.cuda.device_count() < needed:
            print(
                f"error: {', '.join(names)} need {needed} GPUs, found {torch.cuda.device_count()}; "
                "use --scenario colocate-1gpu on one GPU, or --cpu-smoke on CPU",
                flush=True,
            )
            return 2
        if tail is None and steps < GPU_LOAD.steps:
            raise SystemExit(f"--steps must be at least {GPU_LOAD.steps} on GPUs")
    long_tail = None
    if tail is not None:
        from ppo_rollout.rollout_fns import register_rollout_function
        from ppo_rollout.testing.long_tail import LongTailRollout

        try:
            fn = LongTailRollout(tail.median, tail.longest, tail.sigma)
        except ValueError as exc:
            raise SystemExit(f"--response-median/--response-max/--response-sigma: {exc}") from None
        # The rollout manager runs in this process: the name resolves to this object, which records
        # every request it makes.
        register_rollout_function("long_tail")(fn)
        long_tail = (tail, fn)
    out = args.out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-budget-"))
    out.mkdir(parents=True, exist_ok=True)
    sections, failed = [], []
    header = (
        f"Step budget measured {datetime.date.today().isoformat()} on {machine()}; "
        f"`{' '.join(['python', 'packages/ppo_driver/benchmarks/gpu_budget.py', *(argv or sys.argv[1:])])}`."
    )
    for name in names:
        try:
            section = run_scenario(
                SCENARIOS[name],
                out,
                cpu_smoke=args.cpu_smoke,
                steps=steps,
                sets=args.sets,
                long_tail=long_tail,
            )
        except Exception as exc:  # every scenario runs; the exit status reports the failures
            traceback.print_exc()
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        sections.append(section)
        # Written at once: a later scenario that runs out of time does not take this table with it.
        (out / f"budget-{name}.md").write_text(f"{header}\n\n{section}\n")
    report = "\n\n".join([header, *sections]) + "\n"
    (out / "budget.md").write_text(report)
    (out / "budget.json").write_text(json.dumps({"failed": failed, "scenarios": names}, indent=1) + "\n")
    print("\n" + report, flush=True)
    if failed:
        print("FAILED:\n" + "\n".join(failed), flush=True)
        return 1
    print(f"all checks passed; tables in {out / 'budget.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
