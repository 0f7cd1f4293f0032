"""Each nox session's wall time, as a table at the end of ``uv run nox`` and in ``.nox/durations.md``.

``noxfile.py`` wraps every session function in :func:`timed`. Each session's row (its name, seconds
from its first install to its end, its result) is rewritten to the file as soon as the session ends, so
a CI run cut short still leaves the rows of the sessions it finished; when nox exits, the whole table
is printed after nox's own summary, the slowest session first. Creating a session's empty venv (under a
second with uv) happens before the function starts and is not counted. Standard library only.
"""

from __future__ import annotations

import atexit
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class _Session(Protocol):
    name: str


@dataclass(frozen=True)
class Row:
    session: str
    seconds: float
    result: str  # success, failed, skipped, interrupted


@dataclass
class SessionTimes:
    """The rows of one nox invocation, written to ``path`` after every session."""

    path: Path
    print_at_exit: bool = True  # False: only the file (the tests of this module)
    rows: list[Row] = field(default_factory=list)
    _printing: bool = False

    def add(self, row: Row) -> None:
        self.rows.append(row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(self.table())

    def table(self) -> str:
        total = sum(r.seconds for r in self.rows)
        lines = ["| session | seconds | minutes | result |", "|---|---:|---:|---|"]
        for r in sorted(self.rows, key=lambda r: -r.seconds):
            lines.append(f"| {r.session} | {r.seconds:.0f} | {r.seconds / 60:.1f} | {r.result} |")
        lines.append(f"| **total** | {total:.0f} | {total / 60:.1f} | |")
        return "\n".join(lines) + "\n"

    def print_table(self) -> None:
        if self.rows:
            print(f"\nsession durations (also in {self.path}):\n{self.table()}", file=sys.stderr, flush=True)

    def timed(self, func: Callable[..., None]) -> Callable[..., None]:
        """``func`` (a nox session function), timed; its row is added however it ends."""

        @functools.wraps(func)
        def run(session: _Session, *args: Any, **kwargs: Any) -> None:
            if self.print_at_exit and not self._printing:  # the first session: the table printed at exit
                atexit.register(self.print_table)
                self._printing = True
            start = time.monotonic()
            result = "failed"
            try:
                func(session, *args, **kwargs)
                result = "success"
            except KeyboardInterrupt:
                result = "interrupted"
                raise
            except BaseException as exc:
                if "Skip" in type(exc).__name__:  # nox's session.skip()
                    result = "skipped"
                raise
            finally:
                self.add(Row(session.name, time.monotonic() - start, result))

        return run
