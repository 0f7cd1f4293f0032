"""The map (docs/WHERE.md) names every module under packages/*/src, so a newcomer finds each one."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAP = REPO / "docs" / "WHERE.md"


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


def named_on_the_map(text: str) -> set[str]:
    """Every module path the map names: in full (``ppo_rollout/engine/core.py``), or below its package
    (``engine/core.py``) inside a section whose heading names the package (``## Rollout (`ppo_rollout`)``)."""
    named: set[str] = set()
    package = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = re.search(r"`(ppo_[a-z_]+)", line)
            package = heading.group(1) if heading else ""
        for token in re.findall(r"`([^`]+)`", line):
            for word in re.split(r"[\s,]+", token):
                if word.endswith(".py"):
                    named.add(word)
                    if package and not word.startswith("ppo_"):
                        named.add(f"{package}/{word}")
    return named


def test_every_module_is_on_the_map() -> None:
    named = named_on_the_map(MAP.read_text())
    missing = [path for _, path in modules() if path not in named]
    assert not missing, (
        f"{len(missing)} module(s) are not on docs/WHERE.md (name each in a row, in full or below its "
        f"package in that package's section): {missing}"
    )


def test_the_map_names_only_modules_that_exist() -> None:
    paths = {path for _, path in modules()} | {f"{pkg}/__init__.py" for pkg, _ in modules()}
    stale = sorted(p for p in named_on_the_map(MAP.read_text()) if p.startswith("ppo_") and p not in paths)
    assert not stale, f"docs/WHERE.md names modules that do not exist: {stale}"


def test_the_map_check_finds_a_module_left_off() -> None:
    text = "## Rollout (`ppo_rollout`)\n| a | `ppo_rollout/manager.py` | `engine/core.py` |\n"
    named = named_on_the_map(text)
    assert {"ppo_rollout/manager.py", "ppo_rollout/engine/core.py"} <= named
    assert "ppo_rollout/engine/sglang.py" not in named
