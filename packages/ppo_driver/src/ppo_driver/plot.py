"""``ppo-driver plot RUN_DIR``: reward, loss, KL and step-time curves from ``metrics.jsonl`` as a PNG,
and below them the step budget (``budget.py``) as one stacked bar per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display needed: the plot goes to a file

import matplotlib.pyplot as plt

from ppo_driver.budget import budget_rows
from ppo_driver.metrics import read_metrics

# (title, metric keys drawn on that panel)
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("rollout/reward_mean", "eval/reward_mean")),
    ("loss", ("actor/loss", "critic/loss")),
    ("KL", ("actor/ppo_kl", "actor/ref_kl", "actor/kl_loss")),
    ("step time (s)", ("time/step",)),
)


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the curves of ``run_dir`` to ``out`` (default ``<run_dir>/curves.png``); return the path."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl holds no steps yet; plot after at least one step")
    out_path = Path(out) if out is not None else run_dir / "curves.png"
    fig = plt.figure(figsize=(10, 10.5), constrained_layout=True)
    grid = fig.add_gridspec(3, 2)
    axes = [fig.add_subplot(grid[i // 2, i % 2]) for i in range(4)]
    for ax, (title, keys) in zip(axes, PANELS, strict=True):
        drawn = 0
        for key in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=key)
                drawn += 1
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    _budget_bars(fig.add_subplot(grid[2, :]), records)
    fig.suptitle(str(run_dir))
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            xs.append(int(record["step"]))
            ys.append(float(value))
    return xs, ys


def _budget_bars(ax: Any, records: list[dict[str, Any]]) -> None:
    """One bar per step, stacked from the budget's parts (the same parts as the summary's table)."""
    ax.set_title("step budget (s)")
    ax.set_xlabel("step")
    parts = [row.part for row in budget_rows(records) if row.part != "step"]
    steps = [r for r in records if "time/step_s" in r]
    if not parts or not steps:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        return
    xs = [int(r["step"]) for r in steps]
    bottom = [0.0] * len(steps)
    cmap = plt.get_cmap("tab20")
    for i, part in enumerate(parts):
        # "other" can dip a hair below 0 (clock reads a microsecond apart): a bar cannot be negative.
        heights = [max(float(r.get(f"time/{part}_s", 0.0)), 0.0) for r in steps]
        ax.bar(xs, heights, bottom=bottom, label=part, color=cmap(i % 20), width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=4, loc="upper right")
