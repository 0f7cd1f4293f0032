"""Placements and schedules beyond the seeds' frameworks, a few steps each, on one local Ray instance:

- disaggregated with a shared critic (slime's scenario): the actor disconnects from the engines
  before every sleep and reconnects for every update, and every update lands (version and checksum
  on each engine), with reward-level KL under the shared critic;
- a dedicated critic of another data-parallel size than the actor's;
- one-step-off-policy training: batches one weight version old, and a resumed run that ends with
  the same weights as an uninterrupted one;
- partial rollouts (colocated, offloaded between phases): samples paused at the budget continue at the
  next step, tokens a version old train with their importance weights (V-trace's, in the critic's
  targets and the actor's advantages, over the log-probs the actor scored before the critic trained),
  and a run resumed from a checkpoint that holds paused samples is the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import math
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from conftest import check_step_budget
from rich.console import Console

from ppo_driver.config import RunConfig, load_config
from ppo_driver.loop import train
from ppo_driver.roles import Roles, create_roles

QUIET = ["logging.progress=false", "logging.tensorboard=false", "rollout.eval_prompts=4"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=4, num_gpus=0, object_store_memory=256 * 1024**2, include_dashboard=False)
    yield
    ray.shutdown()


def _engine_groups(rollout: Any) -> list[list[str]]:
    """The weight-update groups each engine has joined (read inside the engine process)."""

    def groups(engine: Any) -> list[str]:
        return sorted(engine.receiver._groups)

    return [ray.get(e.actor.__ray_call__.remote(groups), timeout=60) for e in rollout.engines]


def _engine_versions(rollout: Any) -> list[str | None]:
    return [e.endpoint().get_weight_version().result(60) for e in rollout.engines]


class WatchedActor:
    """The real actor group, watched from outside: after each sleep the engines must hold no weight
    group (the actor disconnected first); after each update they must hold the update's version and
    the actor's weights, through a group they have not seen before (the actor reconnected)."""

    def __init__(self, actor: Any, rollout: Any) -> None:
        self._actor = actor
        self._rollout = rollout
        self.sleeps_checked = 0
        self.updates: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._actor, name)

    def sleep(self) -> None:
        self._actor.sleep()
        assert _engine_groups(self._rollout) == [[]] * len(self._rollout.engines), (
            "a group outlived the sleep"
        )
        self.sleeps_checked += 1

    def update_weights(self, version: str) -> dict[str, float]:
        metrics = self._actor.update_weights(version)
        self.updates.append(
            {
                "version": version,
                "engine_versions": _engine_versions(self._rollout),
                "engine_checksums": list(self._rollout.weights_checksums()),
                "actor_checksum": self._actor.weights_checksum(),
                "groups": _engine_groups(self._rollout),
            }
        )
        return metrics


def _watched(holder: dict[str, WatchedActor]) -> Any:
    def factory(config: RunConfig, model_path: Path, timeout_s: float) -> Roles:
        roles = create_roles(config, model_path, timeout_s)
        holder["actor"] = WatchedActor(roles.actor, roles.rollout)
        return Roles(roles.rollout, holder["actor"], roles.critic, close=roles.close)

    return factory


@pytest.mark.timeout(600)
def test_disaggregated_shared_critic_with_reward_kl(local_ray: None, tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            *QUIET,
            "placement.mode=disaggregate",
            "placement.critic=shared",
            "algorithm.kl_coef=0.05",
            "train.steps=3",
            "train.check_weights=true",
        ],
    )
    holder: dict[str, WatchedActor] = {}
    result = train(config, tmp_path / "run", console=Console(quiet=True), roles_factory=_watched(holder))
    watched = holder["actor"]
    # The first update at start-up (version "0"), then one per step; each landed on every engine.
    assert [u["version"] for u in watched.updates] == ["0", "1", "2", "3"]
    for update in watched.updates:
        assert update["engine_versions"] == [update["version"]]
        assert update["engine_checksums"] == [update["actor_checksum"]]
        assert len(update["groups"][0]) == 1
    # A new group for every update: the actor slept (and disconnected) in between.
    names = [u["groups"][0][0] for u in watched.updates]
    assert len(set(names)) == len(names)
    assert watched.sleeps_checked >= 3
    for record in result.history:
        assert "actor:sleep" in record["offload/transitions"]
        assert record["offload/rollout_sleeps"] == 0  # engines on their own bundle stay resident
        # Reward-level KL under the shared critic: both roles trained on the same shaped rewards.
        assert record["critic/token_reward_sum_mean"] == pytest.approx(
            record["actor/token_reward_sum_mean"], abs=1e-6
        )
        assert math.isfinite(record["critic/value_loss"])
        assert math.isfinite(record["actor/pg_loss"])
    first, last = result.history[0], result.history[-1]
    assert first["critic/reward_kl"] == pytest.approx(0.0, abs=1e-4)  # the engines start as the reference
    assert last["critic/reward_kl"] > 10 * abs(first["critic/reward_kl"])
    # the penalty is in the rewards: their per-sample sum is below the outcome reward
    assert last["critic/token_reward_sum_mean"] < last["rollout/reward_mean"]
    assert result.weights_match
    # The step budget of the disaggregated layout: every key, the parts add up, the engines never move.
    check_step_budget(result.history, ("actor", "critic", "engines"), engines_move=False)
    assert all(r["time/check_weights_s"] > 0 for r in result.history)  # the engines checked every step


@pytest.mark.timeout(600)
def test_dedicated_critic_of_another_size(local_ray: None, tmp_path: Path) -> None:
    config = load_config(
        None,
        [
            *QUIET,
            "placement.mode=disaggregate",
            "placement.critic=dedicated",
            "placement.actor_gpus=1",
            "placement.critic_gpus=2",
            "train.steps=2",
        ],
    )
    result = train(config, tmp_path / "run", console=Console(quiet=True))
    assert [r["step"] for r in result.history] == [1, 2]
    for record in result.history:
        assert record["handoff/value_boxes"] == 2  # two critic ranks' payloads, to one actor rank
        assert record["handoff/values_used"] == 1
        assert math.isfinite(record["critic/value_loss"])
        assert math.isfinite(record["actor/pg_loss"])
    assert result.weights_match


ONE_STEP_OFF = [
    *QUIET,
    "placement.mode=disaggregate",
    "train.async=one_step_off",
    "algorithm.tis_cap=2.0",
    "checkpoint.interval=2",
]


@pytest.mark.timeout(900)
def test_one_step_off_is_one_version_old_and_resumes_exactly(local_ray: None, tmp_path: Path) -> None:
    config = load_config(None, [*ONE_STEP_OFF, "train.steps=4"])
    full = train(config, tmp_path / "full", console=Console(quiet=True))
    history = full.history
    # Step 1 prefetches step 2's batch (weights of version 0, published 1 by then: one behind); step 2
    # saves, so nothing is in flight across the checkpoint; step 3 prefetches step 4's.
    assert [r["rollout/prefetched_next"] for r in history] == [1, 0, 1, 0]
    assert [r["rollout/staleness"] for r in history] == [0, 1, 0, 1]
    assert [r["rollout/weight_version_min"] for r in history] == [0.0, 0.0, 2.0, 2.0]
    for record in history:
        assert 0.0 < record["actor/tis_weight_mean"] <= 2.0
        assert math.isfinite(record["actor/pg_loss"])
    assert full.weights_match

    # Interrupted after step 2's checkpoint (the same folder without the later checkpoint), then
    # resumed: the same final weights, bit for bit.
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", run)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "summary.json").unlink()
    resumed = train(config, run, console=Console(quiet=True))
    assert resumed.first_step == 3
    assert resumed.actor_checksum == full.actor_checksum
    assert [r["rollout/staleness"] for r in resumed.history if r["step"] > 2] == [0, 1]


PARTIAL = [
    *QUIET,
    "rollout.prompts_per_step=8",
    "rollout.sampling.n_samples_per_prompt=4",
    "rollout.sampling.max_new_tokens=24",  # the untrained model's eos comes late: a tail to cut
    "rollout.partial.enabled=true",
    "rollout.partial.finish_fraction=0.5",
    "rollout.partial.max_staleness=1",
    "algorithm.off_policy_returns=vtrace",
    "checkpoint.interval=2",
]
# Wall-clock figures (durations, rates, shares of time): the only metrics a resume may change.
TIMING = re.compile(r"^(time|save)/|/step/|(_s|seconds|per_second|tflops|_share)$")


@pytest.mark.timeout(900)
def test_partial_rollouts_continue_paused_samples_and_resume_exactly(local_ray: None, tmp_path: Path) -> None:
    config = load_config(None, [*PARTIAL, "train.steps=4"])
    full = train(config, tmp_path / "full", console=Console(quiet=True))
    history = full.history
    assert all(r["rollout/partial/trained_groups"] >= 1 for r in history)
    assert any(r["rollout/partial/paused_samples"] > 0 for r in history)  # the budget cut samples
    assert any(r["rollout/partial/token_share_1"] > 0 for r in history)  # and they trained a version on
    for record in history:
        assert record["rollout/staleness"] <= 1
        # The critic's weights are the actor's: it trained on the log-probs the actor scored for it.
        assert record["critic/vtrace_rho_mean"] == pytest.approx(record["actor/vtrace_rho_mean"], rel=1e-6)
        assert record["critic/vtrace_rho_max"] == pytest.approx(record["actor/vtrace_rho_max"], rel=1e-6)
        assert 0.0 <= record["actor/vtrace_rho_clipped_fraction"] <= 1.0
        # the traces, lam * min(c_bar, rho), at most lam = 0.95
        assert 0.0 < record["actor/vtrace_c_mean"] <= record["actor/vtrace_c_max"] <= 0.95
        assert "actor/tis_weight_mean" not in record
        assert math.isfinite(record["actor/pg_loss"])
        assert math.isfinite(record["critic/loss"])
    assert full.weights_match

    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "summary.json").unlink()
    resumed = train(config, run, console=Console(quiet=True))
    assert resumed.first_step == 3
    assert resumed.actor_checksum == full.actor_checksum
    for mine, theirs in zip(resumed.history[-2:], history[-2:], strict=True):
        keys = {k for k in (*mine, *theirs) if not TIMING.search(k)}
        assert "rollout/partial/paused_samples" in keys
        assert "actor/loss" in keys
        assert {k: mine.get(k) for k in keys} == {k: theirs.get(k) for k in keys}, mine["step"]
