"""What ``ppo-driver report`` shows, read from a run folder: ``metrics.jsonl`` (every step's metrics),
``config.yaml`` (the run's settings) and ``summary.json`` (written when the run finished).

Only the metrics file is required; a run that is still going (or was stopped) has no summary, and the
page says so. Nothing here draws: :mod:`ppo_driver.report.svg` does, :mod:`ppo_driver.report.page`
puts the two together.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppo_driver import critic_report
from ppo_driver.budget import BudgetRow, budget_rows
from ppo_driver.metrics import EVAL_SHOWN, METRICS_FILE, SHOWN, parse_lines

WINDOW = 5  # the first and last steps the summary compares (as the run summary table does)
MAX_BARS = 400  # more steps than this: the budget's bars are means over runs of consecutive steps

# The critic-health metrics (ppo_trainer.critic_health, logged under critic/): its bucket, turn, decile
# and baseline counts, here so that reading a run imports no torch (a unit test keeps them equal).
POSITION_BUCKETS = 10
MAX_TURNS = 8
DECILES = 10
BASELINES: tuple[str, ...] = ("grpo", "rloo")
CRITIC_MARK = "critic/value_loss"  # logged by every step in which the critic trained


class ReportError(Exception):
    """A run folder the report cannot be built from; the message is one line naming the path and the fix."""


@dataclass(frozen=True)
class Run:
    """A run folder, read: its steps, its config (``{}`` without ``config.yaml``), its summary (None
    before the run finished) and notes about what could not be read."""

    run_dir: Path
    records: list[dict[str, Any]]
    config: Mapping[str, Any] = field(default_factory=dict)
    summary: Mapping[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def critic_steps(self) -> list[dict[str, Any]]:
        """The steps in which the critic trained (none in a run without a critic)."""
        return [r for r in self.records if number(r.get(CRITIC_MARK)) is not None]


def load_run(run_dir: str | Path) -> Run:
    """Read ``run_dir``; :class:`ReportError` when it holds no steps to show."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReportError(
            f"{run_dir} does not exist; pass the run folder `ppo-driver train` wrote "
            "(its --run-dir, or runs/latest for the newest run)"
        )
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; pass the run folder `ppo-driver train` wrote")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(
            f"{path} does not exist; pass a run folder that `ppo-driver train` wrote "
            "(it writes metrics.jsonl after the first step)"
        )
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            lines = parse_lines(path)
        except ValueError as exc:
            raise ReportError(str(exc)) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ReportError(f"{path} cannot be read ({exc}); check the file and its permissions") from None
    notes += [str(w.message) for w in caught]
    records = [r for r in lines if isinstance(r.get("step"), int) and not isinstance(r.get("step"), bool)]
    if len(records) < len(lines):
        notes.append(f"{path}: {len(lines) - len(records)} lines without a step number left out")
    if not records:
        raise ReportError(
            f"{path} holds no steps yet; build the report after the run's first step "
            "(each step appends one line)"
        )
    return Run(
        run_dir, records, _read_config(run_dir / "config.yaml", notes), _read_summary(run_dir, notes), notes
    )


def _read_config(path: Path, notes: list[str]) -> Mapping[str, Any]:
    if not path.is_file():
        notes.append(f"{path} is missing: the run's settings are not shown")
        return {}
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        notes.append(f"{path} cannot be read ({type(exc).__name__}): the run's settings are not shown")
        return {}
    return data if isinstance(data, dict) else {}


def _read_summary(run_dir: Path, notes: list[str]) -> Mapping[str, Any] | None:
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        notes.append(f"{path} cannot be read ({type(exc).__name__})")
        return None
    return data if isinstance(data, dict) else None


# ---------------------------------------------------------------------------------- series


def number(value: Any) -> float | None:
    """A finite number logged for a key, else None (missing, a list, a bool, NaN or infinite)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


@dataclass(frozen=True)
class Series:
    """One metric over the steps that logged it."""

    key: str
    label: str
    steps: tuple[int, ...]
    values: tuple[float, ...]

    def __bool__(self) -> bool:
        return bool(self.steps)

    def last_mean(self, window: int = WINDOW) -> float | None:
        return statistics.fmean(self.values[-window:]) if self.values else None


def series(records: Sequence[Mapping[str, Any]], key: str, label: str | None = None) -> Series:
    steps, values = [], []
    for record in records:
        value = number(record.get(key))
        if value is not None:
            steps.append(int(record["step"]))
            values.append(value)
    return Series(key, label or key, tuple(steps), tuple(values))


def window_mean(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over ``records`` that logged it (None: none did)."""
    values = [v for v in (number(r.get(key)) for r in records) if v is not None]
    return statistics.fmean(values) if values else None


def steps_text(records: Sequence[Mapping[str, Any]]) -> str:
    """``step 7`` or ``steps 116-120``: which steps a window holds."""
    steps = [int(r["step"]) for r in records]
    if not steps:
        return "no steps"
    return f"step {steps[0]}" if steps[0] == steps[-1] else f"steps {steps[0]}-{steps[-1]}"


# ---------------------------------------------------------------------------------- the header


def setting(config: Mapping[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def essentials(run: Run) -> list[tuple[str, str]]:
    """The run's settings worth a glance, as (name, value) rows: model, estimator, steps, placement,
    rollout; each from ``config.yaml`` when it holds it."""
    c = run.config
    steps = [int(r["step"]) for r in run.records]
    planned = setting(c, "train.steps")
    of = f" of {planned}" if planned else ""
    rows = [("steps", f"{len(steps)} logged ({steps_text(run.records)}){of}")]
    if not c:
        return rows
    path = setting(c, "model.path")
    if path:
        model = str(path)
    else:
        tiny = setting(c, "model.tiny") or {}
        shown = ("hidden_size", "num_layers")
        size = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in tiny.items() if k in shown)
        model = "the built-in tiny model" + (f" ({size})" if size else "")
    lora = setting(c, "train.lora")
    if isinstance(lora, Mapping) and lora.get("rank"):
        model += f"; LoRA rank {lora['rank']}"
    rows.insert(0, ("model", model))
    estimator = setting(c, "algorithm.estimator")
    if estimator:
        critic = setting(c, "placement.critic")
        rows.insert(1, ("estimator", f"{estimator}" + (f" (critic: {critic})" if critic else "")))
    mode, device = setting(c, "placement.mode"), setting(c, "placement.device")
    if mode or device:
        rows.append(("placement", " on ".join(str(x) for x in (mode, device) if x)))
    source = setting(c, "rollout.task") or setting(c, "rollout.dataset") or setting(c, "rollout.environment")
    prompts, n = setting(c, "rollout.prompts_per_step"), setting(c, "rollout.sampling.n_samples_per_prompt")
    rollout = ", ".join(
        str(x)
        for x in (
            setting(c, "rollout.engine") and f"{setting(c, 'rollout.engine')} engine",
            source,
            prompts and n and f"{prompts} prompts x {n} samples a step",
        )
        if x
    )
    if rollout:
        rows.append(("rollout", rollout))
    seed = setting(c, "train.seed")
    if seed is not None:
        rows.append(("seed", str(seed)))
    return rows


def summary_lines(run: Run) -> list[str]:
    """The run's summary in lines: the first and last steps' means of the main metrics (as the run
    summary table), whether the engines ended with the actor's weights, and the critic's line."""
    first, last = run.records[:WINDOW], run.records[-WINDOW:]
    changes = []
    for key, label in (*SHOWN, *EVAL_SHOWN):
        a, b = window_mean(first, key), window_mean(last, key)
        if a is None and b is None:
            continue
        if a is not None and b is not None and first != last:
            changes.append(f"{label} {a:.3f} -> {b:.3f}")
        else:
            changes.append(f"{label} {(b if b is not None else a):.3f}")
    lines = []
    if changes:
        lines.append(
            f"mean of the first {len(first)} and the last {len(last)} steps: " + "; ".join(changes)
            if first != last
            else f"{steps_text(first)}: " + "; ".join(changes)
        )
    if run.summary is not None:
        match = run.summary.get("weights_match")
        if isinstance(match, bool):
            lines.append(f"engines hold the actor's final weights: {'match' if match else 'DIFFER'}")
    else:
        lines.append("no summary.json: the run has not finished (it is still running, or it stopped early)")
    # Its means take any number, NaN too: it gets the finite ones, as every panel here.
    finite = [{k: v for k, v in r.items() if not _non_finite(v)} for r in run.records]
    critic = critic_report.summary_line(finite, WINDOW)
    if critic is not None:
        lines.append(critic)
    return lines


def _non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


# ---------------------------------------------------------------------------------- the budget


@dataclass(frozen=True)
class Budget:
    """Stacked bars of the step budget: per bar its step (the first of its run of steps), per part its
    seconds per bar; ``per_bar``: how many steps each bar averages; ``rows``: the budget table."""

    steps: list[int]
    parts: list[tuple[str, list[float]]]
    per_bar: int
    rows: list[BudgetRow]


def budget(records: Sequence[Mapping[str, Any]], max_bars: int = MAX_BARS) -> Budget | None:
    """The budget's parts per step (``budget.budget_rows``'s parts, so the same as the summary's table);
    None for a run that logged no ``time/step_s``."""
    rows = budget_rows(records)
    steps = [r for r in records if number(r.get("time/step_s")) is not None]
    if not rows or not steps:
        return None
    names = [row.part for row in rows if row.part != "step"]
    # "other" can dip a hair below 0 (two clock reads a microsecond apart): a bar cannot be negative.
    heights = {p: [max(number(r.get(f"time/{p}_s")) or 0.0, 0.0) for r in steps] for p in names}
    xs = [int(r["step"]) for r in steps]
    per_bar = max(1, math.ceil(len(steps) / max_bars))
    if per_bar > 1:
        xs = xs[::per_bar]
        heights = {p: _chunk_means(hs, per_bar) for p, hs in heights.items()}
    return Budget(xs, [(p, heights[p]) for p in names], per_bar, rows)


def _chunk_means(values: list[float], size: int) -> list[float]:
    return [statistics.fmean(values[i : i + size]) for i in range(0, len(values), size)]


# ---------------------------------------------------------------------------------- the critic


def position_keys() -> list[str]:
    return [f"critic/ev_pos_{b}" for b in range(POSITION_BUCKETS)]


def turn_keys() -> list[str]:
    return [f"critic/ev_turn_{t}" for t in range(1, MAX_TURNS + 1)]


def calibration(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, float, str]]:
    """Per value decile that the steps logged: (mean value, mean return, its name), each the mean over
    ``records`` of the step's decile means."""
    points = []
    for d in range(DECILES):
        v = window_mean(records, f"critic/calib_value_d{d}")
        r = window_mean(records, f"critic/calib_return_d{d}")
        if v is not None and r is not None:
            points.append((v, r, f"decile {d + 1}"))
    return points
