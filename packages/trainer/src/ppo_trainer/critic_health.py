"""Critic health: how well the critic's values predict the returns, and what its baseline buys.

Measured every step on the values the critic computed *before* it trains on the step (the ones GAE
and the actor use), so the numbers say how well it predicts, not how well it fits. Every metric is a
token-weighted (or sample-weighted) statistic of the whole step's batch over all data-parallel
ranks, computed the one exact way: each rank adds up sums (``sum w``, ``sum w x``, ``sum w x^2``, ...)
over its samples, the sums are added over the ranks in one collective, and only then are means,
variances and ratios formed (:func:`finalize`). Averaging per-micro-batch or per-rank ratios instead
would weight a short micro-batch like a long one (RLinf #1297). The critic's forward passes run per
micro-batch, but its values come back as one ``[N, R_max]`` tensor per rank (``objective.score``):
the sums span every micro-batch of the rank by construction.

The formula: over the loss-mask (generated) tokens of the step, with weights ``w``,

    Var_w(x) = sum w x^2 / sum w - (sum w x / sum w)^2
    EV       = 1 - Var_w(R - V) / Var_w(R)

(verl's ``critic/vf_explained_var`` is the same ratio of whole-batch variances, with ``1e-5`` added
to the denominator; this module leaves out a statistic whose denominator is 0 instead.)

The metrics (the driver logs them under ``critic/``):

- ``explained_variance``; ``ev_pos_0`` .. ``ev_pos_9``: the same over the tokens in each tenth of
  their own response (by the token's index over its response's length); ``ev_turn_1`` .. : per turn
  of multi-turn samples (``turn_ids``; turn ``MAX_TURNS`` holds it and every later turn);
- ``calib_value_d0`` .. ``d9`` and ``calib_return_d0`` .. ``d9``: the mean value and the mean return
  of the tokens in each decile of the values (deciles of a ``HISTOGRAM_BINS``-bin histogram between
  the step's smallest and largest value; a bin is never split, so a decile that a single bin swallows
  is absent);
- ``first_value_vs_score_corr`` and ``first_value_score_abs_gap``: over samples, the Pearson
  correlation and the mean absolute gap between the value before the first response token and the
  sample's score (outcome reward plus per-turn rewards);
- with several samples per prompt on the rank, ``adv_var_ratio_<b>`` and ``adv_corr_<b>`` for the
  group baselines ``b`` in ``BASELINES``: the variance of the advantages the baseline would have given
  over the variance of the critic's GAE advantages (before whitening; both in reward units), and
  their correlation, token-weighted over the samples whose prompt has two or more samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ppo_trainer import estimators

if TYPE_CHECKING:
    from ppo_trainer.batch import Samples

POSITION_BUCKETS = 10
MAX_TURNS = 8
DECILES = 10
HISTOGRAM_BINS = 256
# The group baselines compared with the critic's, as the estimator table names them (``estimators``).
BASELINES: tuple[str, ...] = ("grpo", "rloo")

_EV = 5  # sum w, sum w R, sum w R^2, sum w D, sum w D^2 (D = R - V)
_FIRST = 7  # n, sum v, sum s, sum v^2, sum s^2, sum v s, sum |v - s|


class Reducer(Protocol):
    """Where this rank sits and how to sum a tensor over the ranks (``backend_protocol.DataParallel``)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class HealthInputs:
    """One rank's share of the step, ``[N, R_max]`` unless said: the critic's ``values`` before its
    update, the GAE ``returns`` and ``advantages`` (before whitening), the ``loss_mask`` (the tokens
    that count), the ``response_mask``, the ``turn_ids``, the samples' ``scores`` ``[N]``, and per group
    baseline its advantages (``baselines``) with ``grouped`` ``[N]``: the samples whose prompt has two or
    more samples on this rank (empty ``baselines``: no comparison)."""

    values: torch.Tensor
    returns: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    response_mask: torch.Tensor
    turn_ids: torch.Tensor
    scores: torch.Tensor
    baselines: Mapping[str, torch.Tensor]
    grouped: torch.Tensor


def inputs_of(
    samples: Samples, values: torch.Tensor, returns: torch.Tensor, advantages: torch.Tensor
) -> HealthInputs:
    """The critic's step as :class:`HealthInputs`: the scores and the group baselines' advantages
    from the estimator table (``estimators.baseline_advantages``) when a prompt has two or more
    samples on this rank."""
    _, inverse, counts = torch.unique(samples.prompt_index, return_inverse=True, return_counts=True)
    grouped = counts[inverse] > 1
    baselines = estimators.baseline_advantages(samples, BASELINES) if bool(grouped.any()) else {}
    return HealthInputs(
        values=values,
        returns=returns,
        advantages=advantages,
        loss_mask=samples.loss_mask,
        response_mask=samples.response_mask,
        turn_ids=samples.turn_ids,
        scores=estimators.sample_scores(samples),
        baselines=baselines,
        grouped=grouped,
    )


# ---------------------------------------------------------------------------------- the sums
def _grouped_ev_sums(
    values: torch.Tensor, returns: torch.Tensor, w: torch.Tensor, pos: torch.Tensor, turns: torch.Tensor
) -> torch.Tensor:
    """``[(1 + POSITION_BUCKETS + MAX_TURNS) * _EV]``: the ``_EV`` sums of the whole step, then of each
    position bucket (``pos``), then of each turn (``turns``, already clamped), all float64.

    One pass over the tokens: each token's row of ``_EV`` terms is added into its (position, turn) cell,
    and every group's sums are sums of cells (a token lies in exactly one cell)."""
    d = returns - values
    rows = torch.stack([w, w * returns, w * returns**2, w * d, w * d**2], dim=-1).reshape(-1, _EV)
    cell = (pos * MAX_TURNS + turns).reshape(-1)
    cells = torch.zeros(POSITION_BUCKETS * MAX_TURNS, _EV, dtype=torch.float64).index_add_(0, cell, rows)
    cells = cells.reshape(POSITION_BUCKETS, MAX_TURNS, _EV)
    return torch.cat([cells.sum(dim=(0, 1))[None], cells.sum(dim=1), cells.sum(dim=0)]).reshape(-1)


def positions(response_mask: torch.Tensor) -> torch.Tensor:
    """Each response token's tenth of its own response, ``[N, R_max]`` int64 (0 .. 9; 0 on padding)."""
    lengths = response_mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    index = torch.arange(response_mask.shape[1], dtype=torch.float64).expand_as(response_mask)
    bucket = torch.floor(index * POSITION_BUCKETS / lengths).clamp(max=POSITION_BUCKETS - 1)
    return (bucket * response_mask).to(torch.int64)


def _first_sums(values: torch.Tensor, response_mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    has = response_mask[:, 0] if response_mask.shape[1] else torch.zeros_like(scores)
    v = values[:, 0] * has if values.shape[1] else torch.zeros_like(scores)
    s = scores * has
    return torch.stack(
        [has.sum(), v.sum(), s.sum(), (v * v).sum(), (s * s).sum(), (v * s).sum(), (v - s).abs().sum()]
    )


def _value_range(dp: Reducer, values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float] | None:
    """The smallest and largest value on the masked tokens of every rank (None: no such token)."""
    slots = torch.zeros(dp.world_size, 3, dtype=torch.float64)
    kept = values[mask != 0]
    if kept.numel():
        slots[dp.rank] = torch.stack([torch.ones((), dtype=torch.float64), kept.min(), kept.max()])
    slots = dp.all_reduce(slots)
    present = slots[slots[:, 0] > 0]
    if not len(present):
        return None
    return float(present[:, 1].min()), float(present[:, 2].max())


def _histogram(
    values: torch.Tensor, returns: torch.Tensor, w: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """``[HISTOGRAM_BINS, 3]``: per bin of the values between ``lo`` and ``hi``, sum w, sum w V, sum w R."""
    span = hi - lo
    scaled = (values - lo) / span * HISTOGRAM_BINS if span > 0 else torch.zeros_like(values)
    index = scaled.floor().clamp(0, HISTOGRAM_BINS - 1).to(torch.int64).reshape(-1)
    out = torch.zeros(HISTOGRAM_BINS, 3, dtype=torch.float64)
    rows = torch.stack([w, w * values, w * returns], dim=-1).reshape(-1, 3)
    return out.index_add_(0, index, rows)


def _advantage_sums(inputs: HealthInputs) -> torch.Tensor:
    """``[3 + 3 * len(BASELINES)]``: sum w, sum w A, sum w A^2, then per baseline sum w G, sum w G^2,
    sum w A G over the loss tokens of the grouped samples (zeros without baselines)."""
    out = torch.zeros(3 + 3 * len(BASELINES), dtype=torch.float64)
    if not inputs.baselines:
        return out
    w = inputs.loss_mask * inputs.grouped.to(torch.float64)[:, None]
    a = inputs.advantages
    out[:3] = torch.stack([w.sum(), (w * a).sum(), (w * a * a).sum()])
    for i, name in enumerate(BASELINES):
        g = inputs.baselines[name].to(torch.float64)
        out[3 + 3 * i : 6 + 3 * i] = torch.stack([(w * g).sum(), (w * g * g).sum(), (w * a * g).sum()])
    return out


def local_sums(inputs: HealthInputs, value_range: tuple[float, float]) -> torch.Tensor:
    """This rank's sums, one flat float64 tensor: adding the tensors of any split of the samples (micro-
    batches, ranks) gives the tensor of the whole, which :func:`finalize` turns into the metrics."""
    v, r = inputs.values.to(torch.float64), inputs.returns.to(torch.float64)
    w = inputs.loss_mask.to(torch.float64)
    pos = positions(inputs.response_mask)
    turns = inputs.turn_ids.clamp(max=MAX_TURNS - 1)
    parts = [_grouped_ev_sums(v, r, w, pos, turns)]
    scores = inputs.scores.to(torch.float64)
    parts.append(_first_sums(v, inputs.response_mask.to(torch.float64), scores))
    parts.append(_histogram(v, r, w, *value_range).reshape(-1))
    parts.append(_advantage_sums(_as_float64(inputs)))
    return torch.cat(parts)


def _as_float64(inputs: HealthInputs) -> HealthInputs:
    return HealthInputs(
        values=inputs.values.to(torch.float64),
        returns=inputs.returns.to(torch.float64),
        advantages=inputs.advantages.to(torch.float64),
        loss_mask=inputs.loss_mask.to(torch.float64),
        response_mask=inputs.response_mask,
        turn_ids=inputs.turn_ids,
        scores=inputs.scores,
        baselines=inputs.baselines,
        grouped=inputs.grouped,
    )


# ---------------------------------------------------------------------------------- the metrics
def explained_variance(sums: torch.Tensor) -> float | None:
    """``1 - Var_w(R - V) / Var_w(R)`` from ``[_EV]`` sums; None without tokens or without variance."""
    n, r1, r2, d1, d2 = sums.to(torch.float64).tolist()
    if n <= 0:
        return None
    var_r = r2 / n - (r1 / n) ** 2
    var_d = d2 / n - (d1 / n) ** 2
    if var_r <= 1e-12 * max(1.0, r2 / n):
        return None
    return 1.0 - var_d / var_r


def _pearson(n: float, x1: float, y1: float, x2: float, y2: float, xy: float) -> float | None:
    if n <= 0:
        return None
    vx, vy = x2 / n - (x1 / n) ** 2, y2 / n - (y1 / n) ** 2
    if vx <= 1e-12 or vy <= 1e-12:
        return None
    return (xy / n - x1 * y1 / n**2) / (vx * vy) ** 0.5


def finalize(sums: torch.Tensor) -> dict[str, float]:
    """The metrics from the sums of every rank (:func:`local_sums`, added up)."""
    s = sums.detach().to(torch.float64).cpu()
    out: dict[str, float] = {}
    at = 0

    def take(k: int) -> torch.Tensor:
        nonlocal at
        at += k
        return s[at - k : at]

    def put(name: str, value: float | None) -> None:
        if value is not None:
            out[name] = value

    put("explained_variance", explained_variance(take(_EV)))
    for b in range(POSITION_BUCKETS):
        put(f"ev_pos_{b}", explained_variance(take(_EV)))
    turns = [take(_EV) for _ in range(MAX_TURNS)]
    if any(float(t[0]) > 0 for t in turns[1:]):  # multi-turn samples in the step
        for t, part in enumerate(turns):
            put(f"ev_turn_{t + 1}", explained_variance(part))
    n, v1, s1, v2, s2, vs, gap = take(_FIRST).tolist()
    put("first_value_vs_score_corr", _pearson(n, v1, s1, v2, s2, vs))
    put("first_value_score_abs_gap", gap / n if n > 0 else None)
    out |= _calibration(take(3 * HISTOGRAM_BINS).reshape(HISTOGRAM_BINS, 3))
    out |= _advantage_metrics(take(3 + 3 * len(BASELINES)).tolist())
    return out


def _calibration(hist: torch.Tensor) -> dict[str, float]:
    total = float(hist[:, 0].sum())
    if total <= 0:
        return {}
    start = torch.cumsum(hist[:, 0], 0) - hist[:, 0]  # the weight below each bin
    decile = torch.floor(start / total * DECILES).clamp(max=DECILES - 1).to(torch.int64)
    per = torch.zeros(DECILES, 3, dtype=torch.float64).index_add_(0, decile, hist)
    out: dict[str, float] = {}
    for d in range(DECILES):
        w = float(per[d, 0])
        if w > 0:
            out[f"calib_value_d{d}"] = float(per[d, 1]) / w
            out[f"calib_return_d{d}"] = float(per[d, 2]) / w
    return out


def _advantage_metrics(s: list[float]) -> dict[str, float]:
    n, a1, a2 = s[:3]
    if n <= 0:
        return {}
    var_a = a2 / n - (a1 / n) ** 2
    out: dict[str, float] = {}
    for i, name in enumerate(BASELINES):
        g1, g2, ag = s[3 + 3 * i : 6 + 3 * i]
        var_g = g2 / n - (g1 / n) ** 2
        if var_a > 1e-12:
            out[f"adv_var_ratio_{name}"] = var_g / var_a
        corr = _pearson(n, a1, g1, a2, g2, ag)
        if corr is not None:
            out[f"adv_corr_{name}"] = corr
    return out


def critic_health(dp: Reducer, inputs: HealthInputs) -> dict[str, float]:
    """The step's critic-health metrics over every rank (two collectives: the values' range, then
    every sum at once). Every rank must call it (each collective is a rendezvous)."""
    value_range = _value_range(dp, inputs.values.to(torch.float64), inputs.loss_mask)
    sums = local_sums(inputs, value_range or (0.0, 0.0))
    return finalize(dp.all_reduce(sums))


__all__ = [
    "BASELINES",
    "HISTOGRAM_BINS",
    "MAX_TURNS",
    "POSITION_BUCKETS",
    "HealthInputs",
    "Reducer",
    "critic_health",
    "explained_variance",
    "finalize",
    "inputs_of",
    "local_sums",
    "positions",
]
