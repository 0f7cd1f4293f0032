"""Shared helpers of the whole-system tests: run the `ppo-driver` console script as a user would."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from ppo_driver import checkpoint as ck

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it, run on the GPU machine")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def ppo_driver_exe() -> str:
    """The installed console script of this environment."""
    local = Path(sys.executable).with_name("ppo-driver")
    found = str(local) if local.is_file() else shutil.which("ppo-driver")
    if found is None:
        raise RuntimeError("the ppo-driver console script is not installed in this environment")
    return found


def run_cli(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run(
        [ppo_driver_exe(), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# The step budget (ppo_driver.budget): every part's key, for the roles a run has.
BUDGET_WORK = ("generate", "critic_train", "actor_train", "save", "generate_wait", "eval")
# What no named part covers may be at most this share of the steps' time (mean over steps): the loop's
# own bookkeeping between phases, a few Ray calls. More means a phase went untimed.
OTHER_SHARE_MAX = 0.10


def check_step_budget(records: list[dict[str, Any]], roles: tuple[str, ...], engines_move: bool) -> None:
    """Every budget key in every step; the parts add up to the step with little ``other``; the bytes
    of what moved are there; each inclusive phase time is its own part plus the parts inside it."""
    transitions = [f"{role}/{action}" for role in roles for action in ("sleep", "wake")]
    parts = [*BUDGET_WORK, *transitions, "weight_update", "handoff", "check_weights"]
    time_keys = [f"time/{p}_s" for p in (*parts, "other", "step")]
    byte_keys = [f"bytes/{t}" for t in transitions] + ["bytes/handoff", "bytes/weight_update"]
    others, steps = [], []
    for r in records:
        missing = [k for k in (*time_keys, *byte_keys, "time/overhead_fraction") if k not in r]
        assert not missing, (r["step"], missing)
        named = sum(r[f"time/{p}_s"] for p in parts)
        assert all(r[f"time/{p}_s"] >= 0 for p in parts), r["step"]
        assert named + r["time/other_s"] == pytest.approx(r["time/step_s"], abs=1e-9)
        assert r["time/other_s"] >= -1e-6, (r["step"], r["time/other_s"])  # no part counted twice
        others.append(r["time/other_s"])
        steps.append(r["time/step_s"])
        overhead = sum(r[f"time/{p}_s"] for p in (*transitions, "weight_update", "handoff"))
        method_s = r["time/step_s"] - r["time/check_weights_s"]  # a check the run asked for: left out
        assert r["time/overhead_fraction"] == pytest.approx(overhead / method_s)
        # The inclusive phase times hold their transitions and handoff halves: nothing lost, nothing twice.
        # (A step that saves wakes the critic once more, in the save: its wakes are not all nested here.)
        nested = r["time/critic/wake_s"] + (r["time/engines/sleep_s"] if engines_move else 0.0)
        assert "time/save" in r or r["time/critic_train"] == pytest.approx(
            r["time/critic_train_s"] + nested + r["critic/handoff_put_s"], rel=1e-6, abs=1e-6
        )
        # Both trainers moved every step, the critic's values went to the actor, the weights to the engines.
        for t in transitions:
            moved = engines_move or not t.startswith("engines/")
            assert (r[f"bytes/{t}"] > 0) == moved, (r["step"], t, r[f"bytes/{t}"])
            assert (r[f"time/{t}_s"] > 0) == moved, (r["step"], t)
        assert r["bytes/handoff"] > 0, r["step"]
        assert r["time/handoff_s"] > 0, r["step"]
        assert r["bytes/weight_update"] == r["weight_sync/bytes"] > 0, r["step"]
    assert sum(others) <= OTHER_SHARE_MAX * sum(steps), (others, steps)


# Fault drills (test_faults.py, test_sharded_faults.py): runs of the CLI, killed and re-run.
DRILL_STEPS = 8
DRILL_SETTINGS = {
    "train.steps": DRILL_STEPS,
    "checkpoint.interval": 2,
    "checkpoint.keep": 4,
    "rollout.prompts_per_step": 8,
    "logging.tensorboard": "false",
}
MARK = "PPO_FAULT_DRILL"  # an environment variable every process of a drill run inherits
# One run's limit on a loaded 2-core machine; PPO_E2E_RUN_S raises it where the machine is shared
# further (at a load average of 30 on 2 cores, the roles' start-up alone took over 5 minutes).
RUN_S = float(os.environ.get("PPO_E2E_RUN_S", "300"))


class Run:
    """One `ppo-driver train` process over ``run_dir``; every process it starts carries ``mark``."""

    def __init__(
        self, run_dir: Path, *extra: str, env: dict[str, str] | None = None, wrap: list[str] | None = None
    ) -> None:
        """``wrap``: a command prefix that execs the rest (``unshare -m sh -c '... exec "$0" "$@"'``)."""
        self.run_dir = run_dir
        self.mark = uuid.uuid4().hex
        (run_dir / "processes.json").unlink(missing_ok=True)  # an earlier run's
        args = [*(wrap or []), ppo_driver_exe(), "train", "--run-dir", str(run_dir)]
        for key, value in DRILL_SETTINGS.items():
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
        """Until this run has printed ``step N/DRILL_STEPS`` (its own progress line, not an earlier run's)."""
        self.wait_until(f"step {step}", lambda: f"step {step}/{DRILL_STEPS} " in self.text())

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


def listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of ``pids``, from ``/proc`` (Linux)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:  # gone meanwhile
            continue
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in owner:  # 0A: LISTEN
                address, port = local.split(":")
                found.append((_ip(address), int(port, 16), owner[inode]))
    return found


def _ip(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net writes each 32-bit word in host (little-endian) order.
    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
    packed = b"".join(words)
    if len(packed) == 4:
        return ".".join(str(b) for b in packed)
    if packed[:12] == bytes(10) + b"\xff\xff":  # an IPv4 address mapped into IPv6
        return ".".join(str(b) for b in packed[12:])
    return ":".join(packed[i : i + 2].hex() for i in range(0, 16, 2))


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


def actor_writing(root: Path) -> list[Path]:
    """The staging folders of saves whose actor part is still being written: the actor's folder is
    renamed into place when its writers are done, until then the save of that step runs in the
    background, after the loop moved on from the save point."""
    if not root.is_dir():
        return []
    return [p for p in root.glob(".tmp-step_*") if (p / "actor.partial").is_dir()]


def kill_during_background_save(run_dir: Path, *extra: str, rank: int, fault: str) -> tuple[int, Path] | None:
    """Kill the actor's rank ``rank`` while a background save of the actor is written: the run fails
    cleanly, naming ``fault``, and that step's checkpoint is never marked complete. Returns the latest
    complete one (verified), from which a re-run resumes."""
    run = Run(run_dir, *extra)
    victim = run.pids()["actor"][rank]
    root = run_dir / "checkpoints"
    run.wait_until("a background save of the actor", lambda: bool(actor_writing(root)))
    writing = actor_writing(root)
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, fault)
    unfinished_step = int(writing[0].name.removeprefix(".tmp-step_"))
    found = latest(run_dir)
    assert found is None or found[0] < unfinished_step  # never marked complete
    if found is not None:
        ck.verify(found[1])
    return found


def check_completed_like(run_dir: Path, reference: Path, checkpoints: list[int]) -> None:
    """A run finished after faults: no unfinished save left, the ``checkpoints`` complete, and the
    final weights of an uninterrupted run, bit for bit."""
    root = run_dir / "checkpoints"
    assert not list(root.glob(".tmp-step_*"))
    assert [s for s, _ in ck.complete_checkpoints(root)] == checkpoints
    assert final_checksum(run_dir) == final_checksum(reference)
