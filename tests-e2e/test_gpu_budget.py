"""The step-budget benchmark (packages/ppo_driver/benchmarks/gpu_budget.py) as its users run it.

On 2 GPUs (``gpu``): each seed scenario at 0.82B parameters, 256 samples x 256 tokens, 5 steps; the
script's own checks (finite losses, engines equal to the actor after every update, the parts adding
up) must all hold. On CPU: the same script with ``--cpu-smoke``, one scenario with long-tailed
response lengths (one run covers the smoke of both modes: the checks and tables are the same), so that
it keeps working between GPU runs.
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


def _check_long_tail(done: subprocess.CompletedProcess[str], report: str, median: str, longest: int) -> None:
    assert "ok: " in done.stdout
    for step in (1, 2):
        assert f"step {step}: every response has its drawn length" in done.stdout
    assert f"lognormal response lengths (median {median}, max {longest}, sigma 1; eos ignored" in report
    generate = next(
        line for line in report.splitlines() if line.startswith("| generate | ") and "decode" in line
    )
    assert "slot idle share" in generate
    assert "bandwidth bound" in generate
    for phase in ("critic_train", "actor_train"):
        assert any(
            line.startswith(f"| {phase} | ") and "matmul limit" in line for line in report.splitlines()
        ), phase


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_budget_of_long_tailed_responses_on_one_gpu(tmp_path: Path) -> None:
    args = ["--scenario", "colocate-1gpu", "--response-median", "512", "--response-max", "2048"]
    done, report = _run([*args, "--steps", "2"], tmp_path, timeout=560)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    _check_long_tail(done, report, "512", 2048)
    assert "0.82B parameters, 256 samples x lognormal" in report


@pytest.mark.timeout(420)
def test_budget_script_long_tail_cpu_smoke(tmp_path: Path) -> None:
    args = ["--cpu-smoke", "--scenario", "disaggregate", "--response-median", "6", "--response-max", "16"]
    done, report = _run(args, tmp_path, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "all checks passed" in done.stdout
    assert "ok: disaggregate step 2: engines checked after the update" in done.stdout
    _check_report(report, "disaggregate")
    assert "| engines/sleep |" not in report  # engines on their own device never move
    _check_long_tail(done, report, "6", 16)
