"""``ppo-driver report RUN_DIR``: one self-contained HTML page of a run (``RUN_DIR/report.html``).

The reward and held-out accuracy curves, the critic's health (explained variance over steps, by
response position and by turn, its calibration), its advantages against GRPO's and RLOO's, what it
costs, and the step budget as stacked bars, under a header with the run's settings and summary. The
page holds its charts as inline SVG and its style inline: no script, no server, no network.

``data.py`` reads the run folder, ``svg.py`` draws, ``page.py`` lays the page out.
"""

from __future__ import annotations

from pathlib import Path

from ppo_driver.report.data import ReportError, Run, load_run
from ppo_driver.report.page import render

REPORT_FILE = "report.html"


def build_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``<run_dir>/report.html``); return its path.
    :class:`ReportError` (one line naming the path and the fix) when the folder holds no steps."""
    return write_report(load_run(run_dir), out)


def write_report(run: Run, out: str | Path | None = None) -> Path:
    """Write the page of a run already read (:func:`load_run`) to ``out`` (default
    ``<run_dir>/report.html``), its folder made when missing; return the path."""
    path = Path(out) if out is not None else run.run_dir / REPORT_FILE
    page = render(run)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"cannot write {path} ({exc.strerror or exc}); pass another --out") from None
    return path


__all__ = ["REPORT_FILE", "ReportError", "Run", "build_report", "load_run", "render", "write_report"]
