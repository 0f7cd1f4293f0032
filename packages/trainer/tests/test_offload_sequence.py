"""The GPU benchmark's sequence on CPU with gloo: both roles on one placement-group bundle, asleep between
phases, and every step's weight update made while the actor is asleep (wake, reconnect, send, sleep)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]


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


def test_asleep_actor_updates_the_engine_every_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    model = script.make_model(tmp_path / "model", hidden=32, layers=1, vocab=64)
    result = script.run("host", model, steps=3, vocab=64, device="cpu")
    assert len(result["update_s"]) == 3, result
    # The engine holds the weights of the last update, bit for bit (checksums of the same bytes).
    assert result["weights_match"] is True, result
    assert len(result["value_losses"]) == 3, result
    out = capsys.readouterr().out
    for step in (1, 2, 3):
        assert f"step {step}: update_weights done" in out, out
