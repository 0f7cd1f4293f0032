"""The critic's cost per step and the run's one-line answer (``critic_report.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from ppo_driver import critic_report
from ppo_driver.metrics import summary_table


def step(n: int, **extra: float) -> dict:
    return {
        "step": n,
        "critic/value_loss": 0.1,
        "time/step_s": 10.0,
        "time/check_weights_s": 2.0,
        "time/critic_train_s": 1.5,
        "time/critic/sleep_s": 0.25,
        "time/critic/wake_s": 0.25,
        "time/handoff_s": 0.4,
        **extra,
    }


def test_the_critics_share_of_a_step_leaves_the_checks_out() -> None:
    got = critic_report.cost_metrics(step(1, **{"critic/peak_memory_gb": 3.0, "actor/peak_memory_gb": 9.0}))
    assert got["time/critic_share"] == pytest.approx(2.4 / 8.0)
    assert got["memory/critic_peak_share"] == pytest.approx(0.25)
    assert critic_report.cost_metrics({"time/step_s": 1.0, "actor/loss": 0.1}) == {}  # no critic


def test_the_summary_line_says_cost_and_gain_over_the_last_steps(tmp_path: Path) -> None:
    history = [
        step(
            n, **{"time/critic_share": 0.3, "critic/explained_variance": 0.6, "critic/adv_var_ratio_grpo": r}
        )
        for n, r in ((1, 9.0), (2, 2.0), (3, 2.8))
    ]
    line = critic_report.summary_line(history, window=2)
    assert line == (
        "critic (mean of steps 2-3): 30% of a step's time; advantage variance 2.4x lower than GRPO's "
        "on these samples; explained variance 0.60"
    )
    worse = [step(1, **{"critic/adv_var_ratio_rloo": 0.5})]
    assert "2.0x higher than RLOO's" in str(critic_report.summary_line(worse))
    assert critic_report.summary_line([{"step": 1, "actor/loss": 0.1}]) is None  # GRPO: no critic
    console = Console(record=True, width=200)
    console.print(summary_table(history, tmp_path, window=2))
    assert "advantage variance 2.4x lower than GRPO's" in " ".join(console.export_text().split())


def test_a_step_whose_explained_variance_is_undefined_is_left_out_of_the_summary() -> None:
    history = [
        step(1, **{"critic/explained_variance": float("nan")}),
        step(2, **{"critic/explained_variance": 0.5}),
    ]
    assert critic_report.summary(history)["explained_variance"] == pytest.approx(0.5)
    only_nan = critic_report.summary_line([step(1, **{"critic/explained_variance": float("nan")})])
    assert "nan" not in str(only_nan).lower()
    assert "explained variance" not in str(only_nan)
