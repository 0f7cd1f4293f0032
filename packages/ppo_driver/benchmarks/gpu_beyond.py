"""GPU check on 2 GPUs (NCCL weight updates): the scenarios of tests-e2e/test_beyond_seeds.py on
configs/2gpu-disaggregate.yaml (GPU 0: actor and shared critic taking turns; GPU 1: the engine),
then one-step-off against the synchronous loop in steps per hour. Exits non-zero when any check
fails. A plain script (pytest is not needed on the GPU machine).

    python packages/ppo_driver/benchmarks/gpu_beyond.py [--steps 12] [--out DIR]

1. disaggregated, shared critic, reward-level KL: every update lands on the engine (version and
   checksum), through a new NCCL group each time (the actor disconnected before it slept), and the
   critic and the actor train on the same KL-shaped rewards;
2. one-step-off: batches one weight version old on every prefetched step, none across a checkpoint,
   and a resumed run ends with the same weights as an uninterrupted one;
3. steps per hour, one-step-off against sync, same seed (bench_one_step_off.py), for the config as
   it is (4-token responses) and with responses of up to 128 tokens.

A dedicated critic of another size than the actor's needs four devices with a separate engine
(actor 1 + critic 2 + engine 1); on 2 GPUs it is covered by the CPU tests only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_one_step_off import compare, table

from ppo_driver.config import RunConfig, load_config
from ppo_driver.loop import train
from ppo_driver.roles import Roles, create_roles

CONFIG: str | None = "configs/2gpu-disaggregate.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "rollout.eval_interval=0"]
EXTRA: list[str] = []  # --set overrides for every run (e.g. a CPU smoke run of this script)
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("ok     " if ok else "FAILED ") + what, flush=True)
    if not ok:
        FAILURES.append(what)


def _engine_groups(rollout: Any) -> list[list[str]]:
    def groups(engine: Any) -> list[str]:
        return sorted(engine.receiver._groups)

    return [ray.get(e.actor.__ray_call__.remote(groups), timeout=60) for e in rollout.engines]


class WatchedActor:
    """The real actor group; checks the engines after each sleep and each update (see the e2e test)."""

    def __init__(self, actor: Any, rollout: Any) -> None:
        self._actor, self._rollout = actor, rollout
        self.sleeps_without_group = 0
        self.sleeps = 0
        self.updates: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor, name)

    def sleep(self) -> None:
        self._actor.sleep()
        self.sleeps += 1
        self.sleeps_without_group += int(all(g == [] for g in _engine_groups(self._rollout)))

    def update_weights(self, version: str) -> dict[str, float]:
        metrics = self._actor.update_weights(version)
        self.updates.append(
            {
                "version": version,
                "engine_versions": [
                    e.endpoint().get_weight_version().result(60) for e in self._rollout.engines
                ],
                "engine_checksums": list(self._rollout.weights_checksums()),
                "actor_checksum": self._actor.weights_checksum(),
                "groups": _engine_groups(self._rollout),
            }
        )
        return metrics


def scenario_shared_critic_reward_kl(root: Path) -> None:
    holder: dict[str, WatchedActor] = {}

    def factory(config: RunConfig, model_path: Path, timeout_s: float) -> Roles:
        roles = create_roles(config, model_path, timeout_s)
        holder["actor"] = WatchedActor(roles.actor, roles.rollout)
        return Roles(roles.rollout, holder["actor"], roles.critic, close=roles.close)

    config = load_config(
        CONFIG, [*QUIET, *EXTRA, "algorithm.kl_coef=0.05", "train.steps=4", "checkpoint.interval=0"]
    )
    check(config.placement.mode == "disaggregate" and config.placement.critic == "shared", "1: config")
    result = train(config, root / "shared-kl", console=Console(quiet=True), roles_factory=factory)
    w = holder["actor"]
    check([u["version"] for u in w.updates] == ["0", "1", "2", "3", "4"], "1: one update per step")
    for u in w.updates:
        check(
            all(v == u["version"] for v in u["engine_versions"])
            and all(c == u["actor_checksum"] for c in u["engine_checksums"]),
            f"1: update {u['version']} landed on every engine (version and checksum)",
        )
    names = [u["groups"][0][0] if u["groups"][0] else "" for u in w.updates]
    check(all(names) and len(set(names)) == len(names), "1: a new NCCL group for every update")
    check(w.sleeps >= 4 and w.sleeps_without_group == w.sleeps, "1: no group survives an actor sleep")
    for r in result.history:
        check(
            math.isclose(r["critic/token_reward_sum_mean"], r["actor/token_reward_sum_mean"], abs_tol=1e-5),
            f"1: step {r['step']}: critic and actor trained on the same rewards",
        )
        check(
            math.isfinite(r["critic/value_loss"]) and math.isfinite(r["actor/pg_loss"]),
            f"1: step {r['step']}: losses finite",
        )
    check(result.history[-1]["critic/reward_kl"] > 0.0, "1: the KL penalty is non-zero after training")
    check(result.weights_match, "1: engines hold the actor's final weights")


def scenario_one_step_off(root: Path) -> None:
    base = [*QUIET, *EXTRA, "train.async=one_step_off", "algorithm.tis_cap=2.0", "checkpoint.interval=2"]
    full = train(
        load_config(CONFIG, [*base, "train.steps=4"]), root / "off-full", console=Console(quiet=True)
    )
    h = full.history
    check([r["rollout/staleness"] for r in h] == [0, 1, 0, 1], "2: staleness per step [0, 1, 0, 1]")
    check([r["rollout/prefetched_next"] for r in h] == [1, 0, 1, 0], "2: no prefetch across a checkpoint")
    check(all(0.0 < r["actor/tis_weight_mean"] <= 2.0 for r in h), "2: importance weights within the cap")
    check(full.weights_match, "2: engines hold the actor's final weights")
    run = root / "off-resumed"
    train(load_config(CONFIG, [*base, "train.steps=2"]), run, console=Console(quiet=True))
    resumed = train(load_config(CONFIG, [*base, "train.steps=4"]), run, console=Console(quiet=True))
    check(resumed.actor_checksum == full.actor_checksum, "2: resumed run ends with the same weights")


def main() -> int:
    global CONFIG
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps of each speed run")
    parser.add_argument("--out", type=Path, default=None, help="write the speed rows here (JSON)")
    parser.add_argument("--config", default=CONFIG, help="'default': the CPU default config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="a.b=c for every run")
    parser.add_argument("--no-speed", action="store_true", help="only the checks (1 and 2)")
    args = parser.parse_args()
    CONFIG = None if args.config == "default" else args.config
    EXTRA.extend(args.overrides)
    # the CPU smoke run: as many logical CPUs as the e2e tests use; on GPUs, what the machine has
    ray.init(num_cpus=4 if CONFIG is None else None, include_dashboard=False, log_to_driver=False)
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, fn in (
            ("shared critic + reward KL", scenario_shared_critic_reward_kl),
            ("one-step-off", scenario_one_step_off),
        ):
            t0 = time.perf_counter()
            try:
                fn(root)
            except Exception as exc:  # a scenario that raises is a failure; the others still run
                check(False, f"{name}: raised {type(exc).__name__}: {exc}")
            print(f"--- {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        speed = [
            ("as configured (4-token responses)", [*EXTRA]),
            (
                "longer responses (up to 128 tokens)",
                [*EXTRA, "rollout.sampling.max_new_tokens=128", "model.tiny.max_positions=160"],
            ),
        ]
        for label, extra in [] if args.no_speed else speed:
            t0 = time.perf_counter()
            try:
                rows[label] = compare(CONFIG, extra, args.steps, root / label.split()[0])
                print(f"\n### {label}\n\n{table(rows[label])}\n", flush=True)
                check(all(r["weights_match"] for r in rows[label].values()), f"3: {label}: weights match")
            except Exception as exc:
                check(False, f"3: {label}: raised {type(exc).__name__}: {exc}")
            print(f"--- speed {label}: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    ray.shutdown()
    print(f"\n{len(FAILURES)} failure(s)" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    raise SystemExit(main())
