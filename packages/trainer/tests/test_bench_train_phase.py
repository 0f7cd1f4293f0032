"""``benchmarks/bench_train_phase.py`` on the CPU at toy size: long samples drawn from the lognormal
lengths, two token budgets, the table's rows and columns (the GPU figures come from the same script)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

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
    header = (
        "| phase | variant | s | tokens/s | TFLOP/s | share of matmul limit | with attention | working GB "
        "| first call s | first loss |"
    )
    assert header in out
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in out.splitlines()}
    for phase in ("logprob_forward", "actor_train", "critic_train"):
        for budget in (128, 256):
            assert (phase, f"packed varlen, {budget} tokens") in rows
    assert ("plain HF fwd+bwd", "padded, 8 samples") in rows
    for line in rows.values():
        if line.startswith("| ") and "%" in line:  # attention's FLOPs only add to the share
            share, with_attention = (float(c.strip().rstrip("%")) for c in line.split("|")[6:8])
            assert with_attention >= share
    longest = int(out.split("longest ")[1].split(")")[0])
    assert longest <= 64  # --sample-tokens bounds every sample


def test_a_budget_below_the_longest_sample_is_refused() -> None:
    args = ["--sample-tokens", "200", "--max-tokens", "64", "--variants", "packed-budget"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0
    assert "--max-tokens 64 is below the longest sample" in done.stderr


def test_fixed_sample_tokens_make_every_sample_that_long() -> None:
    args = ["--samples", "4", "--sample-tokens", "40", "--variants", "packed", "--repeats", "1"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--warmup", "0", "--attention", "varlen"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "4 samples, 160 tokens (40 a sample, longest 40)" in done.stdout


def _script_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_train_phase", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_scripts_lognormal_lengths_are_the_rollout_benchmarks_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The script keeps its own copy (the trainer imports nothing of the rollout): the same lengths as
    ``ppo_rollout.testing.long_tail``'s for the same arguments, and the same refusals."""
    from ppo_rollout.testing.long_tail import lognormal_lengths as rollouts

    script = _script_module(monkeypatch)
    for count, median, longest, sigma, seed in [
        (64, 20.0, 64, 1.0, 0),
        (500, 300.0, 2048, 0.7, 3),
        (0, 5.0, 9, 0.0, 1),
    ]:
        assert script.lognormal_lengths(count, median, longest, sigma, seed) == rollouts(
            count, median, longest, sigma, seed
        )
    with pytest.raises(ValueError, match="median > 0"):
        script.lognormal_lengths(3, 0.0, 10, 1.0, seed=0)
