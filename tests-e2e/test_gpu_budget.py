"""The step-budget benchmark (packages/ppo_driver/benchmarks/gpu_budget.py) as its users run it.

On 2 GPUs (``gpu``): each seed scenario at 0.82B parameters, 256 samples x 256 tokens, 5 steps; the
script's own checks (finite losses, engines equal to the actor after every update, the parts adding
up) must all hold. On CPU: the same script with ``--cpu-smoke``, one scenario, so that it keeps working
between GPU runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "packages" / "ppo_driver" / "benchmarks" / "gpu_budget.py"


def _run(args: list[str], out: Path, timeout: float) -> tuple[subprocess.CompletedProcess[str], str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    report = (out / "budget.md").read_text() if (out / "budget.md").exists() else ""
    return done, report


def _check_report(report: str, scenario: str) -> None:
    assert f"shared critic (configs/2gpu-{scenario}.yaml)" in report
    rows = ("| part | first step s |", "| critic/sleep |", "| weight_update |", "| handoff |", "| other |")
    for row in rows:
        assert row in report, row
    assert "| **step** |" in report


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", ["colocate", "disaggregate"])
def test_budget_of_a_realistic_workload_on_two_gpus(scenario: str, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the 2-GPU configs)")
    done, report = _run(["--scenario", scenario], tmp_path, timeout=840)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all checks passed" in done.stdout
    _check_report(report, scenario)
    assert "0.82B parameters, 256 samples x 256 response tokens per step, 5 steps" in report
    if scenario == "colocate":
        assert "| engines/sleep |" in report  # colocated engines are offloaded every step


@pytest.mark.timeout(420)
def test_budget_script_cpu_smoke(tmp_path: Path) -> None:
    done, report = _run(["--cpu-smoke", "--scenario", "disaggregate"], tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "ok: disaggregate step 2: engines checked after the update" in done.stdout
    _check_report(report, "disaggregate")
    assert "| engines/sleep |" not in report  # engines on their own device never move
