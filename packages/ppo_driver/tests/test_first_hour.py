"""The guides' follow-on commands after the README's `ppo-driver train` (which writes runs/<date-time>):
``runs/latest`` points at the newest run, and the export in docs/guide/checkpoints.md finds its model
or stops in one line (real folders, real links, a real Python process for the snippet)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ppo_driver.export import NoExport, hf_folder
from ppo_driver.latest_link import point_latest

REPO = Path(__file__).resolve().parents[3]


def _checkpoint(run: Path, step: int, *, hf: bool = True) -> Path:
    folder = run / "checkpoints" / f"step_{step:06d}"
    (folder / "actor" / "hf").mkdir(parents=True)
    (folder / "COMPLETE").write_text("{}")
    if hf:
        (folder / "actor" / "hf" / "config.json").write_text("{}")
    return folder


def test_runs_latest_follows_the_newest_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first, second = runs / "20260101-100000", runs / "20260101-110000"
    assert point_latest(first) == runs / "latest"
    first.mkdir(parents=True)
    assert (runs / "latest").resolve() == first.resolve()
    point_latest(second)
    second.mkdir()
    assert (runs / "latest").resolve() == second.resolve()
    assert not (runs / "latest").readlink().is_absolute()  # the tree can move
    assert point_latest(tmp_path / "elsewhere" / "run") is None  # only under a folder named runs
    assert point_latest(runs / "latest") is None


def test_a_folder_of_the_users_own_named_latest_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "runs" / "latest").mkdir(parents=True)
    assert point_latest(tmp_path / "runs" / "x") is None
    assert (tmp_path / "runs" / "latest").is_dir()
    assert not (tmp_path / "runs" / "latest").is_symlink()


def test_hf_folder_is_the_latest_complete_checkpoints_export(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "20260101-100000"
    _checkpoint(run, 60)
    last = _checkpoint(run, 120)
    (run / "checkpoints" / ".tmp-step_000180").mkdir()  # an unfinished save is never picked
    point_latest(run)
    assert (
        hf_folder(tmp_path / "runs" / "latest")
        == tmp_path / "runs" / "latest" / last.relative_to(run) / "actor" / "hf"
    )
    assert hf_folder(run, step=60).parent.parent.name == "step_000060"
    assert hf_folder(run / "checkpoints") == last / "actor" / "hf"
    with pytest.raises(NoExport, match=r"has no complete checkpoint of step 7; it has steps \[60, 120\]"):
        hf_folder(run, step=7)


def _snippet() -> str:
    """The export snippet of docs/guide/checkpoints.md, as written there."""
    text = (REPO / "docs" / "guide" / "checkpoints.md").read_text()
    block = re.search(r"## Export\n.*?```python\n(.*?)```", text, re.S)
    assert block is not None, "docs/guide/checkpoints.md has no python block under ## Export"
    return block.group(1)


def test_the_docs_export_snippet_stops_in_one_line_on_a_wrong_folder(tmp_path: Path) -> None:
    snippet = _snippet()
    assert "runs/latest" in snippet
    (tmp_path / "runs" / "demo").mkdir(parents=True)  # a run folder without checkpoints
    for wrong in ("runs/nothing-here", "runs/demo"):
        run = subprocess.run(
            [sys.executable, "-c", snippet.replace("runs/latest", wrong)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 1
        assert run.stderr.count("\n") == 1, run.stderr
        assert run.stderr.startswith(f"error: {wrong} ")
