"""A worker's start-up, timed: when its process started, when its own code began, and its setup parts.

A role's start-up is most of a short run's time, and most of it is spent before the worker's code
runs (the process start, Python's and Ray's imports, torch's). Each worker keeps a
:class:`SetupTimer` from its constructor on and reports it; :func:`role_startup` turns the reports of
a role's workers (ranks, engines) into the seconds of each part, from the moment the driver asked for
them. Torch-free: the driver reads its own process's start the same way.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

PROCESS_STARTED_AT = "process_started_at"
INIT_AT = "init_at"


def process_started_at(pid: int | str = "self") -> float | None:
    """When process ``pid`` started, in seconds since the epoch (``/proc``, Linux; else None).

    Resolution: one clock tick (10 ms)."""
    try:
        # Field 22 (starttime, in clock ticks since boot); the command name before it may hold spaces.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        btime = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


class SetupTimer:
    """A worker's setup parts in order (``model``, ``optimizer``, ...), from its constructor on."""

    def __init__(self) -> None:
        self.init_at = time.time()
        self.started_at = process_started_at()
        self.parts: dict[str, float] = {}

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def report(self) -> dict[str, float]:
        """The epochs of the process's start and the constructor's, and each part's seconds."""
        out = {INIT_AT: self.init_at, **{f"{k}_s": v for k, v in self.parts.items()}}
        if self.started_at is not None:
            out[PROCESS_STARTED_AT] = self.started_at
        return out


def role_startup(requested_at: float, reports: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """A role's start-up parts from its workers' reports, as ``{part: seconds}`` (the slowest worker's
    for each part: they start together):

    - ``process start``: from ``requested_at`` (when the driver asked for the workers) to the process's
      start (0 for a process Ray had started ahead);
    - ``imports``: from then to the worker's constructor (Python, Ray's worker, torch and the worker's
      modules); without the process's start time, both are one part, ``process start + imports``;
    - then each part the workers timed (``model``, ``optimizer``, ``cuda graphs``, ...).
    """
    out: dict[str, float] = {}
    for report in reports:
        init_at = float(report[INIT_AT])
        started = report.get(PROCESS_STARTED_AT)
        if started is None:
            _keep_max(out, "process start + imports", init_at - requested_at)
        else:
            begun = max(float(started), requested_at)
            _keep_max(out, "process start", begun - requested_at)
            _keep_max(out, "imports", init_at - begun)
        for key, value in report.items():
            if key.endswith("_s"):
                _keep_max(out, key[: -len("_s")].replace("_", " "), float(value))
    return out


def _keep_max(out: dict[str, float], name: str, seconds: float) -> None:
    out[name] = max(out.get(name, 0.0), max(seconds, 0.0))
