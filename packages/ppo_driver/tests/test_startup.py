"""The start-up table: disjoint parts from the command's start, ``other`` the rest, adding up to the
total; the roles' own parts as detail; summary.json and the printed table hold the same rows."""

from __future__ import annotations

import os
import time

import pytest
from rich.console import Console

from ppo_driver.metrics import startup_table
from ppo_driver.startup import StartupClock
from ppo_lifecycle.startup import process_started_at


def test_parts_and_other_add_up_to_the_total() -> None:
    clock = StartupClock(time.time() - 0.5)  # the process started half a second ago
    clock.since_origin("python start + imports")
    with clock.part("ray"):
        time.sleep(0.05)
    time.sleep(0.03)  # no part covers this: other
    with clock.part("roles"):
        time.sleep(0.02)
    clock.roles({"actor": {"imports": 3.0, "model": 0.5}, "driver": {"placement groups": 0.01}})
    table = clock.end()
    parts = [r.part for r in table.rows]
    assert parts == ["python start + imports", "ray", "roles", "other"]
    assert sum(r.seconds for r in table.rows) == pytest.approx(table.total_s, abs=1e-9)
    assert table.rows[0].seconds == pytest.approx(0.5, abs=0.05)
    assert table.rows[1].seconds >= 0.05
    assert table.other_s >= 0.03
    assert table.total_s >= 0.6
    # Each part begins after the one before it ended, measured from the command's start.
    starts = [r.at_s for r in table.rows[:3]]
    assert all(a is not None for a in starts)
    assert starts == sorted(a for a in starts if a is not None)
    assert table.rows[1].at_s is not None
    assert table.rows[1].at_s >= table.rows[0].seconds - 1e-6
    assert table.rows[-1].at_s is None  # other: no one place
    summary = table.summary()
    assert [p["part"] for p in summary["parts"]] == parts
    assert summary["roles"]["actor"] == {"imports": 3.0, "model": 0.5}
    assert summary["from_process_start"] is True


def test_the_printed_table_shows_every_row_and_the_first_step() -> None:
    clock = StartupClock()
    with clock.part("ray"):
        pass
    with clock.part("roles"):
        pass
    clock.roles({"rollout": {"cuda graphs": 0.25}})
    history = [{"time/step_s": 3.0}, {"time/step_s": 1.0}, {"time/step_s": 1.0}]
    console = Console(record=True, width=200)
    console.print(startup_table(clock.end(), history))
    text = console.export_text()
    for row in ("ray", "roles", "rollout: cuda graphs", "other", "to the first step"):
        assert row in text, row
    assert "3.00x the mean after it" in text
    assert "from the call" in text  # no origin given: measured from the clock's creation


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_process_start_is_read_from_proc() -> None:
    started = process_started_at()
    assert started is not None
    assert 0 <= time.time() - started < 24 * 3600
    assert StartupClock.since_process_start().from_process_start
