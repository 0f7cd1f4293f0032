from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import FlakyBackend, FlakyGroups, snapshot, state_tensors, tiny_model, track_all, train_steps
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppo_lifecycle.lifecycle import Lifecycle, State
from ppo_lifecycle.memory import HostMemoryBackend
from ppo_lifecycle.process_groups import ReloadableProcessGroups, group_timeout

TIMEOUT = timedelta(seconds=91)
SLEEP_STEPS = ["sleep/hook:disconnect", "sleep/hook:flush", "sleep/destroy_groups", "sleep/release"]
WAKE_STEPS = ["wake/restore", "wake/reload_groups", "wake/hook:reconnect", "wake/hook:warm"]


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReloadableProcessGroups]:
    pgs = ReloadableProcessGroups()
    store = tmp_path_factory.mktemp("store") / "file"
    pgs.init_default("gloo", f"file://{store}", 1, 0, TIMEOUT)
    pgs.new_group(ranks=[0], timeout=timedelta(seconds=17))
    yield pgs
    pgs.destroy()


class World:
    """A trained tiny model, a real host backend, real gloo groups, hooks that count calls."""

    def __init__(self, groups: ReloadableProcessGroups, fail_on: str | None = None) -> None:
        groups.reload()
        self.model, self.opt = tiny_model()
        train_steps(self.model, self.opt, 1, seed=3)
        self.memory = FlakyBackend(HostMemoryBackend())
        track_all(self.memory, self.model, self.opt)
        self.groups = FlakyGroups(groups)
        self.calls: dict[str, int] = {}
        self.steps: list[str] = []
        self.fail_on = fail_on
        self.lc = Lifecycle(self.memory, self.groups, name="test", observer=self._observe)
        for name in ("disconnect", "flush"):
            self.lc.add_pre_sleep_hook(name, self._hook(name))
        for name in ("reconnect", "warm"):
            self.lc.add_post_wake_hook(name, self._hook(name))
        self.original = snapshot(self.model, self.opt)
        self.total = sum(
            t.untyped_storage().nbytes() for t in state_tensors(self.model, self.opt) if t is not None
        )

    def _observe(self, step: str) -> None:
        self.steps.append(step)
        if step == self.fail_on:
            self.fail_on = None  # fail once
            raise RuntimeError(f"injected failure at {step}")

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def fn() -> None:
            self.calls[name] = self.calls.get(name, 0) + 1

        return fn

    def released(self) -> bool:
        return all(
            t.untyped_storage().nbytes() == 0 for t in state_tensors(self.model, self.opt) if t is not None
        )

    def check_resident(self) -> None:
        assert self.lc.state is State.RESIDENT
        assert not self.lc.is_asleep
        assert snapshot(self.model, self.opt) == self.original
        assert self.groups.is_alive
        assert dist.is_initialized()
        assert group_timeout(dist.group.WORLD) == TIMEOUT  # type: ignore[arg-type]

    def check_asleep(self) -> None:
        assert self.lc.state is State.ASLEEP
        assert self.lc.is_asleep
        assert self.released()
        assert not self.groups.is_alive
        assert not dist.is_initialized()


def test_one_cycle_runs_the_steps_in_order_and_records_metrics(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    w.lc.sleep()
    w.check_asleep()
    w.lc.wake_up()
    w.check_resident()
    assert w.steps == SLEEP_STEPS + WAKE_STEPS
    assert w.calls == {"disconnect": 1, "flush": 1, "reconnect": 1, "warm": 1}
    m = w.lc.pop_metrics()
    assert m["sleep/bytes"] == w.total
    assert m["wake/bytes"] == w.total
    assert m["sleep/count"] == 1
    assert m["wake/count"] == 1
    assert m["sleep/seconds"] > 0
    assert m["wake/seconds"] > 0
    assert m["sleep/gb_per_s"] > 0
    assert w.lc.pop_metrics() == {}


def test_doubled_calls_are_no_ops(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    w.lc.wake_up()  # resident: only makes sure the groups exist
    assert w.steps == []
    assert w.calls == {}
    w.lc.sleep()
    w.lc.sleep()
    w.check_asleep()
    assert w.calls == {"disconnect": 1, "flush": 1}
    w.lc.wake_up()
    w.lc.wake_up()
    w.check_resident()
    assert w.calls == {"disconnect": 1, "flush": 1, "reconnect": 1, "warm": 1}
    assert w.memory.released_bytes == w.total
    assert w.memory.restored_bytes == w.total
    assert w.groups.destroys == 1
    assert w.groups.reloads == 1


def test_wake_up_while_resident_rebuilds_missing_groups(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    groups.destroy()
    w.lc.wake_up()
    assert groups.is_alive
    assert w.calls == {}


@pytest.mark.parametrize("step", SLEEP_STEPS)
def test_sleep_failure_at_each_step_then_retry(groups: ReloadableProcessGroups, step: str) -> None:
    w = World(groups, fail_on=step)
    with pytest.raises(RuntimeError, match=f"injected failure at {step}"):
        w.lc.sleep()
    assert w.lc.state is State.SLEEPING
    assert w.lc.is_asleep
    w.lc.sleep()
    w.check_asleep()
    assert w.calls == {"disconnect": 1, "flush": 1}  # no hook ran twice
    assert w.memory.released_bytes == w.total  # nothing released twice
    assert w.groups.destroys == 1
    w.lc.wake_up()
    w.check_resident()


@pytest.mark.parametrize("step", WAKE_STEPS)
def test_wake_failure_at_each_step_then_retry(groups: ReloadableProcessGroups, step: str) -> None:
    w = World(groups, fail_on=step)
    w.lc.sleep()
    with pytest.raises(RuntimeError, match=f"injected failure at {step}"):
        w.lc.wake_up()
    assert w.lc.state is State.WAKING
    assert w.lc.is_asleep
    w.lc.wake_up()
    w.check_resident()
    assert w.calls == {"disconnect": 1, "flush": 1, "reconnect": 1, "warm": 1}
    assert w.memory.restored_bytes == w.total  # nothing restored twice
    assert w.groups.reloads == 1


def test_failures_inside_the_backend_and_groups_then_retry(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    w.groups.fail_destroy = 1
    w.memory.fail_release = 1
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected"):
            w.lc.sleep()
    w.lc.sleep()
    w.check_asleep()
    w.memory.fail_restore = 1
    w.groups.fail_reload = 1
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected"):
            w.lc.wake_up()
    w.lc.wake_up()
    w.check_resident()
    assert w.memory.released_bytes == w.total
    assert w.memory.restored_bytes == w.total
    assert w.calls == {"disconnect": 1, "flush": 1, "reconnect": 1, "warm": 1}


def test_a_failing_hook_registered_by_the_caller(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    attempts = {"n": 0}

    def flaky_disconnect() -> None:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise ConnectionError("engine unreachable")

    w.lc.add_pre_sleep_hook("engines", flaky_disconnect)
    with pytest.raises(ConnectionError):
        w.lc.sleep()
    w.lc.sleep()
    w.check_asleep()
    assert attempts["n"] == 2
    assert w.calls["disconnect"] == 1
    with pytest.raises(ValueError, match="already registered"):
        w.lc.add_pre_sleep_hook("engines", flaky_disconnect)


def test_other_call_after_a_half_done_transition(groups: ReloadableProcessGroups) -> None:
    w = World(groups, fail_on="sleep/release")
    with pytest.raises(RuntimeError):
        w.lc.sleep()
    w.lc.wake_up()  # give up sleeping: restore whatever was released, rebuild groups
    w.check_resident()
    w.fail_on = "wake/reload_groups"
    w.lc.sleep()
    with pytest.raises(RuntimeError):
        w.lc.wake_up()
    w.lc.sleep()  # give up waking: release again
    w.check_asleep()
    w.lc.wake_up()
    w.check_resident()
    assert w.memory.released_bytes == w.memory.restored_bytes


OPS = st.lists(
    st.tuples(st.sampled_from(["sleep", "wake"]), st.sampled_from([None, *SLEEP_STEPS, *WAKE_STEPS])),
    max_size=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_any_sequence_of_calls_and_failures_ends_bit_identical(groups: ReloadableProcessGroups, ops) -> None:  # type: ignore[no-untyped-def]
    w = World(groups)
    errors: list[str] = []
    for op, fail in ops:
        w.fail_on = fail
        try:
            w.lc.sleep() if op == "sleep" else w.lc.wake_up()
        except RuntimeError as exc:
            errors.append(str(exc))
        if w.lc.state is State.ASLEEP:
            assert w.released()
            assert not dist.is_initialized()
    assert all(e.startswith("injected failure at") for e in errors)
    w.fail_on = None
    w.lc.wake_up()
    w.check_resident()
    assert w.memory.released_bytes == w.memory.restored_bytes


def test_n_cycles_are_bit_identical_and_training_continues_the_same(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    for _ in range(5):
        w.lc.sleep()
        w.lc.wake_up()
    w.check_resident()
    cycled = train_steps(w.model, w.opt, 3, seed=9)
    w.lc.sleep()
    w.lc.wake_up()
    cycled += train_steps(w.model, w.opt, 3, seed=10)

    model, opt = tiny_model()
    train_steps(model, opt, 1, seed=3)
    plain = train_steps(model, opt, 3, seed=9) + train_steps(model, opt, 3, seed=10)
    assert cycled == plain
    assert snapshot(w.model, w.opt) == snapshot(model, opt)


def test_concurrent_calls_are_serialized(groups: ReloadableProcessGroups) -> None:
    w = World(groups)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(op: str) -> None:
        try:
            barrier.wait(timeout=30)
            for _ in range(5):
                w.lc.sleep() if op == "sleep" else w.lc.wake_up()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(op,)) for op in ("sleep", "wake", "sleep", "wake")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    w.lc.wake_up()
    w.check_resident()
    assert w.memory.released_bytes == w.memory.restored_bytes
    assert w.calls.get("disconnect", 0) == w.calls.get("reconnect", 0)


def test_lifecycle_without_groups_and_with_tags(tmp_path: Path) -> None:
    a, b = torch.ones(10), torch.ones(20)
    memory = HostMemoryBackend()
    memory.track("a", lambda: [a])
    memory.track("b", lambda: [b])
    lc = Lifecycle(memory, tags=["a"])
    lc.sleep()
    assert a.untyped_storage().nbytes() == 0
    assert b.untyped_storage().nbytes() == 80
    lc.wake_up()
    assert torch.equal(a, torch.ones(10))
    with pytest.raises(ValueError, match="non-empty"):
        lc.add_post_wake_hook("", lambda: None)


def test_every_step_is_timed_in_the_metrics(groups: ReloadableProcessGroups) -> None:
    import time

    w = World(groups)
    w.lc.add_pre_sleep_hook("slow", lambda: time.sleep(0.05))
    w.lc.add_post_wake_hook("slower", lambda: time.sleep(0.08))
    w.lc.sleep()
    w.lc.wake_up()
    m = w.lc.pop_metrics()
    steps = {k: v for k, v in m.items() if "/step/" in k}
    expected = [*SLEEP_STEPS, "sleep/hook:slow", *WAKE_STEPS, "wake/hook:slower"]
    assert sorted(steps) == sorted(s.replace("/", "/step/", 1) for s in expected)
    assert all(v >= 0 for v in steps.values())
    assert 0.05 <= steps["sleep/step/hook:slow"] < 0.05 + 0.5
    assert 0.08 <= steps["wake/step/hook:slower"] < 0.08 + 0.5
    for kind in ("sleep", "wake"):
        parts = sum(v for k, v in steps.items() if k.startswith(f"{kind}/"))
        assert parts <= m[f"{kind}/seconds"]  # the steps are inside the transition
        assert parts > 0.8 * m[f"{kind}/seconds"] - 0.02  # and account for (nearly) all of it


def test_a_step_that_raises_counts_its_time_and_the_retry_adds_up(groups: ReloadableProcessGroups) -> None:
    import time

    w = World(groups)
    failures = [RuntimeError("engines unreachable")]

    def flaky() -> None:
        time.sleep(0.03)
        if failures:
            raise failures.pop()

    w.lc.add_pre_sleep_hook("flaky", flaky)
    with pytest.raises(RuntimeError, match="engines unreachable"):
        w.lc.sleep()
    w.lc.sleep()
    m = w.lc.pop_metrics()
    assert 0.06 <= m["sleep/step/hook:flaky"] < 0.06 + 0.5  # both attempts
    assert m["sleep/step/hook:disconnect"] >= 0  # ran once, in the first attempt
    assert w.calls["disconnect"] == 1
    w.lc.wake_up()
