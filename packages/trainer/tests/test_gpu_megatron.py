"""GPU: the megatron backend on a real checkpoint, and against the torch backend.

``test_megatron_backend_matches_torch_backend_on_gpu`` runs benchmarks/gpu_megatron.py without its
benchmark (minutes): parity of log-probs, values and step-0 losses, PPO steps tracking each other, the
Hugging Face round trip, sleep/wake, the optimizer state (made at setup, resumed, torch <-> megatron).

The others run ``_megatron_gpu_cases.py`` (one case per process: megatron's ``parallel_state``, NCCL
and torch_memory_saver are process-wide) on ``$PPO_REAL_MODEL`` when set (a Hugging Face folder, e.g.
SmolLM2-135M-Instruct), else on a random Llama with SmolLM2-135M's layout (9 query heads over 3 KV
heads of 64, hidden 576, tied embeddings, vocabulary 49152; 4 layers), and assert on what it measured:

* the KL-loss actor (``use_kl_loss``: a reference model) with each memory backend: every tensor of
  both models on the GPU, PPO steps, sleep/wake cycles keeping every bit (the issue's crash);
* a resumed run ending with the uninterrupted run's weights and Adam state, bit for bit;
* Hugging Face -> megatron -> Hugging Face bit for bit; log-probs at step 0 against the torch backend.

    cd packages/trainer && python -m pytest -m gpu tests/test_gpu_megatron.py -k "not matches_torch" \
        -q -p no:cacheprovider -o addopts=""
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_megatron.py"
CASES = Path(__file__).resolve().parent / "_megatron_gpu_cases.py"

# Log-probs of the two backends at step 0 on the same bf16 checkpoint: both round activations to bf16
# (megatron: bf16 weights and activations; torch: float32 weights under bf16 autocast), with
# different kernels (norms, attention, the fused output layer) that round differently. A relative
# error of bf16 (2**-8) over a few layers, on log-probs of about -11 (a 49152-token vocabulary on
# random tokens): per token within 0.25, on average within 0.02.
# Deeper models add rounding per layer: the bounds scale with the layer count over 4. On the real
# SmolLM2-135M-Instruct (30 layers, log-probs of about -13.6) the two backends differed by 0.371 at
# worst and 0.064 on average (H200, 2026-12-02), against bounds of 1.875 and 0.15 (a misplaced norm or
# rotary embedding moves log-probs by whole nats).
LOG_PROB_MAX_ABS = 0.25
LOG_PROB_MEAN_ABS = 0.02


def layers_of(model: str) -> int:
    """The layer count of ``$PPO_REAL_MODEL``'s folder, or 4 (the case's own random model)."""
    config = Path(model) / "config.json"
    return int(json.loads(config.read_text())["num_hidden_layers"]) if config.is_file() else 4


def _case(tmp_path: Path, case: str, *args: str) -> dict[str, Any]:
    """Run one case in its own process; its JSON. The process's output shows with ``-s`` or on failure."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    out = tmp_path / f"{case}.json"
    done = subprocess.run(
        [sys.executable, str(CASES), case, str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    print(done.stdout[-4000:], done.stderr[-6000:])
    assert done.returncode == 0, f"{case} exited {done.returncode}: {done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    keep = os.environ.get("PPO_GPU_RESULTS")  # a folder for each case's measurements (the device's $OUT)
    if keep:
        name = "_".join(["megatron", case, *(a.lstrip("-") for a in args)])
        Path(keep).mkdir(parents=True, exist_ok=True)
        (Path(keep) / f"{name}.json").write_text(out.read_text())
    return result


@pytest.mark.parametrize("memory_backend", ["pinned", "torch_memory_saver"])
def test_kl_loss_actor_on_gpu_through_sleep_and_wake(tmp_path: Path, memory_backend: str) -> None:
    """The issue's crash: with ``use_kl_loss`` the reference's norms were on the CPU. Now every tensor
    of the actor and its reference is on the GPU at setup and after each wake, the memory backend
    moves them all (RoPE's frequencies included: torch_memory_saver discards untracked contents),
    and the log-probs of both models are bit for bit those before the sleep."""
    if memory_backend == "torch_memory_saver":
        pytest.importorskip("torch_memory_saver", reason="torch_memory_saver is not installed")
    r = _case(tmp_path, "kl_sleep_wake", "--memory-backend", memory_backend)
    assert r["has_reference"]
    assert r["misplaced_at_setup"] == []
    assert r["reference_devices"] == ["cuda:0"]
    steps = r["steps"]
    assert len(steps) == 3
    for metrics in steps:
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        assert "kl_loss" in metrics
    # Step 0: the actor is the reference (same weights, same code): no KL yet; then the policy moves.
    assert abs(steps[0]["ref_kl"]) < 1e-6
    assert steps[-1]["ref_kl"] > 0.0
    assert steps[-1]["kl_loss"] > 0.0
    for cycle in r["cycles"]:
        assert cycle["misplaced_after_wake"] == []
        assert cycle["held_unequal_after_wake"] == 0, cycle
        assert cycle["log_probs_equal"]
        assert cycle["reference_log_probs_equal"]
        assert cycle["freed_bytes"] > 0.9 * cycle["tracked_bytes"], cycle


def test_megatron_resume_ends_bit_for_bit_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """N steps, checkpoint, M steps; a fresh trainer loads the checkpoint and takes the same M steps:
    same float32 main weights, bf16 weights, Adam moments and step, metrics and log-probs. Adam's
    state exists from setup (so the memory backend pins all of it at ``track()``)."""
    r = _case(tmp_path, "resume")
    n, m = r["n"], r["m"]
    assert r["adam_entries_at_setup"] == r["adam_shards"] > 0
    assert r["pinned_at_track"] >= r["tracked_after_steps"] > 0
    assert r["loaded_step"] == n
    assert r["main_changed_since_setup"]  # the runs moved: not two untouched copies compared
    assert all(v > 0.0 for v in r["kl_loss_after_save"])  # the KL term took part
    assert r["main_names_equal"]
    assert r["main_unequal"] == []
    assert r["bf16_names_equal"]
    assert r["bf16_unequal"] == []
    assert r["adam_names_equal"]
    assert r["adam_unequal"] == []
    assert r["adam_steps"] == [float(n + m)]
    assert r["metrics_equal"]
    assert r["log_probs_equal"]


def test_real_checkpoint_round_trip_and_step_0_log_probs(tmp_path: Path) -> None:
    """The checkpoint into megatron and back (bf16 weights, float32 main weights, a written
    checkpoint's ``hf/model.safetensors``) bit for bit; step-0 log-probs against the torch backend
    within bf16's rounding (``LOG_PROB_*``); the reference equal to the actor at step 0."""
    r = _case(tmp_path, "round_trip_parity")
    assert r["names_missing"] == []
    assert set(r["names_extra"]) <= {"lm_head.weight"}  # tied: the alias of the embeddings
    assert r["bf16_unequal"] == []
    assert r["main_unequal"] == []
    assert r["written_names_equal"]
    assert r["written_unequal"] == []
    assert r["reference_vs_actor_max_abs_diff"] < 1e-3
    assert abs(r["ref_kl_at_step_0"]) < 1e-6
    depth = layers_of(r["model"]) / 4  # the bounds are for 4 layers; bf16's rounding adds up per layer
    assert r["log_prob_max_abs_diff"] < LOG_PROB_MAX_ABS * depth, r
    assert r["log_prob_mean_abs_diff"] < LOG_PROB_MEAN_ABS * depth, r


def test_packed_micro_batches_match_padded_ones(tmp_path: Path) -> None:
    """train.pack_sequences with the megatron backend: the same log-probs (actor and reference),
    values and first-step losses as padded micro-batches within bf16's rounding (the same kernels but
    attention, which is the varlen flash kernel packed), 0 on padding."""
    r = _case(tmp_path, "packed_parity")
    depth = layers_of(r["model"]) / 4
    for key in ("log_probs", "reference"):
        assert r[f"{key}_max_abs_diff"] < LOG_PROB_MAX_ABS * depth, r
        assert r[f"{key}_mean_abs_diff"] < LOG_PROB_MEAN_ABS * depth, r
    assert r["values_max_abs_diff"] < 0.05 * depth, r
    for key in ("log_probs", "reference", "values"):
        assert r[f"{key}_zero_on_padding"], key
    padded, packed = r["metrics_padded"], r["metrics_packed"]
    assert padded.keys() == packed.keys()
    assert abs(padded["pg_loss"] - packed["pg_loss"]) < 0.02 * max(1.0, abs(padded["pg_loss"])), r
    assert abs(padded["grad_norm"] - packed["grad_norm"]) < 0.05 * padded["grad_norm"], r


def test_megatron_backend_matches_torch_backend_on_gpu() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--skip-benchmark"], capture_output=True, text=True, timeout=540
    )
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 failure(s)" in done.stdout
