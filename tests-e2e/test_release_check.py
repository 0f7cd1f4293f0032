"""tools/interface_snapshot.py, the check behind ``nox -s release-check``, on a copy of the packages'
metadata: a changed public interface fails without a version bump and passes with one; a version
without a CHANGELOG section and a sibling range that excludes a sibling's version fail."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DIST = "ppo-placement"  # torch-free, so the check imports little


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "interface_snapshot", REPO / "tools" / "interface_snapshot.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TOOL = _tool()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The packages' pyproject.toml and CHANGELOG.md files, and a record of the current interface."""
    for folder, _ in TOOL.PUBLIC.values():
        (tmp_path / "packages" / folder).mkdir(parents=True)
        for name in ("pyproject.toml", "CHANGELOG.md"):
            shutil.copy(REPO / "packages" / folder / name, tmp_path / "packages" / folder / name)
    records = tmp_path / "tools" / "interfaces"
    records.mkdir(parents=True)
    version = TOOL._project(DIST)["version"]
    record = {"version": version, "interface": TOOL.interface(DIST)}
    (records / f"{DIST}.json").write_text(json.dumps(record))
    changelog = tmp_path / "packages" / "placement" / "CHANGELOG.md"
    changelog.write_text(f"# Changelog\n\n## {version} (released)\n\n- first\n")
    return tmp_path


def _set_version(repo: Path, version: str) -> None:
    pyproject = repo / "packages" / "placement" / "pyproject.toml"
    text = pyproject.read_text()
    old = f'version = "{TOOL._project(DIST)["version"]}"'
    assert old in text
    pyproject.write_text(text.replace(old, f'version = "{version}"', 1))


def _change_recorded_interface(repo: Path) -> None:
    path = repo / "tools" / "interfaces" / f"{DIST}.json"
    record = json.loads(path.read_text())
    record["interface"]["ppo_placement"]["plan_layout"] = "def(spec, extra) -> Layout"
    path.write_text(json.dumps(record))


def test_unchanged_interface_passes(repo: Path) -> None:
    assert TOOL.problems(repo, (DIST,)) == []


def test_changed_interface_without_a_bump_fails_naming_the_change(repo: Path) -> None:
    _change_recorded_interface(repo)
    found = TOOL.problems(repo, (DIST,))
    assert len(found) == 1
    assert "changed since" in found[0]
    assert "without a version bump" in found[0]
    assert "changed ppo_placement.plan_layout" in found[0]


def test_changed_interface_with_a_bump_and_its_changelog_passes(repo: Path) -> None:
    _change_recorded_interface(repo)
    _set_version(repo, "0.3.0")
    changelog = repo / "packages" / "placement" / "CHANGELOG.md"
    assert TOOL.problems(repo, (DIST,)) == [
        f"{DIST} 0.3.0: packages/placement/CHANGELOG.md has no '## 0.3.0' section"
    ]
    changelog.write_text("# Changelog\n\n## 0.3.0\n\n- plan_layout takes extra\n" + changelog.read_text())
    assert TOOL.problems(repo, (DIST,)) == []


def test_a_sibling_range_that_excludes_the_siblings_version_fails(repo: Path) -> None:
    _set_version(repo, "0.3.0")
    (repo / "packages" / "placement" / "CHANGELOG.md").write_text("# Changelog\n\n## 0.3.0\n")
    found = TOOL.problems(repo, ("ppo-driver",))
    excluded = [problem for problem in found if problem.startswith("ppo-driver requires ppo-placement")]
    assert len(excluded) == 1
    assert "which excludes ppo-placement 0.3.0" in excluded[0]
