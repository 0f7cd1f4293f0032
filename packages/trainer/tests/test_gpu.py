"""GPU: actor and critic taking turns on one GPU with NCCL and a GPU memory backend (benchmarks/gpu.sh)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.mark.usefixtures("ray_session")
def test_actor_and_critic_share_a_gpu_and_free_it_in_turns(
    tmp_path: Path, gpu_workers_script: ModuleType
) -> None:
    gpu = gpu_workers_script
    model = gpu.make_model(tmp_path / "model", hidden=512, layers=4, vocab=32000)
    for backend in gpu.available_backends():
        result = gpu.run(backend, model, steps=2)
        gpu.print_report(result)
        assert min(result["critic_freed_gib"] + result["actor_freed_gib"]) > 0.2, result
        assert result["growth_after_first_step_gib"] < 0.1, result
        assert result["value_losses"][-1] < result["value_losses"][0], result
        assert result["weights_match"] in (True, None), result
