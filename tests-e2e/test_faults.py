"""Fault drills, in the spirit of miles' fault-tolerance suite: kill each role's process, kill the
driver during a save, stop it with SIGTERM, tamper with checkpoints, cut the metrics file. After each
fault the run says what happened and where a re-run resumes, no process of the run is left, and the
re-run ends with the same final weights as an uninterrupted run, bit for bit.

One uninterrupted reference run (module fixture) serves every test; runs are 8 short steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ppo_driver_exe

from ppo_driver import checkpoint as ck

STEPS = 8
SETTINGS = {
    "train.steps": STEPS,
    "checkpoint.interval": 2,
    "checkpoint.keep": 4,
    "rollout.prompts_per_step": 8,
    "logging.tensorboard": "false",
}
MARK = "PPO_FAULT_DRILL"  # an environment variable every process of a drill run inherits
RUN_S = 300.0  # one run's limit on a loaded 2-core machine


class Run:
    """One `ppo-driver train` process over ``run_dir``; every process it starts carries ``mark``."""

    def __init__(self, run_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.mark = uuid.uuid4().hex
        (run_dir / "processes.json").unlink(missing_ok=True)  # an earlier run's
        args = [ppo_driver_exe(), "train", "--run-dir", str(run_dir)]
        for key, value in SETTINGS.items():
            args += ["--set", f"{key}={value}"]
        args += list(extra)
        self.out = run_dir.with_name(run_dir.name + f".{self.mark[:8]}.log")
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.out.open("w")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200", MARK: self.mark, **(env or {})}
        self.proc = subprocess.Popen(
            args, cwd=run_dir.parent, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_until(self, what: str, ready: Callable[[], bool], timeout: float = RUN_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited ({self.proc.returncode}) before {what}:\n{self.text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout:.0f} s:\n{self.text()}")
            time.sleep(0.02)

    def finish(self, timeout: float = RUN_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close()

    def text(self) -> str:
        return self.out.read_text()

    def wait_for_step(self, step: int) -> None:
        """Until this run has printed ``step N/STEPS`` (its own progress line, not an earlier run's)."""
        self.wait_until(f"step {step}", lambda: f"step {step}/{STEPS} " in self.text())

    def pids(self) -> dict[str, list[int]]:
        self.wait_until("processes.json", (self.run_dir / "processes.json").is_file)
        data: dict[str, list[int]] = json.loads((self.run_dir / "processes.json").read_text())
        return data

    def leftovers(self, timeout: float = 60.0) -> list[int]:
        """Processes of this run still alive after ``timeout`` s (Ray's shutdown takes a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            alive = marked(self.mark)
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)


def marked(mark: str) -> list[int]:
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def latest(run_dir: Path) -> tuple[int, Path] | None:
    return ck.latest_complete(run_dir / "checkpoints")


def final_checksum(run_dir: Path) -> str:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    assert summary["weights_match"] is True
    return str(summary["actor_checksum"])


def expect_clean_failure(run: Run, fault: str) -> None:
    """Exit 1 naming the step, phase and fault and where a re-run resumes; no process left behind."""
    code = run.finish()
    text = run.text()
    assert code == 1, text
    assert re.search(r"the run stopped at step \d+, phase \w+: ", text), text
    assert fault in text, text
    found = latest(run.run_dir)
    if found is None:
        assert "a re-run of the same command starts from step 0" in text, text
    else:
        assert f"a re-run of the same command resumes from {found[1]} (step {found[0]})" in text, text
    assert "Traceback" not in text, text
    assert run.leftovers() == [], f"processes of the run still alive:\n{text}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = Run(tmp_path_factory.mktemp("reference") / "run")
    assert run.finish() == 0, run.text()
    return run.run_dir


@pytest.mark.timeout(1800)
def test_kills_and_stops_lose_nothing(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    # The actor's process dies once the first step is logged.
    run = Run(run_dir)
    victim = run.pids()["actor"][0]
    run.wait_for_step(1)
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "actor rank 0: ")

    # SIGTERM: the run stops at the end of the step, saves it, and says how to resume.
    run = Run(run_dir)
    start = latest(run_dir)
    run.wait_for_step(start[0] + 1 if start else 1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM, run.text()
    stopped = latest(run_dir)
    assert stopped is not None
    assert (
        f"stopped by SIGTERM after step {stopped[0]}; a re-run of the same command resumes from" in run.text()
    )
    assert "Traceback" not in run.text()
    assert run.leftovers() == []

    # The critic's process dies.
    run = Run(run_dir)
    victim = run.pids()["critic"][0]
    run.wait_for_step(stopped[0] + 1)
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "critic rank 0: ")

    # The driver is SIGKILLed while it writes a checkpoint: the latest complete one stays loadable.
    before = latest(run_dir)
    run = Run(run_dir)

    def saving() -> bool:
        root = run_dir / "checkpoints"
        return root.is_dir() and any(p.name.startswith(".tmp-step_") for p in root.iterdir())

    run.wait_until("a checkpoint being written", saving)
    run.proc.kill()
    run.finish()
    for pid in run.leftovers(timeout=30):  # nothing is left to end them: a SIGKILL cannot be handled
        os.kill(pid, signal.SIGKILL)
    after = latest(run_dir)
    assert after is not None
    ck.verify(after[1])
    assert before is None or after[0] >= before[0]

    # The engine's process dies.
    run = Run(run_dir)
    victim = run.pids()["rollout"][0]
    resumed_at = after[0]
    run.wait_for_step(resumed_at + 1)
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "engine rollout-0: ")

    # A kill mid-write cuts the metrics file's last line: dropped with a warning.
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-7])
    run = Run(run_dir)
    assert run.finish() == 0, run.text()
    assert "the last line is cut short" in run.text()
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(1, STEPS + 1))
    assert final_checksum(run_dir) == final_checksum(reference)


@pytest.mark.timeout(900)
def test_tampered_checkpoints_are_skipped_for_the_previous_one(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    (run_dir / "summary.json").unlink()
    root = run_dir / "checkpoints"
    assert [s for s, _ in ck.complete_checkpoints(root)] == [2, 4, 6, 8]
    (root / "step_000008" / ck.MARKER).unlink()  # a copy cut short: no marker
    tensor = root / "step_000006" / "actor" / "model.safetensors"
    tensor.write_bytes(tensor.read_bytes()[: tensor.stat().st_size // 2])  # truncated tensor file
    driver_json = root / "step_000004" / "driver.json"
    driver_json.write_bytes(b"x" + driver_json.read_bytes()[1:])  # bad JSON, of the size written
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-3])

    run = Run(run_dir)
    assert run.finish() == 0, run.text()
    text = run.text()
    assert f"checkpoint {root / 'step_000006'} does not load" in text
    assert "actor/model.safetensors has" in text
    assert f"checkpoint {root / 'step_000004'} does not load" in text
    assert "driver.json is not valid JSON" in text
    assert f"resumed from {root / 'step_000002'} (step 2)" in text
    assert "the last line is cut short" in text
    assert final_checksum(run_dir) == final_checksum(reference)


@pytest.mark.timeout(600)
def test_non_finite_training_stops_before_saving_or_sending(tmp_path: Path) -> None:
    # Rewards that fit float32 but whose squares do not: the critic's loss is inf at step 1.
    (tmp_path / "huge_reward.py").write_text("def score(samples):\n    return [1e30 for _ in samples]\n")
    run = Run(
        tmp_path / "run", "--set", "rollout.reward=huge_reward:score", env={"PYTHONPATH": str(tmp_path)}
    )
    expect_clean_failure(run, "the critic reported non-finite values at step 1 (loss=inf")
    assert "neither saved nor sent to the engines" in run.text()
    assert latest(run.run_dir) is None
    assert not (run.run_dir / "summary.json").exists()


def _finite_file(path: Path) -> bool:
    from safetensors.torch import load_file

    return all(bool(t.isfinite().all()) for t in load_file(str(path)).values() if t.is_floating_point())


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("role", "interval", "phase"),
    [
        ("actor", 100, "weight_update"),  # no save at step 1: the weight update is what must refuse
        ("critic", 1, "save"),  # the critic's weights are never sent: its save must refuse
    ],
)
def test_non_finite_weights_reach_neither_engines_nor_checkpoints(
    tmp_path: Path, role: str, interval: int, phase: str
) -> None:
    # The role's workers write a NaN into a weight right after step 1's optimizer step (the trainer's
    # fault-injection hook): the step's loss and gradient norm are finite, so only the check of the
    # weights themselves can stop the run before the save or the weight update.
    run = Run(
        tmp_path / "run",
        *("--set", f"checkpoint.interval={interval}"),
        env={"PPO_FAULT_NON_FINITE_WEIGHTS": f"{role}:1"},
    )
    expect_clean_failure(run, f"the {role} reported non-finite values at step 1 (weights of rank 0: ")
    text = run.text()
    assert f"the run stopped at step 1, phase {phase}: " in text, text
    assert "neither saved nor sent to the engines" in text, text
    # The engines still hold step 0's finite weights (the sender refused before sending anything), no
    # checkpoint was completed, and no complete checkpoint on disk holds a non-finite weight.
    assert latest(run.run_dir) is None
    for _, folder in ck.complete_checkpoints(run.run_dir / "checkpoints"):
        assert all(_finite_file(f) for f in folder.rglob("*.safetensors")), folder
    assert not (run.run_dir / "summary.json").exists()


@pytest.mark.timeout(1200)
def test_kill_during_a_background_save_keeps_the_previous_checkpoint(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    run = Run(run_dir)
    victim = run.pids()["actor"][0]

    def actor_writing() -> list[Path]:
        # The actor's folder is renamed into place when its writers are done: until then the save of
        # that step runs in the background, after the loop moved on from the save point.
        if not root.is_dir():
            return []
        return [p for p in root.glob(".tmp-step_*") if (p / "actor.partial").is_dir()]

    run.wait_until("a background save of the actor", lambda: bool(actor_writing()))
    writing = actor_writing()
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "actor rank 0: ")
    unfinished_step = int(writing[0].name.removeprefix(".tmp-step_"))
    found = latest(run_dir)
    assert found is None or found[0] < unfinished_step  # never marked complete
    if found is not None:
        ck.verify(found[1])

    # The re-run discards the unfinished save, resumes from the previous complete checkpoint (or the
    # start), and ends where an uninterrupted run ends, bit for bit.
    run = Run(run_dir)
    assert run.finish() == 0, run.text()
    if found is not None:
        assert f"resumed from {found[1]} (step {found[0]})" in run.text()
    assert not list(root.glob(".tmp-step_*"))
    assert [s for s, _ in ck.complete_checkpoints(root)] == [2, 4, 6, 8]
    assert final_checksum(run_dir) == final_checksum(reference)
