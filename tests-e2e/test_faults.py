"""Fault drills, in the spirit of miles' fault-tolerance suite: kill each role's process, kill the
driver during a save, stop it with SIGTERM and with two Ctrl-C, tamper with checkpoints, cut the
metrics file. After each fault the run says what happened and where a re-run resumes, no process of the
run is left, and the re-run ends with the same final weights as an uninterrupted run, bit for bit; a run
resumed from a checkpoint logs the uninterrupted run's steps after it.

One uninterrupted reference run (module fixture) serves every test; runs are 8 short steps. Most of a
run's time is its start-up (Ray, the roles' processes), so drills share runs: the reference run is also
the one watched for sockets bound outside the loopback interface (with the host name on the LAN), and
one folder goes through a kill of each role, a SIGTERM, a SIGKILL of the driver mid-save (its reaper
ends what it left), two Ctrl-C and a cut metrics file, each run resuming from what the one before left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    DRILL_STEPS,
    Run,
    check_completed_like,
    expect_clean_failure,
    final_checksum,
    kill_during_background_save,
    latest,
    listening,
    marked,
)

from ppo_driver import checkpoint as ck

LOOPBACK = ("127.0.0.1", "0000:0000:0000:0000:0000:0000:0000:0001")
# What a resumed run logs as the uninterrupted one did, after its checkpoint.
RESUMED_SAME = ("rollout/reward_mean", "actor/loss", "critic/loss", "critic/values_mean", "actor/grad_norm")
# A drill whose fault is not the critic's runs GRPO, without a critic: one role process fewer to start
# (a drill is mostly its start-up: about 3 s of 20 on 2 cores). The critic's own drills keep PPO.
WITHOUT_CRITIC = ("--set", "placement.critic=none", "--set", "algorithm.estimator=grpo")


def _lan_address() -> str | None:
    """This machine's first non-loopback IPv4 address."""
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def _host_name_on_the_lan(folder: Path) -> tuple[list[str], str | None, str]:
    """A command prefix that runs a command in a private mount namespace (``unshare -m``) whose
    /etc/hosts resolves this machine's host name to its LAN address, that address, and why not ('')."""
    lan = _lan_address()
    if lan is None:
        return [], None, "this machine has no non-loopback IPv4 address to map the host name to"
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-m", "true"], capture_output=True).returncode != 0:
        return [], None, "no private mount namespace here (`unshare -m` needs root or user namespaces)"
    hosts = folder / "hosts"
    hosts.write_text(f"{lan} {socket.gethostname()}\n127.0.0.1 localhost\n")
    return [unshare, "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$0" "$@"'], lan, ""


@dataclass(frozen=True)
class Reference:
    run_dir: Path
    lan: str | None  # the address the host name resolved to in the run, None: not mapped
    not_mapped: str  # why not
    sockets: frozenset[tuple[str, int, int]]  # every listening socket of the run's processes seen


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    folder = tmp_path_factory.mktemp("reference")
    wrap, lan, why = _host_name_on_the_lan(folder)
    run = Run(folder / "run", wrap=wrap)
    # Sampled all along: the roles' groups exist only while they are awake (destroyed when they sleep),
    # so one look may miss them.
    seen: set[tuple[str, int, int]] = set()
    done = threading.Event()

    def watch() -> None:
        # Finding the run's processes reads every process's environment: done every 2 s, the sockets
        # of the processes found every 0.2 s.
        pids: list[int] = []
        found_at = 0.0
        while not done.is_set():
            if time.monotonic() - found_at > 2.0:
                pids, found_at = marked(run.mark), time.monotonic()
            seen.update(listening(pids))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        assert run.finish() == 0, run.text()
    finally:
        done.set()
        watcher.join()
    return Reference(run.run_dir, lan, why, frozenset(seen))


@pytest.mark.timeout(3600)
def test_kills_and_stops_lose_nothing(reference: Reference, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"

    # The actor's process dies while its checkpoint is written in the background, after the loop
    # moved on: that step's checkpoint is never marked complete.
    start = kill_during_background_save(run_dir, rank=0, fault="actor rank 0: ")

    # SIGTERM: the run stops at the end of the step, saves it, and says how to resume. It discarded
    # the unfinished save and resumed from the previous complete checkpoint (or the start).
    run = Run(run_dir)
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
    if start is not None:
        assert f"resumed from {start[1]} (step {start[0]})" in run.text()

    # The critic's process dies.
    run = Run(run_dir)
    victim = run.pids()["critic"][0]
    run.wait_for_step(stopped[0] + 1)
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "critic rank 0: ")

    after = _driver_killed_mid_save(run_dir)

    # The engine's process dies.
    run = Run(run_dir)
    victim = run.pids()["rollout"][0]
    resumed_at = after[0]
    run.wait_for_step(resumed_at + 1)
    os.kill(victim, signal.SIGKILL)
    expect_clean_failure(run, "engine rollout-0: ")

    # Two Ctrl-C 0.2 s apart: the second stops the run at once, whatever the loop was waiting on.
    extra = _second_sigint_stops_at_once(run_dir)

    # A kill mid-write cuts the metrics file's last line: dropped with a warning.
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-7])
    run = Run(run_dir)
    assert run.finish() == 0, run.text()
    assert "the last line is cut short" in run.text()
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert steps == list(range(1, DRILL_STEPS + 1))
    # Every due checkpoint was written, the discarded unfinished ones too (checkpoint.keep=4; the
    # SIGTERM saved a step of its own, and so may a first SIGINT whose step ended before the second).
    due = sorted({*range(2, DRILL_STEPS + 1, 2), stopped[0], *extra})[-4:]
    check_completed_like(run_dir, reference.run_dir, due)
    _a_finished_run_is_left_alone(run_dir)


def _driver_killed_mid_save(run_dir: Path) -> tuple[int, Path]:
    """The driver is SIGKILLed while it writes a checkpoint: the latest complete one stays loadable,
    and the reaper ends what Ray's agents would leave running for a minute."""
    before = latest(run_dir)
    run = Run(run_dir)

    def saving() -> bool:
        root = run_dir / "checkpoints"
        return root.is_dir() and any(p.name.startswith(".tmp-step_") for p in root.iterdir())

    run.wait_until("a checkpoint being written", saving)
    run.proc.kill()
    run.finish()
    assert run.leftovers(timeout=20) == [], run.text()
    after = latest(run_dir)
    assert after is not None
    ck.verify(after[1])
    assert before is None or after[0] >= before[0]
    return after


def _second_sigint_stops_at_once(run_dir: Path) -> set[int]:
    """Two Ctrl-C 0.2 s apart; the steps of odd (not due) checkpoints complete after them."""
    found = latest(run_dir)
    run = Run(run_dir)
    run.wait_for_step((found[0] if found else 0) + 1)
    # A one-machine run listens on the loopback interface alone: Ray's servers and workers too.
    sockets = listening(marked(run.mark))
    assert sockets, "no listening socket found"  # the GCS server's at least
    assert [s for s in sockets if s[0] not in LOOPBACK] == [], sockets
    run.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    run.proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert run.finish() == 128 + signal.SIGINT, run.text()
    assert time.monotonic() - sent < 30, run.text()  # at once, not after the step's save
    text = run.text()
    found = latest(run_dir)
    hint = "starts from step 0" if found is None else f"resumes from {found[1]} (step {found[0]})"
    assert re.search(r"stopped at once by a second SIGINT in step \d+, phase \w+; ", text), text
    assert hint in text, text
    assert "Traceback" not in text, text
    assert run.leftovers(timeout=15) == [], text
    complete = ck.complete_checkpoints(run_dir / "checkpoints")
    for _, folder in complete:
        ck.verify(folder)  # nothing half-written was marked complete
    return {step for step, _ in complete if step % 2}


def _a_finished_run_is_left_alone(run_dir: Path) -> None:
    """Nothing left to do: said before Ray starts, and the finished run's files stay as they were."""

    def files() -> dict[Path, bytes]:
        # Not the lock (its holder's pid) nor processes.json, which Run removes before it starts one.
        skip = (".lock", "processes.json")
        return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name not in skip}

    before = files()
    run = Run(run_dir)
    assert run.finish(timeout=120) == 0, run.text()
    text = run.text()
    assert f"nothing to do: {run_dir / 'checkpoints' / 'step_000008'} is at step 8 >= train.steps=8" in text
    assert "Started a local Ray instance" not in text, text
    assert files() == before


@pytest.mark.timeout(1800)
def test_tampered_checkpoints_are_skipped_for_the_previous_one(reference: Reference, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(reference.run_dir, run_dir)
    (run_dir / "summary.json").unlink()
    root = run_dir / "checkpoints"
    assert [s for s, _ in ck.complete_checkpoints(root)] == [2, 4, 6, 8]
    (root / "step_000008" / ck.MARKER).unlink()  # a copy cut short: no marker
    # 4 KB of tensor data zeroed, the file's size unchanged: only its content hash tells.
    damaged = root / "step_000006" / "actor" / "model.safetensors"
    size = damaged.stat().st_size
    with damaged.open("r+b") as f:
        f.seek(size // 2)
        f.write(bytes(4096))
    assert damaged.stat().st_size == size
    tensor = root / "step_000004" / "actor" / "model.safetensors"
    tensor.write_bytes(tensor.read_bytes()[: tensor.stat().st_size // 2])  # truncated tensor file
    driver_json = root / "step_000004" / "driver.json"
    driver_json.write_bytes(b"x" + driver_json.read_bytes()[1:])  # bad JSON, of the size written
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text()[:-3])

    run = Run(run_dir)
    assert run.finish() == 0, run.text()
    text = run.text()
    assert f"checkpoint {root / 'step_000008'} is skipped: it has no COMPLETE marker" in text
    assert f"checkpoint {root / 'step_000006'} does not load" in text
    assert "actor/model.safetensors is not the file that was written (same size, other SHA-256" in text
    assert f"checkpoint {root / 'step_000004'} does not load" in text
    assert "actor/model.safetensors has" in text
    assert "driver.json is not valid JSON" in text
    assert f"resumed from {root / 'step_000002'} (step 2)" in text
    assert "the last line is cut short" in text
    assert final_checksum(run_dir) == final_checksum(reference.run_dir)
    # Resumed after step 2, the run is the uninterrupted one: every step after the checkpoint logs the
    # same figures, and the run's summary says where it started.
    assert "differs from the checkpoint's" not in text
    resumed, full = _metrics(run_dir), _metrics(reference.run_dir)
    assert [r["step"] for r in resumed] == list(range(1, DRILL_STEPS + 1))
    for a, b in zip(resumed[2:], full[2:], strict=True):
        for key in RESUMED_SAME:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (a["step"], key)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_step"] == 3
    assert summary["weights_match"] is True


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _error_line(text: str) -> str:
    """The run's report: one line, no terminal codes; the traceback went to the run folder's log."""
    (line,) = [x for x in text.splitlines() if x.startswith("error: ")]
    assert "\x1b" not in line, line
    return line


@pytest.mark.timeout(1800)
def test_an_engine_dying_during_a_weight_update_reads_in_one_line(tmp_path: Path) -> None:
    # The engine's process exits on its third weight load: start-up's, step 1's, then step 2's.
    run = Run(tmp_path / "run", *WITHOUT_CRITIC, env={"PPO_FAULT_ENGINE_EXIT": "3"})
    expect_clean_failure(run, "phase weight_update: EngineUnavailableError: engine 'rollout-0': ")
    line = _error_line(run.text())
    assert "the run stopped at step 2, phase weight_update" in line
    assert "the engine actor died" in line
    assert "RayTaskError" not in line
    log = run.run_dir / "error.log"
    assert f"(traceback: {log})" in line
    assert "Traceback (most recent call last)" in log.read_text()


@pytest.mark.timeout(1800)
def test_a_reward_function_that_raises_is_named(tmp_path: Path) -> None:
    (tmp_path / "flaky_reward.py").write_text(
        "def score(samples):\n    raise RuntimeError('reward service unavailable (test)')\n"
    )
    run = Run(
        tmp_path / "run",
        *("--set", "rollout.reward=flaky_reward:score", *WITHOUT_CRITIC),
        env={"PYTHONPATH": str(tmp_path)},
    )
    expect_clean_failure(
        run,
        "phase generate: RewardError: reward function flaky_reward:score (rollout.reward) raised "
        "RuntimeError: reward service unavailable (test)",
    )
    _error_line(run.text())


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 3.5 MB file system (tmpfs): room for two checkpoints of the drill's model without a critic
    (about 1.4 MB each), not three."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3584k", "tmpfs", str(mount)], check=False)
    if done.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.timeout(1800)
def test_a_full_disk_is_one_line_at_the_failing_save_and_at_start_up(
    small_disk: Path, tmp_path: Path
) -> None:
    root = small_disk / "checkpoints"
    settings = ("--set", f"checkpoint.dir={root}", *WITHOUT_CRITIC)
    run = Run(tmp_path / "run", *settings)
    assert run.finish() == 1, run.text()
    line = _error_line(run.text())
    assert re.search(r"phase save: DiskFullError: no space left on device in " + re.escape(str(root)), line)
    assert re.search(r"\([\d.]+ [kM]?B free, about [\d.]+ [kM]?B needed for a checkpoint\)", line), line
    found = ck.latest_complete(root)
    assert found is not None
    assert found[0] < DRILL_STEPS
    ck.verify(found[1])
    assert f"resumes from {found[1]} (step {found[0]})" in line
    assert not list(root.glob(".tmp-step_*"))  # the failed save's files are gone: the space is back
    assert run.leftovers() == [], run.text()

    # The re-run on the same disk stops at start-up, before Ray: the next checkpoint cannot fit.
    again = Run(tmp_path / "run", *settings)
    assert again.finish(timeout=120) == 1, again.text()
    line = _error_line(again.text())
    assert "phase setup: DiskFullError: no space left on device in" in line
    assert "for the run's next checkpoint" in line
    assert "Started a local Ray instance" not in again.text()


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
    ("role", "interval", "phase", "extra"),
    [
        # no save at step 1: the weight update is what must refuse
        ("actor", 100, "weight_update", WITHOUT_CRITIC),
        ("critic", 1, "save", ()),  # the critic's weights are never sent: its save must refuse
    ],
    ids=["actor-100-weight_update", "critic-1-save"],
)
def test_non_finite_weights_reach_neither_engines_nor_checkpoints(
    tmp_path: Path, role: str, interval: int, phase: str, extra: tuple[str, ...]
) -> None:
    # The role's workers write a NaN into a weight right after step 1's optimizer step (the trainer's
    # fault-injection hook): the step's loss and gradient norm are finite, so only the check of the
    # weights themselves can stop the run before the save or the weight update.
    run = Run(
        tmp_path / "run",
        *("--set", f"checkpoint.interval={interval}", *extra),
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


@pytest.mark.timeout(900)
def test_a_local_run_listens_on_loopback_with_the_host_name_on_the_lan(reference: Reference) -> None:
    """The loopback check of the two Ctrl-C drill passes wherever the host name resolves to 127.0.0.1
    (as on many CI machines). The reference run ran with the host name resolving to this machine's LAN
    address, in a private mount namespace whose /etc/hosts says so (``unshare -m``), so that a socket
    bound by host name would listen there; its sockets were sampled all along the run."""
    if reference.lan is None:
        pytest.skip(reference.not_mapped)
    assert reference.sockets, "no listening socket found"
    outside = [s for s in reference.sockets if s[0] not in LOOPBACK]
    assert outside == [], (sorted(reference.sockets), reference.lan)
