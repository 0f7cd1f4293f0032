"""GPU: ``train.lora.share_base`` over CUDA IPC, a LoRA actor and critic in two processes on one GPU
(``benchmarks/shared_base_memory.py``): the critic maps the actor's bfloat16 base, one step of each
leaves it bit-identical, both score as they do with their own bases, and the two use less device
memory than unshared by about one base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def test_the_critic_maps_the_actors_gpu_base(tmp_path: Path) -> None:
    bench = load_benchmark("shared_base_memory")
    folder = bench.save_preset("135m", tmp_path / "model")  # SmolLM2-135M's shape: a 269 MB bf16 base
    options = {
        "model": str(folder),
        "device": "cuda",
        "dtype": "auto",
        "rank": 16,
        "kl_coef": 0.0,
        "tokens": 1024,
        "threads": 2,
    }
    figures = {mode: bench.run_mode(mode == "shared", options, 300.0) for mode in bench.MODES}
    bench.print_report(figures, "cuda")
    assert bench.check(figures) == []
    base = figures["shared"]["actor"]["stays_resident"]
    assert base > 2.6e8
    # The critic's own copy is gone: what its process allocates drops by one base. (The device-wide
    # figure is printed, not asserted: any other process on the GPU moves it.)
    saved = figures["unshared"]["critic"]["allocated"] - figures["shared"]["critic"]["allocated"]
    assert saved == pytest.approx(base, rel=0.05)
    assert figures["shared"]["actor"]["allocated"] == pytest.approx(
        figures["unshared"]["actor"]["allocated"], rel=0.05
    )
    assert torch.cuda.is_available()
