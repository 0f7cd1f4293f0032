"""CheckpointSaver: roles saved in the background once they sleep, COMPLETE only after every file,
foreground saves one role at a time, a failed writer leaves the previous checkpoint.

The train groups here write real files from real threads, gated by events so the test decides when
each writer finishes; the real groups run under tests-e2e (test_faults, test_default_run)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, cast

import pytest

from ppo_driver import build
from ppo_driver import checkpoint as ck
from ppo_driver.config import load_config
from ppo_driver.phases import PhaseTracker
from ppo_driver.roles import BackgroundSaving, Roles
from ppo_driver.saving import CheckpointSaver


class Role:
    """Records sleeps and wakes into a shared log, and whether it is resident."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.resident = True

    def sleep(self) -> None:
        self.resident = False
        self.log.append(f"{self.name}:sleep")

    def wake_up(self) -> None:
        self.resident = True
        self.log.append(f"{self.name}:wake")

    offload, onload = sleep, wake_up

    def pop_metrics(self) -> dict[str, float]:  # overlapped transitions pop them in their thread
        return {}

    def disconnect_engines(self) -> None:  # the actor's, before an overlapped sleep
        self.log.append(f"{self.name}:disconnect")


class ForegroundGroup(Role):
    """A group that saves only while resident (a megatron role, or one without host copies)."""

    def __init__(self, name: str, log: list[str], resident_log: list[tuple[str, ...]], everyone: list[Role]):
        super().__init__(name, log)
        self.resident_log, self.everyone = resident_log, everyone

    def save(self, folder: Path) -> None:
        assert self.resident, f"{self.name} saved while asleep"
        self.resident_log.append(tuple(r.name for r in self.everyone if r.resident and r.name != "rollout"))
        folder.mkdir(parents=True)
        (folder / "model.bin").write_bytes(self.name.encode())


class BackgroundGroup(Role):
    """A group whose background writer (a thread) finishes when the test sets ``gate``."""

    saves_asleep = True

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        super().__init__(name, log)
        self.gate = threading.Event()
        self.fail = fail
        self.started: list[Path] = []
        self._thread: threading.Thread | None = None
        self._folder: Path | None = None
        self._error: BaseException | None = None
        self.moving = False
        self.asked = 0  # save_done calls
        self.wake_gate = threading.Event()  # a wake waits for it (set: wakes run through)
        self.wake_gate.set()

    def wake_up(self) -> None:
        self.moving = True
        try:
            if not self.wake_gate.wait(30):
                raise TimeoutError("wake gate")
            super().wake_up()
        finally:
            self.moving = False

    def save(self, folder: Path) -> None:
        raise AssertionError("a background group must not be saved in the foreground")

    def save_async(self, folder: Path) -> dict[str, float]:
        assert not self.resident, f"{self.name}: save_async while resident"
        self.started.append(folder)
        self._folder = folder
        staging = folder.with_name(folder.name + ".partial")

        def write() -> None:
            try:
                staging.mkdir(parents=True)
                (staging / "model.bin").write_bytes(b"first half ")
                if not self.gate.wait(30):
                    raise TimeoutError("gate")
                if self.fail:
                    raise OSError("the writer failed")
                with (staging / "model.bin").open("ab") as f:
                    f.write(b"second half")
            except BaseException as exc:
                self._error = exc

        self._thread = threading.Thread(target=write)
        self._thread.start()
        return {}

    def save_done(self) -> bool:
        assert not self.moving, f"{self.name}: asked about its save while a transition runs"
        self.asked += 1
        return self._thread is None or not self._thread.is_alive()

    def save_wait(self) -> float:
        assert self._thread is not None
        assert self._folder is not None
        self._thread.join(30)
        if self._error is not None:
            raise RuntimeError(f"{self.name} background save failed: {self._error}")
        self._folder.with_name(self._folder.name + ".partial").rename(self._folder)
        return 0.5


def _saver(
    tmp_path: Path, actor: Any, critic: Any, log: list[str], *, overlap: bool = False
) -> tuple[CheckpointSaver, PhaseTracker]:
    config = load_config(None, [])  # colocated, shared critic, offload on
    roles = Roles(rollout=cast(Any, Role("rollout", log)), actor=actor, critic=critic)
    phases = PhaseTracker(build.offload_plan(config), roles, overlap=overlap, timeout_s=30)
    state = ck.DriverState(step=0, rollout={"position": 1}, extra={})
    saver = CheckpointSaver(tmp_path, roles, phases, lambda step: state, keep=None)
    return saver, phases


def test_complete_is_written_only_after_every_file_of_every_role(tmp_path: Path) -> None:
    log: list[str] = []
    actor, critic = BackgroundGroup("actor", log), BackgroundGroup("critic", log)
    assert isinstance(actor, BackgroundSaving)
    saver, phases = _saver(tmp_path, actor, critic, log)
    ck.write_checkpoint(tmp_path, 2, lambda f: (f / "x").write_text("previous"))
    phases.enter("critic_train")
    phases.enter("actor_train")
    log.clear()

    saver.start(4)  # the critic sleeps already: its writer starts; the actor trains, its waits
    assert log == []  # no role woke or slept for the save
    assert critic.started == [tmp_path / ".tmp-step_000004" / "critic"]
    assert actor.started == []
    assert (tmp_path / ".tmp-step_000004" / "driver.json").is_file()
    phases.enter("weight_update")
    saver.launch_ready()
    assert actor.started == []  # still resident: sending the weights
    phases.enter("generate")
    saver.launch_ready()
    assert actor.started == [tmp_path / ".tmp-step_000004" / "actor"]

    assert saver.poll() is None  # both writers are still writing
    critic.gate.set()
    critic._thread.join(10)  # type: ignore[union-attr]
    assert saver.poll() is None  # the actor's is not done
    assert ck.latest_complete(tmp_path) == (2, tmp_path / "step_000002")
    assert not (tmp_path / ".tmp-step_000004" / ck.MARKER).exists()

    actor.gate.set()
    final = saver.wait()
    assert final == tmp_path / "step_000004"
    marker = json.loads((final / ck.MARKER).read_text())
    assert marker["files"]["actor/model.bin"]["size"] == len(b"first half second half")
    assert marker["files"]["critic/model.bin"]["size"] == len(b"first half second half")
    ck.verify(final)
    metrics = saver.pop_metrics()
    assert metrics["time/save_background"] == 0.5
    assert metrics["time/save_blocking"] > 0
    assert saver.pop_metrics() == {}


def test_a_failed_writer_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    log: list[str] = []
    actor, critic = BackgroundGroup("actor", log, fail=True), BackgroundGroup("critic", log)
    saver, phases = _saver(tmp_path, actor, critic, log)
    ck.write_checkpoint(tmp_path, 2, lambda f: (f / "x").write_text("previous"))
    phases.enter("actor_train")
    saver.start(4)
    phases.enter("generate")
    saver.launch_ready()
    actor.gate.set()
    critic.gate.set()
    with pytest.raises(RuntimeError, match="actor background save failed: the writer failed"):
        saver.wait()
    assert ck.latest_complete(tmp_path) == (2, tmp_path / "step_000002")
    assert not (tmp_path / ".tmp-step_000004").exists()
    assert not saver.pending


def test_roles_that_save_only_resident_are_saved_one_at_a_time(tmp_path: Path) -> None:
    log: list[str] = []
    resident_log: list[tuple[str, ...]] = []
    everyone: list[Role] = []
    actor = ForegroundGroup("actor", log, resident_log, everyone)
    critic = ForegroundGroup("critic", log, resident_log, everyone)
    everyone += [actor, critic]
    saver, phases = _saver(tmp_path, actor, critic, log)
    phases.enter("actor_train")
    assert (actor.resident, critic.resident) == (True, False)
    log.clear()
    saver.start(6)
    assert resident_log == [("actor",), ("critic",)]  # never both
    assert log == ["actor:sleep", "critic:wake", "critic:sleep", "actor:wake"]
    assert (actor.resident, critic.resident) == (True, False)  # the phase's residency is back
    assert saver.poll() == tmp_path / "step_000006"  # nothing in the background: complete at once
    assert (tmp_path / "step_000006" / "critic" / "model.bin").read_bytes() == b"critic"


def test_unfinished_saves_of_a_dead_run_are_removed(tmp_path: Path) -> None:
    ck.write_checkpoint(tmp_path, 2, lambda f: (f / "x").write_text("done"))
    (tmp_path / ".tmp-step_000004" / "actor.partial").mkdir(parents=True)
    assert ck.remove_unfinished(tmp_path) == [tmp_path / ".tmp-step_000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]


def test_an_overlapped_loop_completes_a_checkpoint_without_asking_a_moving_role(tmp_path: Path) -> None:
    """The loop's order, overlapped: a save at step 4, then step 5's critic woken ahead at the end of
    the step and generating. The checkpoint completes once the writers are done and no role moves,
    within the next step, and no role is asked while a transition runs (it would answer after it)."""
    log: list[str] = []
    actor, critic = BackgroundGroup("actor", log), BackgroundGroup("critic", log)
    saver, phases = _saver(tmp_path, actor, critic, log, overlap=True)
    phases.enter("critic_train", then="actor_train")
    phases.enter("actor_train", then="weight_update")
    saver.start(4)
    phases.enter("weight_update")
    phases.enter("generate")  # a step that saved wakes no role ahead: its writers start now
    saver.launch_ready()
    assert (actor.started, critic.started) == (
        [tmp_path / ".tmp-step_000004" / "actor"],
        [tmp_path / ".tmp-step_000004" / "critic"],
    )
    assert saver.poll() is None  # end of step 4: writing

    actor.gate.set()
    critic.gate.set()
    for writer in (actor._thread, critic._thread):
        assert writer is not None
        writer.join(10)  # both writers done: only a moving role can hold the checkpoint back now
    critic.wake_gate.clear()
    phases.enter("generate", then="critic_train")  # the end of a step: the critic wakes ahead
    assert phases.busy("critic")
    asked = critic.asked
    assert saver.poll() is None  # the actor's writer is done, the critic is not asked while it wakes
    assert critic.asked == asked
    assert actor.asked >= 1
    assert ck.latest_complete(tmp_path) is None

    critic.wake_gate.set()  # it ends while the engines generate step 5
    phases.settle("critic")
    final = saver.poll()  # the loop's poll after generating
    assert final == tmp_path / "step_000004"
    assert ck.latest_complete(tmp_path) == (4, final)
    assert (final / "critic" / "model.bin").read_bytes() == b"first half second half"
    assert not saver.pending
    assert saver.pop_metrics()["time/save_background"] == 0.5
