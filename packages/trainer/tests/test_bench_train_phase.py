"""``benchmarks/bench_train_phase.py`` on the CPU at toy size: long samples drawn from the lognormal
lengths, two token budgets, the table's rows and columns (the GPU figures come from the same script)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train_phase.py"


@pytest.mark.timeout(300)
def test_long_samples_with_token_budgets_on_the_cpu() -> None:
    args = ["--samples", "8", "--sample-tokens", "64", "--median", "20", "--max-tokens", "128,256"]
    args += ["--variants", "packed-budget,plain", "--attention", "varlen", "--repeats", "1", "--warmup", "0"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=280, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert "8 samples" in out
    assert "log-prob chunks of 4096 positions" in out
    header = "| phase | variant | s | tokens/s | TFLOP/s | share of matmul limit | working GB | first call s "
    assert header in out
    for phase in ("logprob_forward", "actor_train", "critic_train"):
        for budget in (128, 256):
            assert f"| {phase} | packed varlen, {budget} tokens |" in out
    assert "| plain HF fwd+bwd | padded, 8 samples |" in out
    longest = int(out.split("longest ")[1].split(")")[0])
    assert longest <= 64  # --sample-tokens bounds every sample


def test_a_budget_below_the_longest_sample_is_refused() -> None:
    args = ["--sample-tokens", "200", "--max-tokens", "64", "--variants", "packed-budget"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "--max-tokens 64 is below the longest sample" in done.stderr
