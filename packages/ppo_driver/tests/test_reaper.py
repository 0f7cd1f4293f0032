"""The reaper: a driver killed with SIGKILL leaves none of the processes it started after the reaper."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_driver import reaper

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc (Linux)")

# A stand-in driver: a child started before the reaper (spared), then the reaper, then a child that
# starts a grandchild of its own (as the raylet starts its agents); it prints their pids and waits.
DRIVER = """
import json, subprocess, sys, time
from ppo_driver import reaper
before = subprocess.Popen(["sleep", "300"])
watchdog = reaper.start()
after = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
grandchild = int(after.stdout.readline())
print(json.dumps({"before": before.pid, "after": after.pid, "grandchild": grandchild}), flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def test_a_killed_driver_leaves_nothing_it_started_after_the_reaper() -> None:
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None
        pids = json.loads(driver.stdout.readline())
        time.sleep(4 * reaper.INTERVAL_S)  # the reaper has recorded the new processes
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        assert _wait_gone([pids["after"], pids["grandchild"]], timeout_s=20) == []
        assert _alive(pids["before"])  # not the run's: spared
    finally:
        driver.kill()
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_descendants_finds_grandchildren_with_their_start_times() -> None:
    child = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        found = reaper.descendants(os.getpid())
        assert {child.pid, grandchild} <= set(found)
        assert reaper.kill_all({grandchild: found[grandchild] + 1}) == []  # another start time: spared
        assert reaper.kill_all({grandchild: found[grandchild]}) == [grandchild]
        assert _wait_gone([grandchild], timeout_s=10) == []
    finally:
        child.kill()
        child.wait()
