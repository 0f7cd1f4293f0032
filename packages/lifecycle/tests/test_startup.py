"""A role's start-up from its workers' reports: the slowest worker's time for each part."""

from __future__ import annotations

import pytest

from ppo_lifecycle.startup import INIT_AT, PROCESS_STARTED_AT, SetupTimer, role_startup


def test_a_roles_start_up_is_its_slowest_workers_part_by_part() -> None:
    requested = 100.0
    reports = [
        # a process started for it 0.5 s after the request, imports until 4.0, a 2 s model load
        {PROCESS_STARTED_AT: 100.5, INIT_AT: 104.0, "model_s": 2.0, "pinned_buffers_s": 0.1},
        # a process Ray had started before the request: no process start, imports from the request
        {PROCESS_STARTED_AT: 90.0, INIT_AT: 105.0, "model_s": 1.0, "pinned_buffers_s": 0.3},
    ]
    assert role_startup(requested, reports) == pytest.approx(
        {"process start": 0.5, "imports": 5.0, "model": 2.0, "pinned buffers": 0.3}
    )
    # Without the process's start (not Linux), the two are one part.
    assert role_startup(requested, [{INIT_AT: 103.0, "model_s": 1.0}]) == pytest.approx(
        {"process start + imports": 3.0, "model": 1.0}
    )


def test_a_setup_timer_reports_its_parts_and_epochs() -> None:
    timer = SetupTimer()
    with timer.part("model"):
        pass
    timer.add("model", 1.0)
    report = timer.report()
    assert report[INIT_AT] == timer.init_at
    assert report["model_s"] >= 1.0
    assert set(report) <= {INIT_AT, PROCESS_STARTED_AT, "model_s"}
