"""Run a package README's example as a user pastes it: ``python tools/readme_examples.py PACKAGE``.

The first ```` ```python ```` block of ``packages/PACKAGE/README.md`` runs in a fresh interpreter (the
one running this script, so a nox session's venv holding the installed wheel) started in an empty
folder; it must exit 0 and print a line matching ``EXPECTED[PACKAGE]``. Standard library only: it runs
in a venv holding one package and its declared dependencies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

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
    """The README's first ```` ```python ```` block: the example a user pastes."""
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    if not blocks:
        raise ValueError(f"{readme} has no ```python block; the first one is the package's example")
    return blocks[0]


def run_example(package: str, timeout_s: float = 540.0) -> str:
    """Run ``package``'s example; return its stdout, or raise ``RuntimeError`` saying what went wrong."""
    code = first_python_block(REPO / "packages" / package / "README.md")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{package} README example exited {done.returncode}:\n{done.stderr[-3000:]}")
    if not re.search(EXPECTED[package], done.stdout, re.M):
        raise RuntimeError(
            f"{package} README example did not print a line matching {EXPECTED[package]!r}:\n"
            f"{done.stdout[-2000:]}"
        )
    return done.stdout


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in EXPECTED:
        print(f"usage: python tools/readme_examples.py PACKAGE  (one of {sorted(EXPECTED)})", file=sys.stderr)
        return 2
    try:
        print(run_example(argv[0]), end="")
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
