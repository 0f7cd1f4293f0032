"""The GPU benchmark's sequence on CPU with gloo: both roles on one placement-group bundle, asleep between
phases, and every step's weight update made while the actor is asleep (wake, reconnect, send, sleep)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("ray_session")]


def test_asleep_actor_updates_the_engine_every_step(
    gpu_workers_script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = gpu_workers_script
    model = script.make_model(tmp_path / "model", hidden=32, layers=1, vocab=64)
    result = script.run("host", model, steps=3, vocab=64, device="cpu")
    assert len(result["update_s"]) == 3, result
    # The engine holds the weights of the last update, bit for bit (checksums of the same bytes).
    assert result["weights_match"] is True, result
    assert len(result["value_losses"]) == 3, result
    out = capsys.readouterr().out
    for step in (1, 2, 3):
        assert f"step {step}: update_weights done" in out, out
