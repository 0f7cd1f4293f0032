"""Each package README's example runs as pasted: the first ``python`` block, in a fresh interpreter
started in an empty folder, must exit 0 and print what the README shows it printing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A line (regular expression) each example's output must hold: what the example is there to show.
EXPECTED = {
    "lifecycle": r"disconnect from engines",
    "placement": r"^rollout \(2, 3\) \(2, 3\) 1\.0$",
    "ppo_driver": r"True$",
    "rollout": r"'eval/samples': 8\.0",
    "testsupport": r"^\['rank 0 of 2 arg0', 'rank 1 of 2 arg1'\]$",
    "trainer": r"^3 \d+\.\d+ \d+\.\d+$",
    "value_transport": r"\['same', 'same', 'same'\]",
    "weight_sync": r"^step-1 True$",
}


def first_python_block(readme: Path) -> str:
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    if not blocks:
        raise AssertionError(f"{readme} has no python example")
    return blocks[0]


def test_every_package_has_an_expectation() -> None:
    packages = {p.parent.name for p in (REPO / "packages").glob("*/README.md")}
    assert packages == EXPECTED.keys()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_readme_example_runs_as_pasted(package: str, tmp_path: Path) -> None:
    code = first_python_block(REPO / "packages" / package / "README.md")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    assert done.returncode == 0, f"{package} README example failed:\n{done.stderr[-3000:]}"
    assert re.search(EXPECTED[package], done.stdout, re.M), f"{package} printed:\n{done.stdout[-2000:]}"
