"""Where a sleep and a wake of a small megatron actor spend their time, before and after sharing groups.

One GPU; exits non-zero when a check fails. Each variant runs in its own process (megatron's
``parallel_state`` and NCCL are process-wide):

* ``megatron-before`` (only with ``--before``): the megatron actor with the packages given there (a
  copy of the code before shared groups: one process group per megatron request);
* ``megatron-after``: the same with this tree's packages (``new_group(share=True)``);
* ``torch``: the torch backend's actor on the same model, for comparison (this tree's packages).

Per variant: the Qwen2-style model of ``gpu_megatron.py``'s sleep stages (hidden 512, 4 layers,
tied embeddings: 0.22 GiB of weights and Adam state), the pinned backend, the hooks a worker
registers (release gathered parameters, disconnect from engines (not connected: nothing to do),
rebind process groups). ``--cycles`` cycles of: log-probs, sleep, wake, log-probs and a PPO step
("first work", which makes the communicators again), log-probs and a step ("steady"). Each
transition is split into its lifecycle steps by timing the ``observer`` calls (the device is
synchronized at each step boundary). Checks: every sleep frees the tracked bytes and destroys the
groups, log-probs after a wake equal those before the sleep bit for bit, every step's grad norm
is finite.

Then ``ppo_lifecycle``'s ``groups_reload.py`` on NCCL: 20 subgroups, destroy/reload/first collectives.

    python benchmarks/gpu_megatron_sleep.py [--before /path/to/old/packages]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
GIB = 1024**3
VARIANTS = ("megatron-before", "megatron-after", "torch")


def _helpers() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_megatron", HERE / "gpu_megatron.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_megatron", module)
    spec.loader.exec_module(module)
    return module


class StepTimer:
    """Seconds between the lifecycle's observer calls: one entry per step of a transition."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.steps: dict[str, float] = {}
        self._current: str | None = None
        self._start = 0.0

    def observe(self, step: str) -> None:
        self._close()
        self._current, self._start = step, time.perf_counter()

    def begin(self) -> None:
        self.steps = {}
        self._current = None

    def end(self) -> dict[str, float]:
        self._close()
        self._current = None
        return self.steps

    def _close(self) -> None:
        if self._current is not None:
            self.sync()
            self.steps[self._current] = time.perf_counter() - self._start


def child(variant: str, folder: Path, cycles: int, out: Path) -> None:
    """One variant in this process; writes its record to ``out``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ppo_lifecycle.lifecycle import Lifecycle
    from ppo_lifecycle.memory import PinnedHostBackend

    gpu = _helpers()
    vocab = 4096
    model = folder / "model"  # made by the first variant, the same file for the others
    if not (model / "config.json").exists():
        gpu.make_model(model, "qwen2", 512, 4, 8, 2, vocab, tied=True)
    batch = gpu.samples(32, 48, 48, vocab, seed=1)
    groups = gpu.init_groups()
    backend = "torch" if variant == "torch" else "megatron"
    actor = gpu.trainer(model, "actor", backend, groups)
    device = torch.device("cuda", 0)

    def sync() -> None:
        torch.cuda.synchronize(device)

    memory = PinnedHostBackend(device)
    memory.track(actor.WEIGHTS_TAG, actor.weight_tensors)
    memory.track(actor.OPTIMIZER_TAG, actor.optimizer_tensors)
    timer = StepTimer(sync)
    life = Lifecycle(memory, groups, name=variant, observer=timer.observe)
    life.add_pre_sleep_hook("release_gathered_params", actor.release_gathered)
    life.add_pre_sleep_hook("disconnect_engines", lambda: None)  # an actor not connected: a no-op
    life.add_post_wake_hook("rebind_process_groups", actor.after_groups_rebuilt)
    zeros = torch.zeros_like(batch.response_mask)

    def work() -> tuple[torch.Tensor, float]:
        lp = actor.compute_log_probs(batch)
        metrics = actor.train_actor(batch, zeros)
        sync()
        return lp, float(metrics["grad_norm"])

    work()
    tracked = sum(
        t.untyped_storage().nbytes()
        for t in {
            id(t.untyped_storage()): t for t in actor.weight_tensors() + actor.optimizer_tensors()
        }.values()
    )
    rec: dict[str, Any] = {"variant": variant, "tracked_gib": tracked / GIB, "cycles": [], "failures": []}
    rec["process_groups"] = len(distributed_c10d._world.pg_map)  # the default group included
    life.pop_metrics()
    for cycle in range(cycles):
        before = actor.compute_log_probs(batch)
        sync()
        awake = torch.cuda.memory_allocated(device)
        timer.begin()
        start = time.perf_counter()
        life.sleep()
        sync()
        sleep_s = time.perf_counter() - start
        sleep_steps = timer.end()
        freed = awake - torch.cuda.memory_allocated(device)
        groups_gone = not dist.is_initialized()
        timer.begin()
        start = time.perf_counter()
        life.wake_up()
        sync()
        wake_s = time.perf_counter() - start
        wake_steps = timer.end()
        start = time.perf_counter()
        after, grad_first = work()
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        _, grad_steady = work()
        steady_s = time.perf_counter() - start
        metrics = life.pop_metrics()
        rec["cycles"].append(
            {
                "sleep": sleep_s,
                "wake": wake_s,
                "sleep_steps": sleep_steps,
                "wake_steps": wake_steps,
                "first_work": first_s,
                "steady_work": steady_s,
                "freed_gib": freed / GIB,
                "lifecycle_step_metrics": {k: v for k, v in metrics.items() if "/step/" in k},
            }
        )
        for ok, what in (
            (
                freed > 0.9 * tracked,
                f"cycle {cycle}: sleep freed {freed / GIB:.3f} GiB of {tracked / GIB:.3f}",
            ),
            (groups_gone, f"cycle {cycle}: sleep destroyed the process groups"),
            (torch.equal(before, after), f"cycle {cycle}: log-probs after waking equal those before"),
            (
                all(math.isfinite(g) and g > 0 for g in (grad_first, grad_steady)),
                f"cycle {cycle}: finite grad norms after waking ({grad_first:.4f}, {grad_steady:.4f})",
            ),
        ):
            if not ok:
                rec["failures"].append(what)
    out.write_text(json.dumps(rec))
    memory.close()
    groups.destroy()


def _run_child(variant: str, srcs: list[Path], folder: Path, cycles: int) -> dict[str, Any]:
    out = folder / f"{variant}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(s) for s in srcs] + [env.get("PYTHONPATH", "")])
    cmd = [sys.executable, __file__, "--child", variant, "--folder", str(folder), "--cycles", str(cycles)]
    cmd += ["--out", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    print(f"[{variant}] exit {proc.returncode} in {time.perf_counter() - start:.1f} s", flush=True)
    if proc.returncode != 0 or not out.exists():
        print(proc.stdout[-3000:] + proc.stderr[-6000:], flush=True)
        return {"variant": variant, "failures": [f"{variant}: the process failed (exit {proc.returncode})"]}
    rec = dict(json.loads(out.read_text()))
    # At once, so that a run cut short still shows what it measured.
    print(f"[{variant}] " + json.dumps({k: v for k, v in rec.items() if k != "cycles"}), flush=True)
    for cycle in rec["cycles"]:
        print(f"[{variant}] " + json.dumps({k: v for k, v in cycle.items() if k != "lifecycle_step_metrics"}))
    return rec


def _summary(rec: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """(first cycle, median of the later ones) per measured quantity."""
    cycles = rec["cycles"]
    keys: dict[str, Callable[[dict[str, Any]], float]] = {
        "sleep": lambda c: c["sleep"],
        "wake": lambda c: c["wake"],
        "first work after wake - steady": lambda c: c["first_work"] - c["steady_work"],
        "steady work (log-probs + step)": lambda c: c["steady_work"],
    }
    for kind in ("sleep_steps", "wake_steps"):
        for step in cycles[0][kind]:
            keys[step] = lambda c, kind=kind, step=step: c[kind].get(step, 0.0)
    return {k: (f(cycles[0]), statistics.median(f(c) for c in cycles[1:])) for k, f in keys.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--before", type=Path, help="packages/ of the code to compare against (optional)")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--skip-groups-bench", action="store_true")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cycles < 2:
        raise ValueError(
            "--cycles must be >= 2 (the first cycle is reported apart from the median of the rest)"
        )
    if args.child:
        child(args.child, args.folder, args.cycles, args.out)
        return 0
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    if args.before is not None and not (args.before / "lifecycle" / "src").is_dir():
        raise ValueError(
            "--before must name a packages/ folder (with lifecycle/src) of the code to compare against"
        )
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    failures: list[str] = []
    records = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS if args.before is not None else VARIANTS[1:]:
            packages = (
                args.before.resolve() if args.before and variant == "megatron-before" else ROOT / "packages"
            )
            srcs = sorted(packages.glob("*/src"))
            rec = _run_child(variant, srcs, Path(tmp), args.cycles)
            failures += rec["failures"]
            if "cycles" in rec:
                records[variant] = rec
    summaries = {v: _summary(r) for v, r in records.items()}
    names: list[str] = []
    for s in summaries.values():
        names += [k for k in s if k not in names]
    print(f"\nseconds: first cycle / median of cycles 2-{args.cycles}")
    print("| | " + " | ".join(summaries) + " |")
    print("|---|" + "---|" * len(summaries))
    for rec_name, field in (
        ("tracked state (GiB)", "tracked_gib"),
        ("process groups alive", "process_groups"),
    ):
        print(f"| {rec_name} | " + " | ".join(f"{records[v][field]:.3g}" for v in summaries) + " |")
    for name in names:
        cells = [
            f"{summaries[v][name][0]:.4f} / {summaries[v][name][1]:.4f}" if name in summaries[v] else "-"
            for v in summaries
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    after = records.get("megatron-after")
    if after is not None:
        step_keys = sorted(after["cycles"][-1]["lifecycle_step_metrics"])
        print(f"\nmegatron-after, Lifecycle.pop_metrics step keys of the last cycle: {step_keys}")
        if not step_keys:
            failures.append("the lifecycle reported no per-step seconds")
    if not args.skip_groups_bench:
        bench = ROOT / "packages" / "lifecycle" / "benchmarks" / "groups_reload.py"
        proc = subprocess.run(
            [
                sys.executable,
                str(bench),
                "--backend",
                "nccl",
                "--world",
                "1",
                "--groups",
                "20",
                "--cycles",
                "2",
            ],
            capture_output=True,
            text=True,
            timeout=240,
        )
        print(proc.stdout[-3000:], flush=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:])
            failures.append(f"groups_reload.py on NCCL failed (exit {proc.returncode})")
    for what in failures:
        print("FAIL: " + what)
    print(f"\n{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(1)
