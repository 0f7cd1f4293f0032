"""``ppo-driver report``: one self-contained HTML page of a run folder (``ppo_driver/report/``), built
from synthetic ``metrics.jsonl`` files here; tests-e2e/test_default_run.py opens a real run's page in
headless Chromium."""

from __future__ import annotations

import html
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ppo_driver.cli import main
from ppo_driver.report import REPORT_FILE, ReportError, build_report, data, load_run, render, svg

CRITIC_PARTS = {"time/critic_train_s": 0.3, "time/critic/sleep_s": 0.01, "time/critic/wake_s": 0.01}


def budget_keys(n: int) -> dict[str, float]:
    parts = {"time/generate_s": 0.1 + 0.001 * n, "time/actor_train_s": 0.25, "time/weight_update_s": 0.04}
    step = sum(parts.values()) + 0.005
    return {**parts, "time/other_s": 0.005, "time/step_s": step, "time/overhead_fraction": 0.1}


def ppo_step(n: int, steps: int, **extra: Any) -> dict[str, Any]:
    """A PPO step with the critic's health and cost, an evaluation every 5 steps and the last."""
    record: dict[str, Any] = {
        "step": n,
        "rollout/reward_mean": 0.1 + 0.7 * n / steps,
        "actor/loss": -0.02,
        "critic/loss": 0.5 / n,
        "critic/value_loss": 0.5 / n,
        "critic/explained_variance": -0.5 + n / steps,
        "critic/first_value_vs_score_corr": 0.2 + 0.5 * n / steps,
        "critic/adv_var_ratio_grpo": 0.5 + n / steps,
        "critic/adv_var_ratio_rloo": 0.4 + n / steps,
        "critic/adv_corr_grpo": 0.6,
        "critic/adv_corr_rloo": 0.55,
        "time/critic_share": 0.3,
        **budget_keys(n),
        **CRITIC_PARTS,
    }
    for b in (0, 2, 5, 7):  # 4-token responses reach four of the ten position buckets
        record[f"critic/ev_pos_{b}"] = 0.1 * b - 0.2
    for d in range(10):
        record[f"critic/calib_value_d{d}"] = d / 10
        record[f"critic/calib_return_d{d}"] = d / 10 + 0.05
    if n % 5 == 0 or n == steps:
        record |= {
            "eval/reward_mean": 0.5,
            "eval/accuracy": 0.25 + n / (2 * steps),
            "eval/sampled_accuracy": 0.2,
        }
    return record | extra


def grpo_step(n: int) -> dict[str, Any]:
    return {"step": n, "rollout/reward_mean": 0.2, "actor/loss": 0.01, **budget_keys(n)}


def write_run(
    folder: Path,
    records: list[dict[str, Any]],
    config: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))
    if summary is not None:
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


CONFIG = {
    "model": {"path": "models/my-model"},
    "algorithm": {"estimator": "ppo"},
    "placement": {"mode": "colocate", "device": "cpu", "critic": "shared"},
    "rollout": {
        "engine": "builtin",
        "task": "copy_small",
        "prompts_per_step": 32,
        "sampling": {"n_samples_per_prompt": 8},
    },
    "train": {"steps": 12, "seed": 7},
}


def text(page: str) -> str:
    """The page's visible words: tags dropped, entities decoded, whitespace collapsed."""
    page = re.sub(r"<style>.*?</style>", " ", page, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def missing_lines(page: str) -> list[str]:
    return [html.unescape(m) for m in re.findall(r'<p class="missing">(.*?)</p>', page)]


def chart_titles(page: str) -> list[str]:
    return [html.unescape(t) for t in re.findall(r'<svg class="chart"[^>]*aria-label="([^"]*)"', page)]


def test_a_ppo_runs_values_settings_and_summary_are_on_the_page(tmp_path: Path) -> None:
    records = [ppo_step(n, 12) for n in range(1, 13)]
    records[-1] |= {
        "rollout/reward_mean": 0.8765,
        "eval/accuracy": 0.6543,
        "critic/explained_variance": 0.4321,
    }
    records[-1] |= {"critic/adv_var_ratio_grpo": 2.468, "critic/calib_return_d9": 0.9876}
    run = write_run(tmp_path / "run", records, CONFIG, {"weights_match": True})
    path = build_report(run)
    assert path == run / REPORT_FILE
    page = path.read_text()
    words = text(page)
    for value in ("0.8765", "0.6543", "0.4321", "2.468"):
        assert value in words, value
    assert "decile 10 0.9 0.9575" in words  # the calibration table: last 5 steps' means of decile 10
    for setting in (
        "models/my-model",
        "ppo (critic: shared)",
        "12 logged (steps 1-12) of 12",
        "colocate on cpu",
    ):
        assert setting in words, setting
    assert "builtin engine, copy_small, 32 prompts x 8 samples a step" in words
    assert "engines hold the actor's final weights: match" in words
    assert "reward 0.275 -> 0.699" in words  # the first and last 5 steps' means, as the run summary
    assert "critic (mean of steps 8-12): 30% of a step's time" in words  # critic_report.summary_line
    assert chart_titles(page) == [
        "reward",
        "held-out accuracy",
        "explained variance over steps",
        "explained variance by response position",
        "value calibration (deciles of the values)",
        "advantage variance ratio (baseline / critic)",
        "advantage correlation with the critic's",
        "the critic's share of a step",
        "seconds per step",
    ]
    # Only the panels this run has no data for say so: no turns (single-turn), no memory share (CPU).
    assert len(missing_lines(page)) == 2
    assert "single-turn samples only" in missing_lines(page)[0]
    assert "measured on CUDA runs only" in missing_lines(page)[1]


def test_a_grpo_run_says_in_one_line_per_panel_that_it_has_no_critic(tmp_path: Path) -> None:
    config = {**CONFIG, "algorithm": {"estimator": "grpo"}, "placement": {"critic": "none"}}
    page = render(load_run(write_run(tmp_path / "grpo", [grpo_step(n) for n in range(1, 4)], config)))
    lines = missing_lines(page)
    no_critic = "no critic in this run (algorithm.estimator: grpo): no critic/value_loss in metrics.jsonl"
    assert [line.startswith(no_critic) for line in lines] == [False, True, True, True], lines
    assert "no held-out evaluation" in lines[0]
    assert chart_titles(page) == ["reward", "seconds per step"]  # the budget is drawn all the same
    assert "critic (" not in text(page)
    # Not finished: no summary.json.
    assert "no summary.json: the run has not finished" in text(page)


def test_each_panel_without_data_says_so_in_one_line(tmp_path: Path) -> None:
    # A run with a critic but one sample per prompt (no advantage comparison), no evaluation, no
    # calibration and no position buckets, and no timings at all.
    records = [
        {"step": n, "rollout/reward_mean": 0.3, "critic/value_loss": 0.2, "critic/explained_variance": 0.1}
        for n in (1, 2)
    ]
    page = render(load_run(write_run(tmp_path / "bare", records)))
    lines = missing_lines(page)
    for expected in (
        "no held-out evaluation in this run",
        "no explained variance per response position logged",
        "single-turn samples only",
        "no value calibration logged",
        "no advantage comparison logged",
        "no critic cost logged (time/critic_share)",
        "no step budget logged",
    ):
        assert sum(expected in line for line in lines) == 1, (expected, lines)
    assert all("\n" not in line for line in lines)
    assert chart_titles(page) == ["reward", "explained variance over steps"]
    assert "config.yaml is missing: the run's settings are not shown" in text(page)


def test_multi_turn_explained_variance_has_a_bar_per_turn_reached(tmp_path: Path) -> None:
    records = [ppo_step(n, 6, **{f"critic/ev_turn_{t}": 0.2 * t for t in (1, 2, 3)}) for n in range(1, 7)]
    page = render(load_run(write_run(tmp_path / "multi", records)))
    assert "explained variance by turn" in chart_titles(page)
    svg_of_turns = page[page.index('aria-label="explained variance by turn"') :].split("</svg>")[0]
    assert ">turn 3<" in svg_of_turns
    assert ">turn 4<" not in svg_of_turns
    assert "turn 2: 0.4" in html.unescape(svg_of_turns)  # the bar's tooltip


def test_the_page_references_nothing_outside_itself(tmp_path: Path) -> None:
    records = [ppo_step(n, 30) for n in range(1, 31)]
    page = render(load_run(write_run(tmp_path / "run", records, CONFIG, {"weights_match": False})))
    for outside in ("http://", "https://", "src=", "href=", "url(", "@import", "<link", "<script", "<img"):
        assert outside not in page, outside
    assert page.startswith("<!DOCTYPE html>")
    assert page.rstrip().endswith("</html>")
    assert "engines hold the actor's final weights: DIFFER" in text(page)


def test_text_from_the_run_is_escaped(tmp_path: Path) -> None:
    config = {**CONFIG, "model": {"path": "models/<b>bold</b>&co"}}
    page = render(load_run(write_run(tmp_path / "a<b>", [ppo_step(1, 1)], config)))
    assert "<b>" not in page
    assert "models/&lt;b&gt;bold&lt;/b&gt;&amp;co" in page


def test_non_finite_values_and_off_axis_values(tmp_path: Path) -> None:
    records = [ppo_step(n, 4) for n in range(1, 5)]
    records[0]["critic/explained_variance"] = -37.5  # a fresh critic: far below -1
    records[1]["critic/explained_variance"] = math.nan
    records[2]["rollout/reward_mean"] = math.inf
    page = render(load_run(write_run(tmp_path / "run", records)))
    assert "nan" not in text(page).lower().replace("mean", "")
    assert "inf" not in text(page).replace("information", "")
    assert "1 values beyond -1 or 1 are drawn on the axis's edge as open circles" in text(page)
    assert "explained variance, step 1: -37.5 (off the axis)" in html.unescape(page)


def test_a_cut_last_line_is_dropped_and_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", [ppo_step(n, 3) for n in range(1, 4)])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rollout/rew')
    assert main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "the last line is cut short" in captured.err
    assert f"wrote {run / REPORT_FILE} (3 steps)" in captured.out
    assert "the last line is cut short" in text((run / REPORT_FILE).read_text())


def test_the_budget_bars_add_up_and_long_runs_are_binned(tmp_path: Path) -> None:
    records = [ppo_step(n, 250) for n in range(1, 251)]
    run = load_run(write_run(tmp_path / "run", records))
    budget = data.budget(run.records)
    assert budget is not None
    assert budget.per_bar == 1
    assert len(budget.steps) == 250
    names = [p for p, _ in budget.parts]
    assert names == [
        "generate",
        "critic_train",
        "actor_train",
        "critic/sleep",
        "critic/wake",
        "weight_update",
        "other",
    ]
    for i, record in enumerate(records):
        assert sum(hs[i] for _, hs in budget.parts) == pytest.approx(record["time/step_s"] + 0.32)
    binned = data.budget(run.records, max_bars=100)
    assert binned is not None
    assert binned.per_bar == 3
    assert binned.steps[:3] == [1, 4, 7]
    assert len(binned.steps) == 84
    assert "each bar: the mean of 3 steps" not in render(run)  # 250 steps stay under MAX_BARS


def test_errors_are_one_line_exit_code_2_naming_the_path_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def error(*args: str) -> str:
        assert main(["report", *args]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.count("\n") == 1, captured.err
        assert captured.err.startswith("error: ")
        return captured.err

    missing = tmp_path / "no-such-run"
    assert f"{missing} does not exist; pass the run folder `ppo-driver train` wrote" in error(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty / 'metrics.jsonl'} does not exist; pass a run folder" in error(str(empty))
    (empty / "metrics.jsonl").write_text("\n  \n")
    message = error(str(empty))
    assert (
        f"{empty / 'metrics.jsonl'} holds no steps yet; build the report after the run's first step"
        in message
    )
    (empty / "metrics.jsonl").write_text('not json\n{"step": 1}\n')
    assert "line 1: not a JSON object" in error(str(empty))
    run = write_run(tmp_path / "run", [grpo_step(1)])
    (tmp_path / "a-file").write_text("")
    assert "pass another --out" in error(str(run), "--out", str(tmp_path / "a-file" / "report.html"))
    with pytest.raises(ReportError, match="is not a folder"):
        load_run(tmp_path / "a-file")


def test_out_writes_elsewhere_and_makes_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = write_run(tmp_path / "run", [grpo_step(1)])
    out = tmp_path / "pages" / "grpo.html"
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert out.is_file()
    assert not (run / REPORT_FILE).exists()
    assert f"wrote {out}" in capsys.readouterr().out


def test_the_critic_metric_counts_match_the_trainers() -> None:
    from ppo_trainer import critic_health

    assert data.POSITION_BUCKETS == critic_health.POSITION_BUCKETS
    assert data.MAX_TURNS == critic_health.MAX_TURNS
    assert data.DECILES == critic_health.DECILES
    assert data.BASELINES == critic_health.BASELINES


def test_nice_ticks_and_a_log_axis() -> None:
    assert svg.nice_ticks(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert svg.nice_ticks(-1.0, 0.5) == [-1.0, -0.5, 0.0, 0.5]
    assert svg.nice_ticks(0.1, 0.3) == [0.1, 0.15, 0.2, 0.25, 0.3]
    chart, clipped = svg.line_chart(
        "r", [svg.Line("a", [1, 2, 3], [0.02, 1.0, 3.0])], svg.Axis(log=True, ref=1.0)
    )
    assert clipped == 0
    assert ">0.01<" in chart
    assert ">10<" in chart


def test_200_steps_build_well_under_a_second(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "run", [ppo_step(n, 200) for n in range(1, 201)], CONFIG, {"weights_match": True}
    )
    start = time.perf_counter()
    path = build_report(run)
    seconds = time.perf_counter() - start
    print(f"report of 200 steps: {seconds * 1000:.0f} ms, {path.stat().st_size / 1000:.0f} kB")
    assert seconds < 2.0  # about 0.05 s on 2 cores; the margin is for a busy CI machine
