"""Per-step metrics: ``metrics.jsonl`` in the run folder, TensorBoard when installed, a progress bar.

One JSON object per line and step: ``{"step": 3, "reward/mean": 0.4, "actor/loss": ..., ...}``.
Numbers are logged to TensorBoard too; lists (the sleep/wake transitions of the step) only to JSONL.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ppo_driver import critic_report
from ppo_driver.budget import budget_rows, overhead_means, phase_tflops
from ppo_driver.startup import StartupTable, first_step_ratio

METRICS_FILE = "metrics.jsonl"
# Start-up parts that only a GPU run has (a CPU engine reports 0 s for them).
_GPU_ONLY_PARTS = ("cuda graphs",)

# What the progress line shows, in order, when the step has it.
SHOWN = (
    ("rollout/reward_mean", "reward"),
    ("actor/loss", "actor loss"),
    ("critic/loss", "critic loss"),
    ("actor/ppo_kl", "kl"),
    ("time/step", "step s"),
)


class _Scalars(Protocol):
    def add_scalar(self, tag: str, value: float, step: int) -> None: ...
    def close(self) -> None: ...


def _tensorboard_writer(folder: Path) -> _Scalars | None:
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    except ImportError:
        return None
    writer: _Scalars = SummaryWriter(log_dir=str(folder))
    return writer


class CutLastLineWarning(UserWarning):
    """The last line of ``metrics.jsonl`` was cut short (a process killed mid-write); it is dropped."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the run folder that `ppo-driver train` wrote")
    return parse_lines(path)


def parse_lines(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``. A last line that does not parse is what a kill during a
    write leaves: it is dropped with a ``CutLastLineWarning``. A bad line before it is an error."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"a {type(record).__name__}, not an object")
        except ValueError as exc:
            if number == len(lines):
                message = f"{path}: the last line is cut short ({exc}); dropped it"
                warnings.warn(message, CutLastLineWarning, stacklevel=2)
                break
            raise ValueError(
                f"{path}, line {number}: not a JSON object ({exc}); remove or repair that line"
            ) from None
        records.append(record)
    return records


class MetricsLog:
    """Appends one line per step to ``metrics.jsonl`` (kept on resume, from the resumed step on)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, start_step: int = 0) -> None:
        self.path = run_dir / METRICS_FILE
        run_dir.mkdir(parents=True, exist_ok=True)
        # A resumed run rewrites the steps after its checkpoint: drop the lines it will write again.
        if self.path.exists():
            kept = [r for r in parse_lines(self.path) if r.get("step", 0) <= start_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            with tmp.open("w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in kept))
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)  # a kill during this rewrite leaves the old file whole
        self._file = self.path.open("a")
        self._tb = _tensorboard_writer(run_dir / "tensorboard") if tensorboard else None
        self.history: list[dict[str, Any]] = []

    @property
    def tensorboard_enabled(self) -> bool:
        return self._tb is not None

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": step, **metrics}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()
        self.history.append(record)
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._tb.add_scalar(key, float(value), step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    return str(obj)


def format_step(metrics: Mapping[str, Any]) -> str:
    parts = []
    for key, label in SHOWN:
        value = metrics.get(key)
        if isinstance(value, int | float) and math.isfinite(value):
            parts.append(f"{label} {value:.3f}" if key != "time/step" else f"{label} {value:.2f}")
    return "  ".join(parts)


class StepProgress:
    """A rich progress bar on a terminal; one plain line per step otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, start: int = 0, *, console: Console | None = None, enabled: bool = True):
        self.console = console or Console()
        self.enabled = enabled
        self.total = total
        self._live = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        if self._live:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        info = format_step(metrics)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, info=info)
        elif self.enabled:
            self.console.print(f"step {step}/{self.total}  {info}", highlight=False)


# Held-out evaluation (ppo_rollout's RolloutManager.evaluate): greedy, then with the training sampling.
EVAL_SHOWN = (
    ("eval/reward_mean", "eval reward"),
    ("eval/accuracy", "eval accuracy"),
    ("eval/sampled_accuracy", "eval accuracy, sampled"),
    ("eval/response_length_mean", "eval response length"),
)


def summary_table(history: list[dict[str, Any]], run_dir: Path, window: int = 5) -> Table:
    """First and last ``window`` steps' means of the main metrics, and where the files are."""
    table = Table(title=f"run summary: {run_dir}", show_header=True)
    table.add_column("metric")
    table.add_column(f"first {window} steps", justify="right")
    table.add_column(f"last {window} steps", justify="right")
    first, last = history[:window], history[-window:]
    for key, label in (*SHOWN, *EVAL_SHOWN):
        a, b = _mean(first, key), _mean(last, key)
        if a is None and b is None:
            continue
        table.add_row(label, _fmt(a), _fmt(b))
    steps = [r["step"] for r in history]
    table.caption = (
        f"steps {steps[0]}-{steps[-1]}; metrics: {run_dir / METRICS_FILE}; plot: ppo-driver plot {run_dir}"
        if steps
        else "no steps ran"
    )
    critic = critic_report.summary_line(history, window)
    if critic is not None:
        table.caption += f"\n{critic}"
    return table


def budget_table(history: list[dict[str, Any]], device: str = "cuda") -> Table:
    """Where the step's seconds went (``budget.py``): each part's seconds and share of the step, the
    first step on its own (it creates the optimizer state and warms caches) and the mean after it.
    ``other`` is the step time no named part covers, so the column adds up to ``step``. Short headers
    and no empty column, so the table fits 80 columns whole (a part's name is never cut); the caption
    says what each column is. ``device``: where the roles train (TFLOP/s are per GPU or per CPU rank)."""
    table = Table(title="step budget", show_header=True, box=box.SIMPLE_HEAD, pad_edge=False)
    tflops = phase_tflops(history)
    cells: list[list[str]] = []
    rows = budget_rows(history)
    for row in rows:
        nbytes = row.mean_bytes if row.mean_s is not None else row.first_bytes
        hidden = row.mean_hidden_s if row.mean_s is not None else row.first_hidden_s
        cells.append(
            [
                row.part,
                f"{row.first_s:.3f}",
                f"{row.first_share:.1%}",
                "-" if row.mean_s is None else f"{row.mean_s:.3f}",
                "-" if row.mean_share is None else f"{row.mean_share:.1%}",
                "" if nbytes is None else f"{nbytes / 1e6:.1f}",
                "" if row.gb_per_s is None else f"{row.gb_per_s:.2f}",
                "" if hidden is None else f"{hidden:.3f}",
                f"{tflops[row.part]:.3g}" if row.part in tflops else "",
            ]
        )
    headers = ("part", "1st s", "share", "2+ s", "share", "MB", "GB/s", "hid s", "TFLOP/s")
    # A column with no value in any row is left out (no bytes moved, no TFLOP/s measured).
    kept = [i for i in range(len(headers)) if i < 5 or any(c[i] for c in cells)]
    longest = max((len(c[0]) for c in cells), default=4)
    for i in kept:
        if i == 0:
            table.add_column(headers[i], no_wrap=True, min_width=longest)
        else:
            table.add_column(headers[i], justify="right", no_wrap=True)
    for row, values in zip(rows, cells, strict=True):
        table.add_row(*(values[i] for i in kept), end_section=row.part == "other")
    table.caption = _budget_caption(history, device, shown={headers[i] for i in kept})
    return table


def _budget_caption(history: list[dict[str, Any]], device: str, shown: set[str]) -> str:
    first, mean = overhead_means(history)
    parts = [
        "1st s: the first step; 2+ s: the mean of the steps after it; share: of the step",
        "overhead (sleeps + wakes + weight update + handoff): "
        f"{'-' if first is None else f'{first:.1%}'} of the first step, "
        f"{'-' if mean is None else f'{mean:.1%}'} of the steps after it (a transition's seconds: the "
        "loop's wait for it)",
    ]
    if "hid s" in shown:
        parts.append("hid s: a transition's seconds under other work, not in the step's sum")
    if "MB" in shown:
        parts.append(
            "MB and GB/s (over part + hidden seconds): the steps after the first (actor and critic: "
            "rank 0's bytes)"
        )
    if "TFLOP/s" in shown:
        per = "per GPU" if device == "cuda" else "per CPU rank (no GPU in this run)"
        parts.append(
            "TFLOP/s: a training phase's model FLOPs (6 x parameters x tokens a pass) over its own "
            f"compute seconds, {per}"
        )
    return "; ".join(parts)


def startup_table(startup: StartupTable, history: list[dict[str, Any]], device: str = "cuda") -> Table:
    """Where the seconds from the command to the first step went (``startup.py``): each part, its share
    and when it began; ``other`` is what no part covers, so the column adds up to the total. Under
    ``roles``, each role's own parts as its workers timed them (the roles start together: not added);
    on CPU (``device``) without the GPU-only ones (CUDA graphs)."""
    table = Table(title="start-up", show_header=True)
    table.add_column("part")
    table.add_column("s", justify="right")
    table.add_column("share", justify="right")
    table.add_column("from start s", justify="right")
    total = startup.total_s
    for row in startup.rows:
        share = f"{row.seconds / total:.1%}" if total > 0 else "-"
        at = "" if row.at_s is None else f"{row.at_s:.2f}"
        table.add_row(row.part, f"{row.seconds:.2f}", share, at, end_section=row.part == "other")
        for name, seconds in startup.details(row.part):
            if device != "cuda" and name.endswith(_GPU_ONLY_PARTS):
                continue
            table.add_row(f"  {name}", f"{seconds:.2f}", "", "", style="dim")
    table.add_row("to the first step", f"{total:.2f}", "100.0%" if total > 0 else "-", "")
    since = "the process's start (Python's own start included)" if startup.from_process_start else "the call"
    first_step = first_step_ratio(history)
    first = ""
    if first_step is not None:
        first = f"; the first step took {first_step[0]:.2f} s, {first_step[1]:.2f}x the mean after it"
    dim = "dim: the roles' own parts and work alongside a part, not added"
    table.caption = f"from {since} to the first step; {dim}{first}"
    return table


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), int | float)]
    return statistics.fmean(values) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
