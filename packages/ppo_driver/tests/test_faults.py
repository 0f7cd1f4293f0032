"""What keeps a run's data safe: checkpoint verification and fsync'd manifests, pruning that never
drops a later run's steps, moving an older run aside, a cut metrics line, the run-folder lock, a
full disk named as such, non-finite metrics, and SIGINT/SIGTERM turned into a request."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from ppo_driver import checkpoint as ck
from ppo_driver.faults import Interrupted, NonFiniteError, RunFailed, StopSignals, check_finite, resume_hint
from ppo_driver.metrics import METRICS_FILE, CutLastLineWarning, MetricsLog, read_metrics
from ppo_driver.runlock import RunFolderBusyError, RunLock


def _write(folder: Path) -> None:
    (folder / "actor").mkdir()
    (folder / "actor" / "model.safetensors").write_bytes(b"x" * 100)
    (folder / "driver.json").write_text(json.dumps({"step": 1}))


def test_marker_lists_every_file_with_its_size_and_hash(tmp_path: Path) -> None:
    final = ck.write_checkpoint(tmp_path, 1, _write)
    marker = json.loads((final / ck.MARKER).read_text())
    driver = json.dumps({"step": 1}).encode()
    assert marker["files"] == {
        "actor/model.safetensors": {"size": 100, "sha256": hashlib.sha256(b"x" * 100).hexdigest()},
        "driver.json": {"size": len(driver), "sha256": hashlib.sha256(driver).hexdigest()},
    }
    ck.verify(final)  # whole: no error


def test_verify_finds_a_file_changed_at_the_same_size(tmp_path: Path) -> None:
    final = ck.write_checkpoint(tmp_path, 1, _write)
    tensor = final / "actor" / "model.safetensors"
    tensor.write_bytes(b"x" * 60 + b"\0" * 40)  # zeros over part of it: the size is unchanged
    with pytest.raises(ck.CheckpointError, match=r"actor/model.safetensors is not the file that was written"):
        ck.verify(final)


def test_a_marker_of_sizes_alone_is_still_read(tmp_path: Path) -> None:
    # Drivers before the hashes recorded each file's size only: such checkpoints still resume.
    final = ck.write_checkpoint(tmp_path, 1, _write)
    marker = json.loads((final / ck.MARKER).read_text())
    marker["files"] = {name: entry["size"] for name, entry in marker["files"].items()}
    (final / ck.MARKER).write_text(json.dumps(marker))
    ck.verify(final)
    (final / "actor" / "model.safetensors").write_bytes(b"x" * 40)
    with pytest.raises(ck.CheckpointError, match="has 40 bytes, 100 were written"):
        ck.verify(final)


def test_background_verify_gives_each_folder_its_verdict(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ck.write_checkpoint(tmp_path, step, _write)
    (tmp_path / "step_000003" / "driver.json").write_text(json.dumps({"step": 9}))  # same size, other bytes
    (tmp_path / "step_000002" / ck.MARKER).unlink()
    assert ck.unmarked_checkpoints(tmp_path) == [(2, tmp_path / "step_000002")]
    verified = ck.BackgroundVerify(tmp_path)
    with pytest.raises(ck.CheckpointError, match=r"driver.json is not the file that was written"):
        verified.check(tmp_path / "step_000003")
    verified.check(tmp_path / "step_000001")  # whole


def test_verify_finds_a_truncated_file_a_missing_file_and_bad_json(tmp_path: Path) -> None:
    final = ck.write_checkpoint(tmp_path, 1, _write)
    tensor = final / "actor" / "model.safetensors"
    tensor.write_bytes(b"x" * 40)
    with pytest.raises(ck.CheckpointError, match=r"actor/model.safetensors has 40 bytes, 100 were written"):
        ck.verify(final)
    tensor.unlink()
    with pytest.raises(ck.CheckpointError, match=r"actor/model.safetensors is missing"):
        ck.verify(final)
    final = ck.write_checkpoint(tmp_path, 2, _write)
    (final / "driver.json").write_text('{"step": ')  # same size class does not matter: JSON is parsed
    marker = json.loads((final / ck.MARKER).read_text())
    marker["files"]["driver.json"] = len('{"step": ')
    (final / ck.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ck.CheckpointError, match=r"driver.json is not valid JSON"):
        ck.verify(final)
    with pytest.raises(ck.CheckpointError, match=r"driver.json cannot be read"):
        ck.load_driver_state(final)
    (final / ck.MARKER).write_text("{not json")
    with pytest.raises(ck.CheckpointError, match=r"COMPLETE does not parse"):
        ck.verify(final)


def test_pruning_never_removes_a_later_step(tmp_path: Path) -> None:
    # An older run's later checkpoints left in the folder: the new run's own must survive pruning.
    for step in (50, 60):
        ck.write_checkpoint(tmp_path, step, _write)
    for step in (1, 2, 3):
        ck.write_checkpoint(tmp_path, step, _write, keep=2)
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [2, 3, 50, 60]


def test_move_aside_keeps_the_older_run(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert ck.move_aside(root) is None  # nothing there
    ck.write_checkpoint(root, 60, _write)
    aside = ck.move_aside(root)
    assert aside is not None
    assert aside.name.startswith("checkpoints.before-")
    assert not root.exists()
    assert [s for s, _ in ck.complete_checkpoints(aside)] == [60]


def test_full_disk_is_named_and_leaves_nothing(tmp_path: Path) -> None:
    def full(folder: Path) -> None:
        (folder / "part").write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    message = (
        rf"no space left on device in {tmp_path} \([\d.]+ [kMG]?B free, about 1 B needed for a checkpoint\) "
        "while saving the step-3 checkpoint; free space there"
    )
    with pytest.raises(ck.DiskFullError, match=message) as info:
        ck.write_checkpoint(tmp_path, 3, full)
    assert info.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []
    # torch's writer, relayed as text by a Ray worker, says "unexpected pos".
    assert ck.is_disk_full(RuntimeError("PytorchStreamWriter failed writing file data/0: unexpected pos 64"))
    assert not ck.is_disk_full(RuntimeError("something else"))


def test_cut_last_metrics_line_is_dropped_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x": 2.0}\n{"step": 3, "x"')
    with pytest.warns(CutLastLineWarning, match="the last line is cut short"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with pytest.warns(CutLastLineWarning):
        log = MetricsLog(tmp_path, tensorboard=False, start_step=2)
    log.log(3, {"x": 3.0})
    log.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # whole again: no warning
        assert [(r["step"], r["x"]) for r in read_metrics(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_a_bad_line_before_the_last_is_an_error(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"line 2: not a JSON object"):
        read_metrics(tmp_path)


def test_second_run_in_the_same_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from ppo_driver.runlock import RunLock\n"
            "with RunLock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusyError, match=rf"in use by pid {holder.pid} on "):
            RunLock(tmp_path).__enter__()
    finally:
        holder.kill()  # a SIGKILLed holder leaves no stale lock behind
        holder.wait(timeout=30)
    with RunLock(tmp_path):
        pass


def test_non_finite_loss_or_gradient_is_named_with_role_and_step() -> None:
    check_finite("actor", 3, {"loss": 0.5, "grad_norm": 1.0, "clipfrac": float("nan")})
    with pytest.raises(NonFiniteError, match=r"the critic reported non-finite values at step 7 \(loss=nan\)"):
        check_finite("critic", 7, {"loss": float("nan"), "values_mean": 0.1})
    with pytest.raises(NonFiniteError, match=r"actor.*step 2 \(grad_norm=inf\).*neither saved nor sent"):
        check_finite("actor", 2, {"loss": 0.1, "grad_norm": float("inf")})


def test_failure_report_names_step_phase_and_resume_point(tmp_path: Path) -> None:
    error = RunFailed(
        4,
        "actor_train",
        RuntimeError("actor rank 1: train(step=4): the worker process died"),
        resume_hint((2, tmp_path / "step_000002")),
    )
    text = str(error)
    assert "step 4, phase actor_train" in text
    assert "actor rank 1" in text
    assert f"resumes from {tmp_path / 'step_000002'} (step 2)" in text
    assert "starts from step 0" in resume_hint(None)
    stopped = Interrupted(signal.SIGTERM, 5, resume_hint((5, tmp_path)))
    assert str(stopped).startswith("stopped by SIGTERM after step 5; a re-run")


def test_one_line_reports_the_workers_own_error_without_rays_wrapping() -> None:
    from ray.exceptions import RayTaskError

    from ppo_driver.faults import one_line
    from ppo_weight_sync import EngineUnavailableError

    cause = EngineUnavailableError(
        "rollout-0", "update_weights_from_distributed", "the engine actor died (x)"
    )
    traceback_text = 'Traceback (most recent call last):\n  File "w.py", line 1\nEngineUnavailableError: ...'
    wrapped = RayTaskError("\x1b[36mray::TrainWorker.update_weights()\x1b[39m", traceback_text, cause)
    error = wrapped.as_instanceof_cause()
    assert "\n" in str(error)  # what the report used to print: lines, and colour codes
    assert "\x1b" in str(error)
    line = one_line(error)
    assert line == (
        "EngineUnavailableError: engine 'rollout-0': update_weights_from_distributed failed: "
        "the engine actor died (x)"
    )
    assert one_line(OSError(errno.ENOSPC, "No space left on device", "/data/x")) == (
        "OSError: No space left on device: /data/x"
    )
    assert one_line(RuntimeError("first\n  second\n")) == "RuntimeError: first second"
    report = str(RunFailed(3, "weight_update", error, resume_hint(None)))
    assert "\n" not in report
    assert report.startswith("the run stopped at step 3, phase weight_update: EngineUnavailableError: ")


def test_stop_signals_turn_the_first_signal_into_a_request() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # asked twice: stop now
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_signal_is_seen_while_the_main_thread_waits_in_c() -> None:
    # Both signals arrive while the main thread hashes (a C call that runs no Python handler): Python
    # would run its handler once, after; the wakeup-fd thread counts two and stops at once.
    import hashlib

    seconds: list[int] = []
    second = threading.Event()

    def on_second(signum: int) -> None:
        seconds.append(signum)
        second.set()

    def send_two() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with StopSignals(on_second=on_second) as signals:
        sender = threading.Thread(target=send_two)
        data = b"x" * (1 << 29)
        sender.start()
        hashlib.sha256(data).digest()  # a fraction of a second or more, in C
        assert second.wait(30), "the second SIGINT was not seen"
        sender.join()
        assert signals.requested == signal.SIGINT
    assert seconds == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is before


def test_starting_over_moves_the_earlier_run_aside(tmp_path: Path) -> None:
    from rich.console import Console

    from ppo_driver.resume import start_over as _start_over

    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    for step in (30, 60):
        ck.write_checkpoint(root, step, _write)
    (run_dir / METRICS_FILE).write_text('{"step": 60}\n')
    console = Console(record=True, width=300)
    _start_over(run_dir, root, console)
    said = console.export_text()
    assert "moved the earlier run's checkpoints from" in said
    assert "moved the earlier run's metrics to" in said
    assert not root.exists()
    assert not (run_dir / METRICS_FILE).exists()
    (aside,) = run_dir.glob("checkpoints.before-*")
    assert [s for s, _ in ck.complete_checkpoints(aside)] == [30, 60]
    (old_metrics,) = run_dir.glob("metrics.before-*.jsonl")
    assert old_metrics.read_text() == '{"step": 60}\n'
    # The new run's checkpoints are its own: nothing of the earlier run is pruned into or resumed from.
    ck.write_checkpoint(root, 2, _write, keep=1)
    assert ck.latest_complete(root) == (2, root / "step_000002")


def test_the_first_signal_is_echoed(capfd: pytest.CaptureFixture[str]) -> None:
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert signals.requested == signal.SIGINT
    assert (
        capfd.readouterr().err == "SIGINT: stopping after this step (saved there); Ctrl-C again to stop now\n"
    )
    seen = threading.Event()
    with StopSignals(on_second=lambda signum: None) as signals:  # the counting thread's path
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):
            if "SIGTERM again" in (text := capfd.readouterr().err):
                seen.set()
                break
            time.sleep(0.05)
    assert seen.is_set()
    assert text == "SIGTERM: stopping after this step (saved there); SIGTERM again to stop now\n"
