"""The start-up, accounted for like a step (``budget.py``): every second from the command to the first
step, in disjoint parts.

The clock's origin is the driver process's start (``/proc``; the call's own start where that cannot be
read), so Python's start and the imports count. The driver times each part of its start-up on it (the
config, its imports, Ray, the tiny model, the roles, the first weight update, ...); whatever no part
covers is ``other``, so the rows add up to the total. The roles start together on CPU (one after the
other on GPUs), so their own parts -- each worker's process start, imports, model, optimizer, pinned
buffers, CUDA graphs, as its workers timed them (``ppo_lifecycle.startup``) -- are detail under
``roles``, not rows of the sum; so is work that ran alongside a part (the tiny model is written while
Ray starts: a row says how long the driver waited for it after Ray was up, the detail how long it
took).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ppo_lifecycle.startup import process_started_at


@dataclass(frozen=True)
class StartupRow:
    part: str
    at_s: float | None  # when it began, seconds after the command's start (None: ``other``)
    seconds: float


@dataclass(frozen=True)
class StartupTable:
    """The start-up's parts in order, then ``other``; ``total_s`` is the command's start to step 1."""

    rows: tuple[StartupRow, ...]
    total_s: float
    roles: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # role -> part -> seconds
    from_process_start: bool = True  # False: measured from the call (the process's start unknown)
    # part -> {work that ran alongside it -> its own seconds} (detail, not in the sum)
    alongside: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def other_s(self) -> float:
        return next(r.seconds for r in self.rows if r.part == "other")

    def summary(self) -> dict[str, Any]:
        """For ``summary.json``."""
        return {
            "total_s": self.total_s,
            "from_process_start": self.from_process_start,
            "parts": [{"part": r.part, "at_s": r.at_s, "seconds": r.seconds} for r in self.rows],
            "roles": {role: dict(parts) for role, parts in self.roles.items()},
            "alongside": {part: dict(work) for part, work in self.alongside.items()},
        }

    def details(self, part: str) -> list[tuple[str, float]]:
        """The detail rows shown under ``part``: work alongside it; under ``roles``, each role's parts."""
        rows = list(self.alongside.get(part, {}).items())
        if part == "roles":
            rows += [
                (f"{role}: {name}", s) for role, parts in self.roles.items() for name, s in parts.items()
            ]
        return rows


class StartupClock:
    """Times the start-up's parts from ``origin`` (seconds since the epoch) until :meth:`end`."""

    def __init__(self, origin: float | None = None) -> None:
        self.from_process_start = origin is not None
        self.origin = origin if origin is not None else time.time()
        self._rows: list[StartupRow] = []
        self._roles: dict[str, dict[str, float]] = {}
        self._alongside: dict[str, dict[str, float]] = {}

    @classmethod
    def since_process_start(cls) -> StartupClock:
        return cls(process_started_at())

    def since_origin(self, part: str) -> None:
        """``part`` ran from the origin until now (the interpreter's start and the first imports)."""
        self._rows.append(StartupRow(part, 0.0, time.time() - self.origin))

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.time()
        try:
            yield
        finally:
            self._rows.append(StartupRow(name, t0 - self.origin, time.time() - t0))

    def roles(self, parts: Mapping[str, Mapping[str, float]]) -> None:
        """Each role's own start-up parts (the detail under ``roles``)."""
        for role, role_parts in parts.items():
            self._roles.setdefault(role, {}).update(role_parts)

    def alongside(self, part: str, work: str, seconds: float) -> None:
        """``work`` took ``seconds`` while ``part`` ran (detail under ``part``)."""
        self._alongside.setdefault(part, {})[work] = seconds

    def end(self) -> StartupTable:
        """The table now (the first step starts)."""
        total = time.time() - self.origin
        named = sum(r.seconds for r in self._rows)
        rows = (*self._rows, StartupRow("other", None, total - named))
        return StartupTable(rows, total, dict(self._roles), self.from_process_start, dict(self._alongside))


def first_step_ratio(history: Sequence[Mapping[str, Any]]) -> tuple[float, float] | None:
    """(the first step's seconds, its ratio to the mean step after it) from the logged steps'
    ``time/step_s``; None with fewer than two steps. What start-up left to the first step (graph
    captures, first kernel loads) shows as a ratio above 1."""
    steps = [float(r["time/step_s"]) for r in history if isinstance(r.get("time/step_s"), int | float)]
    if len(steps) < 2:
        return None
    return steps[0], steps[0] / statistics.fmean(steps[1:])
