"""``ppo-driver plot RUN_DIR``: reward, loss, KL and step-time curves from ``metrics.jsonl`` as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display needed: the plot goes to a file

import matplotlib.pyplot as plt

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
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
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
