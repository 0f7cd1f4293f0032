"""CI's time, visible: every nox session is timed (``tools/session_times.py``), the table of their
seconds is written after each session and printed when nox exits, and ``.ci/run`` runs README's test
command and fails when it fails."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("session_times", REPO / "tools" / "session_times.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["session_times"] = module
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


class Session:
    """What the timer reads of a nox session: its name."""

    def __init__(self, name: str) -> None:
        self.name = name


class _SessionSkip(Exception):  # the name of what nox's session.skip() raises
    pass


def test_each_session_gets_a_row_however_it_ends(tmp_path: Path) -> None:
    out = tmp_path / ".nox" / "durations.md"
    times = TOOL.SessionTimes(out, print_at_exit=False)  # not at the end of this pytest run

    @times.timed
    def tests(session: Session, package: str) -> None:
        time.sleep(0.3 if package == "trainer" else 0.0)

    @times.timed
    def lint(session: Session) -> None:
        raise RuntimeError("ruff found something")

    @times.timed
    def gpu(session: Session) -> None:
        raise _SessionSkip("no GPU")

    tests(Session("tests(placement)"), package="placement")
    # Written as soon as a session ends: a CI run cut short keeps the finished sessions' rows.
    assert "| tests(placement) | 0 | 0.0 | success |" in out.read_text()
    tests(Session("tests(trainer)"), package="trainer")
    with pytest.raises(RuntimeError, match="ruff found something"):  # the failure reaches nox
        lint(Session("lint"))
    with pytest.raises(_SessionSkip):
        gpu(Session("gpu"))
    table = out.read_text()
    assert table == times.table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "| session | seconds | minutes | result |"
    names = [row.split(" | ")[0].removeprefix("| ") for row in rows[1:]]
    assert names[0] == "tests(trainer)"  # the slowest first
    assert set(names[1:-1]) == {"tests(placement)", "lint", "gpu"}
    assert names[-1] == "**total**"
    results = {row.split(" | ")[0].removeprefix("| "): row.split(" | ")[3] for row in rows[1:-1]}
    assert results == {
        "tests(trainer)": "success |",
        "tests(placement)": "success |",
        "lint": "failed |",
        "gpu": "skipped |",
    }
    assert 0.3 <= times.rows[1].seconds < 5  # tests(trainer), in run order


def test_the_table_is_printed_at_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    times = TOOL.SessionTimes(tmp_path / "durations.md")
    times.print_table()
    assert capsys.readouterr().err == ""  # no session ran (`nox -l`): nothing printed
    times.add(TOOL.Row("e2e", 754.2, "success"))
    times.print_table()
    err = capsys.readouterr().err
    assert f"session durations (also in {tmp_path / 'durations.md'}):" in err
    assert "| e2e | 754 | 12.6 | success |" in err
    assert "| **total** | 754 | 12.6 | |" in err


def test_every_nox_session_is_timed() -> None:
    tree = ast.parse((REPO / "noxfile.py").read_text())
    sessions = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("nox.session" in ast.unparse(d) for d in node.decorator_list)
    ]
    assert len(sessions) >= 6
    untimed = [f.name for f in sessions if ast.unparse(f.decorator_list[-1]) != "timed"]
    assert not untimed, f"decorate these sessions with @timed, right above the def: {untimed}"


def test_ci_runs_readmes_test_command_and_fails_with_it() -> None:
    script = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script  # a failing `uv run nox` fails CI
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.startswith("#")]
    assert "uv run nox" in commands
    readme = (REPO / "README.md").read_text()
    assert re.search(r"^uv run nox\s+#", readme, re.M), "README.md's test command is no longer `uv run nox`"


def test_ci_installs_chromium_and_requires_the_browser_test() -> None:
    # The report's browser test (test_default_run.py) skips without Chromium on a developer's machine;
    # CI installs it (as root, through apt) and makes a missing browser fail the test instead.
    script = (REPO / ".ci" / "run").read_text()
    assert "apt-get install -y -qq --no-install-recommends chromium" in script
    assert script.index("export PPO_REQUIRE_CHROMIUM=1") < script.index("\nuv run nox")
