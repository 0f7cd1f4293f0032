"""The step budget: where every second of a step went, as disjoint parts that add up to the step.

The loop times each phase (generate, critic_train, ...) and every sleep and wake inside it with one
:class:`StepClock`. A part timed inside another is carved out of it (a profiler's *self* time), so
the parts never overlap: the engines' offload that ``critic_train`` triggers is ``engines/sleep``,
not ``critic_train``. Seconds a worker measured inside a driver call (the critic's ``put`` of its
values, the actor's ``get`` of them) are carved out the same way with :meth:`StepClock.carve`.
Whatever no named part covers (the loop's own bookkeeping, metric calls) is ``other``, so the
table always adds up to the step.

Per-step keys (every one present in every step, 0 where a part did not run):

* ``time/<part>_s`` for the parts :func:`parts_for` lists (``time/actor/sleep_s``,
  ``time/engines/wake_s``, ``time/handoff_s``, ``time/weight_update_s``, ...), ``time/other_s`` and
  ``time/step_s``;
* ``bytes/<role>/sleep`` and ``bytes/<role>/wake`` for each role (``actor``, ``critic``,
  ``engines``), ``bytes/handoff`` and ``bytes/weight_update``;
* ``time/<role>/<action>_hidden_s`` for each transition: its own seconds that ran in the background
  while the loop did other work (``offload.overlap``, ``phases.py``); 0 in the sequential order. Not
  a part of the step: those seconds are inside other parts (``generate``, ``critic_train``, ...);
* ``time/overhead_fraction`` = (every sleep and wake + weight update + handoff) / step, where the
  step leaves out ``check_weights`` (a check the run asked for, not part of the method). A sleep's or
  wake's part is the time the loop waited for it (all of it in the sequential order; with overlap,
  the wait when its phase needed it, plus the actor's foreground disconnect before a background
  sleep): hidden seconds are not overhead, since the step did not get longer for them.

The table's GB/s of a transition is its bytes over its own seconds (part + hidden).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# The roles that sleep and wake, as the budget names them (the plan's "rollout" is "engines").
ROLES: tuple[str, ...] = ("actor", "critic", "engines")
# Compute and I/O phases of the loop, in step order.
WORK: tuple[str, ...] = ("generate", "critic_train", "actor_train", "save", "generate_wait", "eval")
# Checks a run asked for (``train.check_weights``): neither work nor overhead of the method itself.
CHECKS: tuple[str, ...] = ("check_weights",)
# The cost of taking turns: moving models on and off the GPUs, the weight update, the value handoff.
TRANSFER: tuple[str, ...] = ("weight_update", "handoff")
# The loop's phases that also keep their older inclusive key ``time/<phase>`` (transitions included).
PHASES: tuple[str, ...] = (*WORK, "weight_update")


def transition_parts(roles: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{role}/{action}" for role in roles for action in ("sleep", "wake"))


def parts_for(roles: Sequence[str]) -> tuple[str, ...]:
    """Every named part of a step for a run with these roles, in table order."""
    return (*WORK, *transition_parts(roles), *TRANSFER, *CHECKS)


def budget_role(plan_role: str) -> str:
    """The offload plan's role name as the budget spells it."""
    return "engines" if plan_role == "rollout" else plan_role


class StepClock:
    """Disjoint seconds of one step's parts; a part timed inside another is carved out of it.

    Used from the loop's thread only (the one-step-off prefetch thread never touches it).
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self._self: dict[str, float] = {}
        self._total: dict[str, float] = {}  # each part's wall time, nested parts included
        self._open: list[list[Any]] = []  # [name, seconds carved out of it so far]

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self._open.append([name, 0.0])
        try:
            yield
        finally:
            _, carved = self._open.pop()
            total = time.perf_counter() - t0
            self._self[name] = self._self.get(name, 0.0) + max(total - carved, 0.0)
            self._total[name] = self._total.get(name, 0.0) + total
            if self._open:
                self._open[-1][1] += total

    def carve(self, name: str, seconds: float) -> None:
        """Book ``seconds`` that a worker measured inside the open span as ``name`` instead.

        Outside any span the seconds are booked as they are (and reduce ``other``).
        """
        seconds = max(float(seconds), 0.0)
        self._self[name] = self._self.get(name, 0.0) + seconds
        if self._open:
            self._open[-1][1] += seconds

    def seconds(self) -> dict[str, float]:
        """Each part's own seconds so far (nested parts and carved seconds taken out)."""
        return dict(self._self)

    def totals(self) -> dict[str, float]:
        """Each part's wall seconds, nested parts included (the older ``time/<phase>`` keys)."""
        return dict(self._total)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@dataclass(frozen=True)
class StepBytes:
    """Bytes moved in one step: per role and action (``"actor/sleep"``), the handoff, the update."""

    transitions: Mapping[str, float]
    handoff: float = 0.0
    weight_update: float = 0.0


def step_metrics(
    clock: StepClock,
    roles: Sequence[str],
    moved: StepBytes,
    hidden: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The budget keys of one step (see the module docstring); call at the very end of the step.
    ``hidden``: per transition (``"actor/sleep"``), its seconds that ran under other work."""
    step_s = clock.elapsed()
    own = clock.seconds()
    parts = parts_for(roles)
    unknown = sorted(set(own) - set(parts))
    if unknown:
        raise ValueError(f"step budget: parts {unknown} are not in the budget's list {list(parts)}")
    out: dict[str, float] = {f"time/{p}_s": own.get(p, 0.0) for p in parts}
    out["time/other_s"] = step_s - sum(own.values())
    out["time/step_s"] = step_s
    hidden = hidden or {}
    unknown = sorted(set(hidden) - set(transition_parts(roles)))
    if unknown:
        raise ValueError(f"step budget: hidden seconds of {unknown}, which are no transitions of this run")
    for part in transition_parts(roles):
        out[f"bytes/{part}"] = float(moved.transitions.get(part, 0.0))
        out[f"time/{part}_hidden_s"] = float(hidden.get(part, 0.0))
    out["bytes/handoff"] = float(moved.handoff)
    out["bytes/weight_update"] = float(moved.weight_update)
    overhead = sum(own.get(p, 0.0) for p in (*transition_parts(roles), *TRANSFER))
    # The checks a run asked for are not part of the method's step: left out of the denominator.
    method_s = step_s - sum(own.get(p, 0.0) for p in CHECKS)
    out["time/overhead_fraction"] = overhead / method_s if method_s > 0 else 0.0
    return out


# --- the table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetRow:
    part: str
    first_s: float
    mean_s: float | None  # steps after the first; None for a one-step run
    first_share: float
    mean_share: float | None
    first_bytes: float | None = None  # None: a part that moves no counted bytes
    mean_bytes: float | None = None
    first_hidden_s: float | None = None  # None: not a transition (nothing of it runs hidden)
    mean_hidden_s: float | None = None

    @property
    def gb_per_s(self) -> float | None:
        """The mean step's bytes over its own seconds (part + hidden; the first step's for a one-step
        run)."""
        if self.mean_s is not None:
            nbytes, seconds = self.mean_bytes, self.mean_s + (self.mean_hidden_s or 0.0)
        else:
            nbytes, seconds = self.first_bytes, self.first_s + (self.first_hidden_s or 0.0)
        return nbytes / seconds / 1e9 if nbytes and seconds else None


def bytes_key(part: str) -> str | None:
    """The ``bytes/...`` key of a part that moves data (transitions, weight update, handoff), else None."""
    return f"bytes/{part}" if "/" in part or part in TRANSFER else None


def budget_rows(history: Sequence[Mapping[str, Any]]) -> list[BudgetRow]:
    """Rows of the budget table from ``metrics.jsonl`` records: every part a step of the run had
    (transitions of roles the run has, the named phases), then ``other``, then ``step``.

    The first step is its own column (it creates optimizer state and warms caches); the mean is over
    the steps after it. A part that is 0 in every step is left out, except ``other`` and ``step``.
    """
    records = [r for r in history if isinstance(r.get("time/step_s"), int | float)]
    if not records:
        return []
    first, rest = records[0], records[1:]
    # The budget's own parts only: another ``time/..._s`` key in a record is not a part of the sum.
    parts = [
        p
        for p in parts_for(ROLES)
        if any(r.get(f"time/{p}_s", 0.0) > 0 or r.get(f"time/{p}_hidden_s", 0.0) > 0 for r in records)
    ]
    rows = []
    first_step = float(first["time/step_s"])
    mean_step = statistics.fmean(float(r["time/step_s"]) for r in rest) if rest else None
    for part in (*parts, "other", "step"):
        a = float(first.get(f"time/{part}_s", 0.0))
        b = statistics.fmean(float(r.get(f"time/{part}_s", 0.0)) for r in rest) if rest else None
        key = bytes_key(part)
        hidden_key = f"time/{part}_hidden_s" if part in transition_parts(ROLES) else None
        rows.append(
            BudgetRow(
                part=part,
                first_s=a,
                mean_s=b,
                first_share=a / first_step if first_step > 0 else 0.0,
                mean_share=(b / mean_step) if b is not None and mean_step else None,
                first_bytes=float(first.get(key, 0.0)) if key else None,
                mean_bytes=statistics.fmean(float(r.get(key, 0.0)) for r in rest) if key and rest else None,
                first_hidden_s=float(first.get(hidden_key, 0.0)) if hidden_key else None,
                mean_hidden_s=(
                    statistics.fmean(float(r.get(hidden_key, 0.0)) for r in rest)
                    if hidden_key and rest
                    else None
                ),
            )
        )
    return rows


def overhead_means(history: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """``time/overhead_fraction`` of the first step and the mean over the steps after it."""
    values = [float(r["time/overhead_fraction"]) for r in history if "time/overhead_fraction" in r]
    if not values:
        return None, None
    return values[0], (statistics.fmean(values[1:]) if len(values) > 1 else None)


def summary(history: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The budget for ``summary.json``: seconds and share of each part, first step and mean after it."""
    rows = budget_rows(history)
    first, mean = overhead_means(history)
    return {
        "parts": [
            {
                "part": r.part,
                "first_step_s": r.first_s,
                "first_step_share": r.first_share,
                "mean_s": r.mean_s,
                "mean_share": r.mean_share,
                "first_step_bytes": r.first_bytes,
                "mean_bytes": r.mean_bytes,
                "first_step_hidden_s": r.first_hidden_s,
                "mean_hidden_s": r.mean_hidden_s,
            }
            for r in rows
        ],
        "overhead_fraction": {"first_step": first, "mean": mean},
    }


def phase_tflops(history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each training phase's achieved TFLOP/s (its role's ``tflops`` metric: rank 0's, from the
    tokens and the model's size, ``ppo_trainer.throughput``), the mean over the steps after the first
    (the first's for a one-step run); phases that did not run are left out."""
    out: dict[str, float] = {}
    for phase, key in (("critic_train", "critic/tflops"), ("actor_train", "actor/tflops")):
        values = [float(r[key]) for r in history if isinstance(r.get(key), int | float)]
        if values:
            out[phase] = statistics.fmean(values[1:] or values)
    return out


def markdown_table(history: Sequence[Mapping[str, Any]]) -> str:
    """The budget table in Markdown (the benchmark pages under docs/benchmarks take it as it is)."""
    rows = budget_rows(history)
    lines = [
        "| part | first step s | share | MB | mean s (steps 2+) | share | MB | GB/s | hidden s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = f"**{row.part}**" if row.part == "step" else row.part
        lines.append(
            f"| {name} | {row.first_s:.3f} | {row.first_share:.1%} | {_mb(row.first_bytes)} | "
            f"{_num(row.mean_s, '.3f')} | {_num(row.mean_share, '.1%')} | {_mb(row.mean_bytes)} | "
            f"{_num(row.gb_per_s, '.2f')} | {_hidden(row)} |"
        )
    first, mean = overhead_means(history)
    lines.append(
        f"| overhead (sleeps + wakes + weight update + handoff) | | {_num(first, '.1%')} | | | "
        f"{_num(mean, '.1%')} | | | |"
    )
    return "\n".join(lines)


def _hidden(row: BudgetRow) -> str:
    """A transition's hidden seconds (the mean's; the first step's for a one-step run), else blank."""
    value = row.mean_hidden_s if row.mean_s is not None else row.first_hidden_s
    return "" if value is None else f"{value:.3f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mb(nbytes: float | None) -> str:
    return "" if nbytes is None else f"{nbytes / 1e6:.1f}"
