"""GPU: the megatron backend against the torch backend (benchmarks/gpu_megatron.py, without its benchmark).

Parity of log-probs, values and step-0 losses, PPO steps tracking each other, the Hugging Face round
trip bit for bit, sleep/wake with the memory freed and the process groups rebuilt; the optimizer state:
made at setup (the first step bit for bit the lazy one), checkpoints resumed by megatron with the next
step equal to the uninterrupted run's, torch -> megatron and megatron -> torch with the Adam state exact.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_megatron.py"


def test_megatron_backend_matches_torch_backend_on_gpu() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--skip-benchmark"], capture_output=True, text=True, timeout=540
    )
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert done.returncode == 0, done.stdout[-3000:]
    assert "0 failure(s)" in done.stdout
