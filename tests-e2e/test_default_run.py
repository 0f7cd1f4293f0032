"""The default `ppo-driver train`, started as a new user would: it learns, the engines end with the
actor's weights, the value handoff and the sleep/wake transitions happen every step, every second of a
step and of the start-up is accounted for, and `ppo-driver report` makes a page of it that a real
browser (headless Chromium, browser.py) renders without a console error. One run (module fixture)
serves every test.

Elsewhere: that the recipe learns on other seeds is the seed sweep's (packages/ppo_driver/benchmarks/
seed_sweep.py, docs/benchmarks/end-to-end.md), a benchmark of 2.5 minutes a seed; that a run resumed
from a checkpoint ends exactly where the uninterrupted one did, step for step and bit for bit, is
test_faults.py's (test_tampered_checkpoints_are_skipped_for_the_previous_one, on the drills' run).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from browser import open_page
from conftest import check_step_budget, run_cli
from PIL import Image

from ppo_driver.config import load_config

DEFAULT = load_config()  # the embedded default, what `ppo-driver train` runs without a config
STEPS = DEFAULT.train.steps
WINDOW = 5
LEARNT = 0.8  # mean reward of the last WINDOW steps, and of the final greedy evaluation


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    work = tmp_path_factory.mktemp("default")
    done = run_cli("train", "--run-dir", "run", cwd=work, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return work / "run", done.stdout


def _assert_learnt(run_dir: Path) -> None:
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = [r["rollout/reward_mean"] for r in records]
    first, last = statistics.fmean(rewards[:WINDOW]), statistics.fmean(rewards[-WINDOW:])
    # The task is learnt, not merely started: the bar for the default run.
    assert last >= LEARNT, (first, last, rewards)
    assert records[-1]["eval/reward_mean"] >= LEARNT, records[-1]


@pytest.mark.timeout(480)
def test_default_run_learns(default_run: tuple[Path, str]) -> None:
    run_dir, stdout = default_run
    _assert_learnt(run_dir)
    assert "run summary" in stdout
    starting = stdout.index("starting the rollout engine, the actor (1 rank), the critic (1 rank) ...")
    assert re.search(r"^started in \d+\.\d s$", stdout[starting:], re.MULTILINE), stdout[starting:][:500]
    assert "engines hold the actor's final weights: match" in stdout


@pytest.mark.timeout(480)
def test_every_second_of_a_step_is_accounted_for(default_run: tuple[Path, str]) -> None:
    run_dir, stdout = default_run
    check_step_budget(_metrics(run_dir), ("actor", "critic", "engines"), engines_move=True)
    # The summary prints the budget, "other" and the step among its rows; summary.json holds it too.
    table = stdout[stdout.index("step budget") :]
    for row in ("engines/sleep", "critic/wake", "weight_update", "handoff", "other", "step", "overhead"):
        assert row in table, row
    budget = json.loads((run_dir / "summary.json").read_text())["budget"]
    parts = {p["part"]: p for p in budget["parts"]}
    named = sum(p["mean_s"] for name, p in parts.items() if name != "step")
    assert named == pytest.approx(parts["step"]["mean_s"], rel=1e-9)
    assert parts["step"]["mean_share"] == pytest.approx(1.0)
    assert 0 < budget["overhead_fraction"]["mean"] < 1


@pytest.mark.timeout(480)
def test_engines_end_with_the_actor_weights(default_run: tuple[Path, str]) -> None:
    run_dir, _ = default_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(summary["actor_checksum"]) == 64
    assert summary["engine_checksums"] == [summary["actor_checksum"]] * DEFAULT.placement.num_engines
    assert summary["weights_match"] is True


@pytest.mark.timeout(480)
def test_value_handoff_and_offload_every_step(default_run: tuple[Path, str]) -> None:
    run_dir, _ = default_run
    # Colocated, shared critic, offload on: each step the engines go to sleep for training and come
    # back, the critic wakes to train and sleeps, the actor wakes to train and send weights and sleeps.
    expected = {
        "rollout:sleep",
        "rollout:wake",
        "critic:wake",
        "critic:sleep",
        "actor:wake",
        "actor:sleep",
    }
    for record in _metrics(run_dir):
        step = record["step"]
        assert record["handoff/value_boxes"] == DEFAULT.placement.actor_gpus, step
        assert record["handoff/values_used"] == 1, step
        assert set(record["offload/transitions"]) == expected, (step, record["offload/transitions"])
        # Once each per step, saving steps included: a checkpoint wakes no one (the roles write it in
        # the background from the host copies of their sleeps).
        for role, count in (("actor", 1), ("critic", 1), ("rollout", 1)):
            assert record[f"offload/{role}_sleeps"] == record[f"offload/{role}_wakes"] == count, (step, role)
        # The phases ran in the order, each sleep before the wake it makes room for.
        t = record["offload/transitions"]
        assert t.index("rollout:sleep") < t.index("critic:wake") < t.index("critic:sleep")
        assert (
            t.index("critic:sleep") < t.index("actor:wake") < t.index("rollout:wake") < t.index("actor:sleep")
        )
        assert record["weight_sync/updates"] >= 1, step
        if step % DEFAULT.checkpoint.interval == 0 or step == STEPS:
            assert record["time/save_blocking"] > 0, step
    assert _metrics(run_dir)[-1]["time/save_background"] > 0  # the last step waits for its checkpoint
    # The checkpoints of the default run: every checkpoint.interval steps and the final one.
    interval = DEFAULT.checkpoint.interval
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step_{step:06d}" for step in (*range(interval, STEPS, interval), STEPS)]


@pytest.mark.timeout(480)
def test_start_up_is_accounted_for(default_run: tuple[Path, str]) -> None:
    run_dir, stdout = default_run
    startup = json.loads((run_dir / "summary.json").read_text())["startup"]
    assert startup["from_process_start"] is True  # Python's own start and the imports count
    parts = {p["part"]: p for p in startup["parts"]}
    for part in ("python start + imports", "driver imports", "ray", "roles", "first weight update", "other"):
        assert part in parts, part
    # The rows add up to the command's start -> the first step, with a small remainder no part covers.
    assert sum(p["seconds"] for p in startup["parts"]) == pytest.approx(startup["total_s"], rel=1e-9)
    assert 0 <= parts["other"]["seconds"] <= 0.05 * startup["total_s"], parts["other"]
    assert all(p["seconds"] >= 0 for p in startup["parts"])
    # Each role's workers timed their own parts.
    roles = startup["roles"]
    for role in ("actor", "critic"):
        assert {"process start", "imports", "process group", "model", "optimizer", "pinned buffers"} <= set(
            roles[role]
        ), roles[role]
    assert {"process start", "imports", "model", "cuda graphs"} <= set(roles["rollout"]), roles["rollout"]
    assert "placement groups" in roles["driver"]
    table = stdout[stdout.index("start-up") :]
    for row in (
        "driver imports",
        "ray",
        "roles",
        "actor: imports",
        "rollout: model",
        "other",
        "to the first step",
    ):
        assert row in table, row


# The report's charts, in page order; the two panels the default run has no data for (single-turn
# samples: no explained variance per turn; CPU: no peak memory share) say so in one line each.
REPORT_CHARTS = [
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
OKABE_ITO_BLUE = (0, 114, 178)  # the first line of every chart (ppo_driver/report/svg.py)


def _report(run_dir: Path) -> Path:
    done = run_cli("report", str(run_dir), cwd=run_dir.parent, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    page = run_dir / "report.html"
    assert f"wrote {page} ({STEPS} steps)" in done.stdout
    assert done.stderr == ""
    return page


@pytest.mark.timeout(480)
def test_the_report_renders_in_a_real_browser(default_run: tuple[Path, str], tmp_path: Path) -> None:
    run_dir, _ = default_run
    page = _report(run_dir)
    source = page.read_text()
    for outside in ("http://", "https://", "src=", "href=", "url(", "<script", "<link"):
        assert outside not in source, outside  # nothing to fetch: the page opens offline
    opened = open_page(page, tmp_path)
    assert opened.console == [], f"the page logged to the browser's console: {opened.console}"
    # The browser parsed every chart and the header: its DOM holds them, with the run's figures.
    charts = re.findall(r'<svg class="chart"[^>]*aria-label="([^"]*)"', opened.dom)
    assert [c.replace("&#x27;", "'") for c in charts] == REPORT_CHARTS
    assert opened.dom.count("<svg") == source.count("<svg")
    words = " ".join(re.sub(r"<[^>]+>", " ", opened.dom).split()).replace("&#x27;", "'")
    for text in (
        f"{STEPS} logged (steps 1-{STEPS}) of {STEPS}",
        "ppo (critic: shared)",
        "the built-in tiny model (hidden size 64, num layers 2)",
        "engines hold the actor's final weights: match",
        "single-turn samples only",
        "measured on CUDA runs only",
    ):
        assert text in words, text
    with Image.open(opened.screenshot) as image:
        assert image.size == opened.size
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 22)
    assert colours is not None
    drawn = sum(n for n, c in colours if c != (255, 255, 255))
    assert drawn > 0.05 * opened.size[0] * opened.size[1], f"{drawn} pixels not white: a blank page"
    blue = sum(n for n, c in colours if all(abs(a - b) <= 8 for a, b in zip(c, OKABE_ITO_BLUE, strict=True)))
    assert blue > 200, "no chart line drawn in the first colour: the SVG did not render"


@pytest.mark.timeout(480)
def test_the_browser_check_sees_a_console_error(default_run: tuple[Path, str], tmp_path: Path) -> None:
    # The same page with a deliberate error: the check above would see it, so its empty console counts.
    run_dir, _ = default_run
    page = run_dir / "report.html"
    if not page.is_file():
        page = _report(run_dir)
    broken = tmp_path / "broken.html"
    script = '<script>console.error("deliberate error"); no_such_function();</script></body>'
    broken.write_text(page.read_text().replace("</body>", script))
    opened = open_page(broken, tmp_path)
    assert any('"deliberate error"' in m for m in opened.console), opened.console
    assert any("Uncaught ReferenceError: no_such_function is not defined" in m for m in opened.console), (
        opened.console
    )


def test_the_guides_table_reads_a_runs_critic_panel(default_run: tuple[Path, str], tmp_path: Path) -> None:
    """docs/guide/ppo-or-grpo.md's tables come from `ppo_or_grpo.py table`: on the default run (PPO with
    a critic) its critic row shows the run's own explained variance at steps 1, 5, 10, 20 and the last,
    the first step at 0.5 or more, and the means of the last ten steps."""
    run_dir, _ = default_run
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / "tools-ppo-s7").symlink_to(run_dir)
    evals = [[0, 0.25, 10.0], [STEPS, 0.9, 60.0]]
    report = {"name": "tools-ppo", "seed": 7, "evals": evals, "wall_s": 61.0}
    (folder / "tool_task.json").write_text(json.dumps([report]))
    script = Path(__file__).parents[1] / "packages/ppo_driver/benchmarks/ppo_or_grpo.py"
    done = subprocess.run([sys.executable, str(script), "table", str(folder)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    records = _metrics(run_dir)
    ev = {r["step"]: r["critic/explained_variance"] for r in records if "critic/explained_variance" in r}
    first = next((str(s) for s in sorted(ev) if ev[s] >= 0.5), "never")
    share = statistics.fmean([r["time/critic_share"] for r in records][-10:])
    rows = [line for line in done.stdout.splitlines() if line.startswith("| tools-ppo |")]
    assert len(rows) == 2, done.stdout  # the accuracy table's, then the critic panel's
    row = rows[1]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:6] == [f"{ev[s]:.2f}" if s in ev else "-" for s in (1, 5, 10, 20, max(ev))], row
    assert cells[6] == first, row
    assert cells[-1] == f"{share:.2f}", row
    assert "| tools-ppo | 0.250 (10 s) | 0.900 (60 s) | 61 |" in done.stdout
    assert "warm-up: one of the two PPO runs is missing" in done.stdout
