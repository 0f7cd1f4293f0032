"""Each package README's example, as a user pastes it.

``tools/readme_examples.py`` runs the first ``python`` block in a fresh interpreter started in an empty
folder; it must exit 0 and print a line matching the tool's ``EXPECTED``. Each package's nox session
(``tests(<package>)``) runs its example against the package's installed wheel, so the ``e2e`` session
sets ``PPO_README_EXAMPLES_IN_PACKAGE_SESSIONS`` and skips them here; run alone (``pytest tests-e2e``)
this file runs every example. Always: every package has an example and an expectation, every example is
valid Python, and the sessions do run them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_examples", REPO / "tools" / "readme_examples.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


def test_every_package_has_an_expectation() -> None:
    packages = {p.parent.name for p in (REPO / "packages").glob("*/README.md")}
    assert packages == TOOL.EXPECTED.keys()


@pytest.mark.parametrize("package", sorted(TOOL.EXPECTED))
def test_readme_example_is_python(package: str) -> None:
    code = TOOL.first_python_block(REPO / "packages" / package / "README.md")
    compile(code, f"packages/{package}/README.md", "exec")


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    os.environ.get("PPO_README_EXAMPLES_IN_PACKAGE_SESSIONS") == "1",
    reason="each package's nox session runs its example against its wheel",
)
@pytest.mark.parametrize("package", sorted(TOOL.EXPECTED))
def test_readme_example_runs_as_pasted(package: str) -> None:
    TOOL.run_example(package)  # raises RuntimeError with the example's output when it fails


def test_each_package_session_runs_its_example() -> None:
    noxfile = (REPO / "noxfile.py").read_text()
    assert 'str(ROOT / "tools" / "readme_examples.py"), package' in noxfile


def test_readme_is_short() -> None:
    long = {
        path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
        for path in [REPO / "README.md", *(REPO / "packages").glob("*/README.md")]
    }
    assert all(lines <= 160 for lines in long.values()), long
