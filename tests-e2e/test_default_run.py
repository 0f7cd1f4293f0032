"""The default `ppo-driver train`, started as a new user would: it learns, the engines end with the
actor's weights, the value handoff and the sleep/wake transitions happen every step, and a run that
died after a checkpoint and resumes ends exactly where the uninterrupted one did."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
from conftest import check_step_budget, run_cli

from ppo_driver.config import load_config

DEFAULT = load_config()  # the embedded default, what `ppo-driver train` runs without a config
STEPS = DEFAULT.train.steps
WINDOW = 5
LEARNT = 0.8  # mean reward of the last WINDOW steps, and of the final greedy evaluation
RESUME_AT = DEFAULT.checkpoint.interval  # the first checkpoint of the default run
# A second seed beside the default one: the recipe passes by its margin on every seed (the README's
# seed sweep), not by one curve that this CPU's float rounding happens to give.
OTHER_SEED = 0


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("default")
    done = run_cli("train", "--run-dir", "run", cwd=work, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "run", done.stdout


def _assert_learnt(run_dir: Path) -> None:
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["rollout/reward_mean"] for r in records]
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    # The task is learnt, not merely started: the bar for the default run.
    assert last >= LEARNT, (first, last, rewards)
    assert records[-1]["eval/reward_mean"] >= LEARNT, records[-1]


@pytest.mark.timeout(480)
def test_default_run_learns(default_run: tuple[Path, str]) -> None:
    run_dir, stdout = default_run
    _assert_learnt(run_dir)
    assert "run summary" in stdout
    starting = stdout.index("starting the rollout engine, the actor (1 rank), the critic (1 rank) ...")
    assert re.search(r"^started in \d+\.\d s$", stdout[starting:], re.MULTILINE), stdout[starting:][:500]
    assert "engines hold the actor's final weights: match" in stdout


@pytest.mark.timeout(480)
def test_default_recipe_learns_on_another_seed(tmp_path: Path) -> None:
    done = run_cli(
        "train",
        *("--run-dir", "run", "--set", f"train.seed={OTHER_SEED}", "--set", "logging.progress=false"),
        cwd=tmp_path,
        timeout=420,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _assert_learnt(tmp_path / "run")


@pytest.mark.timeout(480)
def test_every_second_of_a_step_is_accounted_for(default_run: tuple[Path, str]) -> None:
    run_dir, stdout = default_run
    check_step_budget(_metrics(run_dir), ("actor", "critic", "engines"), engines_move=True)
    # The summary prints the budget, "other" and the step among its rows; summary.json holds it too.
    table = stdout[stdout.index("step budget") :]
    for row in ("engines/sleep", "critic/wake", "weight_update", "handoff", "other", "step", "overhead"):
        assert row in table, row
    budget = json.loads((run_dir / "summary.json").read_text())["budget"]
    parts = {p["part"]: p for p in budget["parts"]}
    named = sum(p["mean_s"] for name, p in parts.items() if name != "step")
    assert named == pytest.approx(parts["step"]["mean_s"], rel=1e-9)
    assert parts["step"]["mean_share"] == pytest.approx(1.0)
    assert 0 < budget["overhead_fraction"]["mean"] < 1


@pytest.mark.timeout(480)
def test_engines_end_with_the_actor_weights(default_run: tuple[Path, str]) -> None:
    run_dir, _ = default_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["actor_checksum"]) == 64
    assert summary["engine_checksums"] == [summary["actor_checksum"]] * DEFAULT.placement.num_engines
    assert summary["weights_match"] is True


@pytest.mark.timeout(480)
def test_value_handoff_and_offload_every_step(default_run: tuple[Path, str]) -> None:
    run_dir, _ = default_run
    # Colocated, shared critic, offload on: each step the engines go to sleep for training and come
    # back, the critic wakes to train and sleeps, the actor wakes to train and send weights and sleeps.
    expected = {
        "rollout:sleep",
        "rollout:wake",
        "critic:wake",
        "critic:sleep",
        "actor:wake",
        "actor:sleep",
    }
    for record in _metrics(run_dir):
        step = record["step"]
        assert record["handoff/value_boxes"] == DEFAULT.placement.actor_gpus, step
        assert record["handoff/values_used"] == 1, step
        assert set(record["offload/transitions"]) == expected, (step, record["offload/transitions"])
        # Once each per step, saving steps included: a checkpoint wakes no one (the roles write it in
        # the background from the host copies of their sleeps).
        for role, count in (("actor", 1), ("critic", 1), ("rollout", 1)):
            assert record[f"offload/{role}_sleeps"] == record[f"offload/{role}_wakes"] == count, (step, role)
        # The phases ran in the order, each sleep before the wake it makes room for.
        t = record["offload/transitions"]
        assert t.index("rollout:sleep") < t.index("critic:wake") < t.index("critic:sleep")
        assert (
            t.index("critic:sleep") < t.index("actor:wake") < t.index("rollout:wake") < t.index("actor:sleep")
        )
        assert record["weight_sync/updates"] >= 1, step
        if step % DEFAULT.checkpoint.interval == 0 or step == STEPS:
            assert record["time/save_blocking"] > 0, step
    assert _metrics(run_dir)[-1]["time/save_background"] > 0  # the last step waits for its checkpoint


@pytest.mark.timeout(600)
def test_resumed_run_matches_uninterrupted(default_run: tuple[Path, str], tmp_path: Path) -> None:
    full_dir, _ = default_run
    # The run as it was when its process died after the step-RESUME_AT checkpoint: the same folder
    # without the later checkpoint (its metrics.jsonl still runs past the checkpoint).
    checkpoints = sorted(p.name for p in (full_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{RESUME_AT:06d}", f"step_{STEPS:06d}"]
    run_dir = tmp_path / "run"
    shutil.copytree(full_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS:06d}")
    (run_dir / "summary.json").unlink()

    done = run_cli("train", "--run-dir", "run", cwd=tmp_path, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"(step {RESUME_AT})" in done.stdout
    assert "differs from the checkpoint's" not in done.stdout

    resumed, full = _metrics(run_dir), _metrics(full_dir)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    keys = ("rollout/reward_mean", "actor/loss", "critic/loss", "critic/values_mean", "actor/grad_norm")
    for a, b in zip(resumed[RESUME_AT:], full[RESUME_AT:], strict=True):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    ours = json.loads((run_dir / "summary.json").read_text())
    theirs = json.loads((full_dir / "summary.json").read_text())
    assert ours["first_step"] == RESUME_AT + 1
    assert ours["actor_checksum"] == theirs["actor_checksum"]
    assert ours["weights_match"] is True


@pytest.mark.timeout(480)
def test_start_up_is_accounted_for(default_run: tuple[Path, str]) -> None:
    run_dir, stdout = default_run
    startup = json.loads((run_dir / "summary.json").read_text())["startup"]
    assert startup["from_process_start"] is True  # Python's own start and the imports count
    parts = {p["part"]: p for p in startup["parts"]}
    for part in ("python start + imports", "driver imports", "ray", "roles", "first weight update", "other"):
        assert part in parts, part
    # The rows add up to the command's start -> the first step, with a small remainder no part covers.
    assert sum(p["seconds"] for p in startup["parts"]) == pytest.approx(startup["total_s"], rel=1e-9)
    assert 0 <= parts["other"]["seconds"] <= 0.05 * startup["total_s"], parts["other"]
    assert all(p["seconds"] >= 0 for p in startup["parts"])
    # Each role's workers timed their own parts.
    roles = startup["roles"]
    for role in ("actor", "critic"):
        assert {"process start", "imports", "process group", "model", "optimizer", "pinned buffers"} <= set(
            roles[role]
        ), roles[role]
    assert {"process start", "imports", "model", "cuda graphs"} <= set(roles["rollout"]), roles["rollout"]
    assert "placement groups" in roles["driver"]
    table = stdout[stdout.index("start-up") :]
    for row in (
        "driver imports",
        "ray",
        "roles",
        "actor: imports",
        "rollout: model",
        "other",
        "to the first step",
    ):
        assert row in table, row
