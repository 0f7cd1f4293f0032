"""GPU: actor and critic taking turns on one GPU with NCCL and a GPU memory backend (benchmarks/gpu.sh)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def _script() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_workers.py"
    spec = importlib.util.spec_from_file_location("gpu_workers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # dataclasses look their module up in sys.modules while the class body runs.
    sys.modules.setdefault("gpu_workers", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.usefixtures("ray_session")
def test_actor_and_critic_share_a_gpu_and_free_it_in_turns(tmp_path: Path) -> None:
    gpu = _script()
    model = gpu.make_model(tmp_path / "model", hidden=512, layers=4, vocab=32000)
    for backend in gpu.available_backends():
        result = gpu.run(backend, model, steps=2)
        gpu.print_report(result)
        assert min(result["critic_freed_gib"] + result["actor_freed_gib"]) > 0.2, result
        assert result["value_losses"][-1] < result["value_losses"][0], result
        assert result["weights_match"] in (True, None), result
