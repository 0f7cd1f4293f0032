"""Shared helpers of the whole-system tests: run the `ppo-driver` console script as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def ppo_driver_exe() -> str:
    """The installed console script of this environment."""
    local = Path(sys.executable).with_name("ppo-driver")
    found = str(local) if local.is_file() else shutil.which("ppo-driver")
    if found is None:
        raise RuntimeError("the ppo-driver console script is not installed in this environment")
    return found


def run_cli(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run(
        [ppo_driver_exe(), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
