"""The map (docs/WHERE.md) names every module under packages/*/src, so a newcomer finds each one."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "WHERE.md"

# A path that starts with one of these is a file of the repository (a test, a benchmark), not a module
# below a package's src/: it is never read below a section's package, and it must exist.
REPO_FOLDERS = ("packages/", "benchmarks/", "tests-e2e/", "tools/", "docs/", "configs/")


def modules() -> list[tuple[str, str]]:
    """(package, path below its src/) of every module, e.g. ("ppo_rollout", "ppo_rollout/engine/core.py")."""
    found = []
    for file in sorted(REPO.glob("packages/*/src/*/**/*.py")):
        folder = file.relative_to(REPO).parts[1]  # packages/<folder>/src/...
        below_src = file.relative_to(REPO / "packages" / folder / "src").as_posix()
        package = below_src.split("/", 1)[0]
        if below_src != f"{package}/__init__.py":  # a package's own __init__ is its section
            found.append((package, below_src))
    return found


def _words(text: str) -> list[tuple[str, str]]:
    """(package of the section, word) for every path-like word inside backticks; the section's package is
    the first ``ppo_*`` name in backticks in its heading (``## Rollout (`ppo_rollout`)``)."""
    found = []
    package = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = re.search(r"`(ppo_[a-z_]+)", line)
            package = heading.group(1) if heading else ""
        for token in re.findall(r"`([^`]+)`", line):
            found += [
                (package, word) for word in re.split(r"[\s,]+", token) if "/" in word or word.endswith(".py")
            ]
    return found


def _module_paths(text: str) -> list[tuple[str, bool]]:
    """(path below src/, whether it was named as a folder) of every module path the map names."""
    found = []
    for package, word in _words(text):
        if word.startswith(REPO_FOLDERS):
            continue
        folder = re.fullmatch(r"[a-z_][a-z0-9_/]*/", word) is not None
        if folder:
            word += "__init__.py"
        elif not word.endswith(".py"):
            continue
        full = "/" in word and word.startswith("ppo_")  # ppo_rollout/engine/core.py, not ppo_math.py
        found.append((word if full or not package else f"{package}/{word}", folder))
    return found


def named_on_the_map(text: str) -> set[str]:
    """Every module path the map names: in full (``ppo_rollout/engine/core.py``), or below its package
    (``engine/core.py``) inside a section whose heading names the package (``## Rollout (`ppo_rollout`)``).
    A folder named the same way (``engine/``, ``ppo_weight_sync/transports/``) names its ``__init__.py``."""
    return {path for path, _ in _module_paths(text)}


def repository_files_on_the_map(text: str) -> set[str]:
    """The map's paths from the repository's root (``packages/rollout/tests/test_core.py``)."""
    return {
        word.rstrip("/")
        for _, word in _words(text)
        if word.startswith(REPO_FOLDERS) and re.fullmatch(r"[\w.\-/]+", word)  # not packages/<package>/src/
    }


def test_every_module_is_on_the_map() -> None:
    named = named_on_the_map(MAP.read_text())
    missing = [path for _, path in modules() if path not in named]
    assert not missing, (
        f"{len(missing)} module(s) are not on docs/WHERE.md (name each in a row, in full or below its "
        f"package in that package's section): {missing}"
    )


def test_the_map_names_only_modules_that_exist() -> None:
    paths = {path for _, path in modules()} | {f"{pkg}/__init__.py" for pkg, _ in modules()}
    named = {path for path, folder in _module_paths(MAP.read_text()) if not folder}  # a folder may be data's
    stale = sorted(p for p in named if p.startswith("ppo_") and "/" in p and p not in paths)
    assert not stale, f"docs/WHERE.md names modules that do not exist: {stale}"


def test_the_maps_tests_and_benchmarks_exist() -> None:
    stale = sorted(p for p in repository_files_on_the_map(MAP.read_text()) if not (REPO / p).exists())
    assert not stale, f"docs/WHERE.md names files that do not exist: {stale}"


def test_the_map_check_finds_a_module_left_off() -> None:
    text = (
        "## Rollout (`ppo_rollout`)\n| a | `ppo_rollout/manager.py` | `engine/core.py`, `testing/` |\n"
        "| b | `benchmarks/sglang/record.py` | `packages/rollout/tests/test_core.py` |\n"
        "## Trainer (`ppo_trainer`)\n| c | `ppo_math.py` | |\n"
    )
    named = named_on_the_map(text)
    assert {
        "ppo_rollout/manager.py",
        "ppo_rollout/engine/core.py",
        "ppo_rollout/testing/__init__.py",
    } <= named
    assert "ppo_trainer/ppo_math.py" in named  # below its package, though its name starts with ppo_
    assert "ppo_rollout/engine/sglang.py" not in named
    assert "ppo_rollout/engine/__init__.py" not in named
    assert not any("benchmarks" in path or "tests/" in path for path in named)
    assert repository_files_on_the_map(text) == {
        "benchmarks/sglang/record.py",
        "packages/rollout/tests/test_core.py",
    }
