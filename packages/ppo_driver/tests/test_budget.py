"""The step budget: parts timed inside others are carved out, the parts and ``other`` add up to the
step, and the table, the summary and the plot show them (real clocks, real files)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from PIL import Image

from ppo_driver.budget import (
    StepBytes,
    StepClock,
    budget_rows,
    markdown_table,
    phase_tflops,
    step_metrics,
    summary,
)
from ppo_driver.metrics import MetricsLog, budget_table
from ppo_driver.plot import plot_run

ROLES = ("actor", "critic", "engines")


def _step(asleep: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """One step: critic_train holding an engines' offload and a worker's put, then an actor sleep."""
    clock = StepClock()
    with clock.span("critic_train"):
        with clock.span("engines/sleep"):
            time.sleep(asleep["engines/sleep"])
        time.sleep(asleep["critic_train"])
        clock.carve("handoff", asleep["handoff"])  # measured by the worker, inside the call
    with clock.span("actor/sleep"):
        time.sleep(asleep["actor/sleep"])
    time.sleep(asleep["other"])
    moved = StepBytes({"engines/sleep": 100.0, "actor/sleep": 50.0}, handoff=7.0, weight_update=3.0)
    return step_metrics(clock, ROLES, moved), clock.totals()


def test_nested_parts_are_carved_out_and_everything_adds_up() -> None:
    asked = {"engines/sleep": 0.03, "critic_train": 0.05, "handoff": 0.01, "actor/sleep": 0.02, "other": 0.02}
    m, totals = _step(asked)
    # A loaded machine oversleeps, never undersleeps: lower bounds, and exact relations between parts.
    assert m["time/engines/sleep_s"] >= 0.03
    assert m["time/handoff_s"] == 0.01
    assert m["time/critic_train_s"] >= 0.05 - 0.01  # its wall time less the offload and the carved handoff
    assert m["time/critic_train_s"] + m["time/engines/sleep_s"] + 0.01 == pytest.approx(
        totals["critic_train"], abs=1e-12
    )
    assert m["time/other_s"] >= 0.02
    parts = [k for k in m if k.startswith("time/") and k.endswith("_s") and k != "time/step_s"]
    assert sum(m[k] for k in parts) == pytest.approx(m["time/step_s"], abs=1e-9)
    overhead = m["time/engines/sleep_s"] + m["time/actor/sleep_s"] + m["time/handoff_s"]
    assert m["time/overhead_fraction"] == pytest.approx(overhead / m["time/step_s"])
    assert m["bytes/engines/sleep"] == 100.0
    assert m["bytes/critic/wake"] == 0.0  # every key, 0 where nothing moved
    assert (m["bytes/handoff"], m["bytes/weight_update"]) == (7.0, 3.0)
    for key in (
        "time/generate_s",
        "time/save_s",
        "time/eval_s",
        "time/critic/wake_s",
        "time/weight_update_s",
    ):
        assert m[key] == 0.0, key


def test_a_weights_check_is_its_own_part_and_not_in_the_overhead_fraction() -> None:
    clock = StepClock()
    with clock.span("weight_update"):
        time.sleep(0.01)
    with clock.span("check_weights"):
        time.sleep(0.02)
    m = step_metrics(clock, ROLES, StepBytes({}))
    assert m["time/check_weights_s"] >= 0.02
    method_s = m["time/step_s"] - m["time/check_weights_s"]
    assert m["time/overhead_fraction"] == pytest.approx(m["time/weight_update_s"] / method_s)


def test_a_part_outside_the_budget_is_refused() -> None:
    clock = StepClock()
    with clock.span("reference/sleep"):
        pass
    with pytest.raises(ValueError, match=r"reference/sleep.*not in the budget"):
        step_metrics(clock, ROLES, StepBytes({}))


def _history() -> list[dict[str, float]]:
    # A slow first step (sleep 1.0 s), then two steps of 0.2 s sleep; step times 2.0, 1.0, 1.0.
    out = []
    for step, (sleep_s, other) in enumerate(((1.0, 0.5), (0.2, 0.3), (0.2, 0.3)), start=1):
        out.append(
            {
                "step": step,
                "time/generate_s": 0.5,
                "time/actor/sleep_s": sleep_s,
                "time/critic/sleep_s": 0.0,
                "time/other_s": other,
                "time/step_s": 0.5 + sleep_s + other,
                "time/overhead_fraction": sleep_s / (0.5 + sleep_s + other),
                "time/unrelated_s": 9.0,  # not a budget part: never a row, never in the sum
                "bytes/actor/sleep": 2e9,
            }
        )
    return out


def test_rows_first_step_apart_mean_after_it_and_unused_parts_left_out() -> None:
    rows = {r.part: r for r in budget_rows(_history())}
    assert list(rows) == ["generate", "actor/sleep", "other", "step"]  # critic/sleep is 0 throughout
    assert rows["actor/sleep"].first_s == 1.0
    assert rows["actor/sleep"].first_share == pytest.approx(0.5)
    assert rows["actor/sleep"].mean_s == pytest.approx(0.2)
    assert rows["actor/sleep"].mean_share == pytest.approx(0.2)
    assert rows["step"].mean_s == pytest.approx(1.0)
    assert sum(r.mean_s or 0.0 for name, r in rows.items() if name != "step") == pytest.approx(1.0)
    assert summary(_history())["overhead_fraction"] == {"first_step": 0.5, "mean": pytest.approx(0.2)}


def test_markdown_table_is_ready_to_paste() -> None:
    text = markdown_table(_history())
    lines = text.splitlines()
    header = "| part | first step s | share | MB | mean s (steps 2+) | share | MB | GB/s | hidden s |"
    assert lines[0] == header
    assert "| actor/sleep | 1.000 | 50.0% | 2000.0 | 0.200 | 20.0% | 2000.0 | 10.00 | 0.000 |" in lines
    assert "| **step** | 2.000 | 100.0% |  | 1.000 | 100.0% |  | - |  |" in lines
    assert lines[-1].endswith("| 50.0% | | | 20.0% | | | |")
    one_step = markdown_table(_history()[:1])
    assert "| generate | 0.500 | 25.0% |  | - | - |  | - |  |" in one_step.splitlines()
    assert "| actor/sleep | 1.000 | 50.0% | 2000.0 | - | - |  | 2.00 | 0.000 |" in one_step.splitlines()


def test_hidden_seconds_are_no_part_of_the_step_but_count_for_the_rate() -> None:
    # An overlapped sleep: the loop waited 0.05 s of its 0.25 s; 0.2 s ran under generate.
    clock = StepClock()
    with clock.span("generate"):
        time.sleep(0.02)
        with clock.span("actor/sleep"):
            time.sleep(0.01)
    moved = StepBytes({"actor/sleep": 5e9})
    record = step_metrics(clock, ROLES, moved, hidden={"actor/sleep": 0.2})
    assert record["time/actor/sleep_hidden_s"] == 0.2
    assert record["time/critic/wake_hidden_s"] == 0.0  # every transition's key, every step
    named = sum(v for k, v in record.items() if k.endswith("_s") and not k.endswith(("hidden_s", "step_s")))
    assert named == pytest.approx(record["time/step_s"], abs=1e-9)  # hidden seconds are not added
    overhead = record["time/actor/sleep_s"]
    assert record["time/overhead_fraction"] == pytest.approx(overhead / record["time/step_s"])
    history = [{**record, "step": 1}, {**record, "step": 2}]
    row = {r.part: r for r in budget_rows(history)}["actor/sleep"]
    assert row.mean_hidden_s == 0.2
    # The rate over the transition's own seconds (waited + hidden), not over the wait alone.
    assert row.gb_per_s == pytest.approx(5e9 / (record["time/actor/sleep_s"] + 0.2) / 1e9)
    row_at = 2 + row_names(history).index("actor/sleep")
    assert markdown_table(history).splitlines()[row_at].endswith("| 0.200 |")
    with pytest.raises(ValueError, match="engines/nap"):
        step_metrics(StepClock(), ROLES, moved, hidden={"engines/nap": 1.0})


def row_names(history: list[dict[str, float]]) -> list[str]:
    return [r.part for r in budget_rows(history)]


def test_summary_table_and_plot_show_the_budget(tmp_path: Path) -> None:
    table = budget_table(_history())
    assert table.columns[0].header == "part"
    assert list(table.columns[0].cells) == ["generate", "actor/sleep", "other", "step"]
    assert "20.0% of the steps after it" in str(table.caption)
    log = MetricsLog(tmp_path, tensorboard=False)
    for record in _history():
        log.log(int(record["step"]), {k: v for k, v in record.items() if k != "step"})
    log.close()
    png = plot_run(tmp_path)
    with Image.open(png) as image:
        assert image.size == (1000, 1050)  # the four curves and the budget bars below them


class _Weights:
    def __init__(self, actor: str, engines: list[str]) -> None:
        self.actor, self.engines = actor, engines

    def weights_checksum(self, rows: int | None = None) -> str:
        return self.actor

    def weights_checksums(self) -> list[str]:
        return self.engines


def test_check_weights_names_the_engine_that_missed_the_update() -> None:
    from typing import Any, cast

    from ppo_driver.loop import check_weights_match
    from ppo_driver.roles import Roles

    def roles(actor: str, engines: list[str]) -> Roles:
        w = _Weights(actor, engines)
        return Roles(rollout=cast(Any, w), actor=cast(Any, w), critic=None)

    check_weights_match(3, roles("a" * 64, ["a" * 64, "a" * 64]))
    with pytest.raises(RuntimeError, match=r"step 3: .*engine\(s\) \[1\] hold other weights"):
        check_weights_match(3, roles("a" * 64, ["a" * 64, "b" * 64]))


def test_the_table_shows_each_training_phase_tflops() -> None:
    history = [
        {
            "step": 1,
            "time/step_s": 2.0,
            "time/critic_train_s": 1.0,
            "time/actor_train_s": 1.0,
            "critic/tflops": 5.0,
        },
        {
            "step": 2,
            "time/step_s": 2.0,
            "time/critic_train_s": 1.0,
            "time/actor_train_s": 1.0,
            "critic/tflops": 40.0,
        },
        {
            "step": 3,
            "time/step_s": 2.0,
            "time/critic_train_s": 1.0,
            "time/actor_train_s": 1.0,
            "critic/tflops": 60.0,
        },
    ]
    # The first step (optimizer state, warm-up) is left out; the actor logged none.
    assert phase_tflops(history) == {"critic_train": 50.0}
    assert phase_tflops(history[:1]) == {"critic_train": 5.0}
    table = budget_table(history)
    cells = dict(zip(table.columns[0].cells, table.columns[-1].cells, strict=True))
    assert cells["critic_train"] == "50"
    assert cells["actor_train"] == ""


def _full_history() -> list[dict[str, float]]:
    """Every column filled, with the longest part names a run has (as a CPU run of the guess config)."""
    parts = {
        "generate": 0.6,
        "critic_train": 0.5,
        "actor_train": 0.6,
        "generate_wait": 0.001,
        "weight_update": 0.14,
        "engines/sleep": 0.015,
        "actor/sleep": 0.05,
        "other": 0.02,
    }
    out = []
    for step in (1, 2, 3):
        record: dict[str, float] = {"step": step, "time/step_s": sum(parts.values())}
        record |= {f"time/{k}_s": v for k, v in parts.items()}
        record |= {"time/actor/sleep_hidden_s": 0.01, "bytes/actor/sleep": 1e6, "bytes/engines/sleep": 3e5}
        record |= {"critic/tflops": 0.00296, "actor/tflops": 0.00237}
        out.append(record)
    return out


def test_the_budget_table_fits_80_columns_with_every_name_whole() -> None:
    from rich.console import Console

    console = Console(width=80, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(budget_table(_full_history(), "cpu"))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    body = [line.split()[0] for line in text.splitlines() if line.strip()]
    for name in ("generate_wait", "weight_update", "engines/sleep", "actor/sleep", "critic_train"):
        assert name in body, text
    assert "…" not in text.split("1st s:")[0]  # nothing in the table itself is cut
    assert "per CPU rank (no GPU in this run)" in text
    assert "per GPU" not in text
    assert "per GPU" in str(budget_table(_full_history(), "cuda").caption)


def test_a_cpu_run_start_up_table_has_no_cuda_graphs() -> None:
    from ppo_driver.metrics import startup_table
    from ppo_driver.startup import StartupClock

    clock = StartupClock()
    with clock.part("roles"):
        clock.roles({"rollout": {"model": 1.0, "cuda graphs": 0.0}, "actor": {"model": 2.0}})
    table = clock.end()
    shown = {"cpu": startup_table(table, [], "cpu"), "cuda": startup_table(table, [], "cuda")}
    names = {device: list(t.columns[0].cells) for device, t in shown.items()}
    assert "  rollout: model" in names["cpu"]
    assert "  rollout: cuda graphs" not in names["cpu"]
    assert "  rollout: cuda graphs" in names["cuda"]
