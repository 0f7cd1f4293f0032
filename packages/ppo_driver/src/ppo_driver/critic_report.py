"""Is the critic paying for itself? Its cost per step, and the run's answer in one line.

Per step (:func:`cost_metrics`, from the step's budget and the trainers' metrics):

* ``time/critic_share``: the critic's seconds over the step's (``check_weights`` left out, as in the
  budget's overhead): its training phase, its own sleep and wake, and the value handoff, the work a
  run without a critic would not do;
* ``memory/critic_peak_share`` (CUDA): the critic's peak memory in its training phase over the sum of
  the actor's and the critic's (``peak_memory_gb`` of each, rank 0).

What the critic buys comes from the critic itself (``ppo_trainer.critic_health``: ``critic/
explained_variance``, ``critic/adv_var_ratio_grpo``, ...). :func:`summary` and :func:`summary_line`
put the run's last steps of both side by side for ``summary.json`` and the run summary table. The two
cost figures are measurements (under ``time/`` and ``memory/``), so comparisons of two runs' computed
metrics leave them out as they leave out every timing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

# The parts of a step's budget that a run without a critic would not have (budget.py's names).
CRITIC_PARTS: tuple[str, ...] = ("critic_train", "critic/sleep", "critic/wake", "handoff")
# metric -> its name in summary.json's "critic"
SUMMARY_KEYS: dict[str, str] = {
    "time/critic_share": "time_share",
    "memory/critic_peak_share": "peak_memory_share",
    "critic/explained_variance": "explained_variance",
    "critic/adv_var_ratio_grpo": "adv_var_ratio_grpo",
    "critic/adv_var_ratio_rloo": "adv_var_ratio_rloo",
    "critic/adv_corr_grpo": "adv_corr_grpo",
}


def cost_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The critic's share of a finished step's time and peak memory (empty without a critic)."""
    if not isinstance(metrics.get("critic/value_loss"), int | float):
        return {}
    step_s = float(metrics.get("time/step_s", 0.0)) - float(metrics.get("time/check_weights_s", 0.0))
    out: dict[str, float] = {}
    if step_s > 0:
        critic_s = sum(float(metrics.get(f"time/{part}_s", 0.0)) for part in CRITIC_PARTS)
        out["time/critic_share"] = critic_s / step_s
    critic_gb, actor_gb = metrics.get("critic/peak_memory_gb"), metrics.get("actor/peak_memory_gb")
    if isinstance(critic_gb, int | float) and isinstance(actor_gb, int | float) and critic_gb + actor_gb > 0:
        out["memory/critic_peak_share"] = float(critic_gb) / float(critic_gb + actor_gb)
    return out


def summary(history: list[dict[str, Any]], window: int = 5) -> dict[str, Any] | None:
    """The means of ``SUMMARY_KEYS`` over the last ``window`` steps that logged the critic's values
    (None: no such step, e.g. a GRPO run), and which steps those are."""
    steps = [r for r in history if isinstance(r.get("critic/value_loss"), int | float)][-window:]
    if not steps:
        return None
    out: dict[str, Any] = {"steps": [int(r["step"]) for r in steps]}
    for key, name in SUMMARY_KEYS.items():
        # a step whose figure is undefined (NaN: e.g. returns of zero variance) adds nothing
        values = [
            float(r[key]) for r in steps if isinstance(r.get(key), int | float) and math.isfinite(r[key])
        ]
        if values:
            out[name] = statistics.fmean(values)
    return out


def summary_line(history: list[dict[str, Any]], window: int = 5) -> str | None:
    """One line: what the critic cost and what it bought over the run's last steps, e.g. ``critic
    (steps 116-120): 31% of a step's time; advantage variance 2.4x lower than GRPO's on these samples;
    explained variance 0.62``."""
    s = summary(history, window)
    if s is None:
        return None
    parts = []
    if "time_share" in s:
        parts.append(f"{s['time_share']:.0%} of a step's time")
    if "peak_memory_share" in s:
        parts.append(f"{s['peak_memory_share']:.0%} of the trainers' peak memory")
    for name, label in (("adv_var_ratio_grpo", "GRPO's"), ("adv_var_ratio_rloo", "RLOO's")):
        if name in s:
            parts.append(f"advantage variance {_lower_or_higher(s[name])} than {label} on these samples")
    if "explained_variance" in s:
        parts.append(f"explained variance {s['explained_variance']:.2f}")
    first, last = s["steps"][0], s["steps"][-1]
    where = f"step {first}" if first == last else f"mean of steps {first}-{last}"
    return f"critic ({where}): " + "; ".join(parts)


def _lower_or_higher(ratio: float) -> str:
    """``ratio`` = the baseline's variance over the critic's, in words about the critic's."""
    if ratio <= 0:
        return "not comparable"
    return f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x higher"
