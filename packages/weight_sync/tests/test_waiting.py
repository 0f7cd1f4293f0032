"""The one bounded polling wait (``ppo_weight_sync.waiting.wait_until``): every GPU and cross-process wait of
the package goes through it, so its three outcomes are pinned here on plain Python conditions."""

from __future__ import annotations

import threading
import time

import pytest

from ppo_weight_sync.waiting import wait_until


def test_returns_once_the_condition_holds_and_runs_check_between_polls() -> None:
    flag = threading.Event()
    checks: list[float] = []
    threading.Timer(0.05, flag.set).start()
    wait_until(flag.is_set, 5.0, lambda: "never", poll_s=0.001, check=lambda: checks.append(time.monotonic()))
    assert flag.is_set()
    assert len(checks) >= 2  # asked between polls while the condition was false


def test_a_condition_already_true_is_asked_once_and_never_checked() -> None:
    asked: list[int] = []

    def done() -> bool:
        asked.append(1)
        return True

    def check() -> None:
        raise AssertionError("check must not run when nothing is awaited")

    wait_until(done, 0.0, lambda: "never", poll_s=1.0, check=check)
    assert asked == [1]


def test_timeout_raises_the_message_made_at_the_deadline() -> None:
    progress = [0]

    def done() -> bool:
        progress[0] += 1
        return False

    start = time.monotonic()
    with pytest.raises(TimeoutError) as caught:
        wait_until(done, 0.05, lambda: f"bucket 3: got {progress[0]} polls", poll_s=0.001)
    elapsed = time.monotonic() - start
    assert 0.05 <= elapsed < 2.0
    polls = int(str(caught.value).split("got ")[1].split(" ")[0])
    assert polls == progress[0]  # the message reports the state at the deadline
    assert polls > 2


def test_check_raising_ends_the_wait_with_its_error() -> None:
    def check() -> None:
        raise ConnectionError("engine e0 died")

    with pytest.raises(ConnectionError, match="engine e0 died"):
        wait_until(lambda: False, 30.0, lambda: "never", poll_s=0.001, check=check)
