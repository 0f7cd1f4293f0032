"""``startup.warm_up`` through the CLI on CPU: a run with the warm-up computes what a run without it
computes, step for step (every figure that is not a clock, a byte count or a rate, and the final
weights), and its start-up table has the warm-up's row with each trainer's own warm-up under it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli

# Figures that measure time, bytes or rates: they differ from one run to the next.
_MEASURED = ("time/", "bytes/", "weight_sync/", "offload/", "/sleep", "/wake", "tflops", "_per_s", "seconds")


def _run(tmp_path: Path, warm_up: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    run_dir = tmp_path / f"warm-{warm_up}"
    sets = ["train.steps=2", "checkpoint.interval=0", "checkpoint.save_final=false", "logging.progress=false"]
    done = run_cli(
        "train",
        "--run-dir",
        str(run_dir),
        *[a for s in [*sets, f"startup.warm_up={warm_up}"] for a in ("--set", s)],
        cwd=tmp_path,
        timeout=280,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "summary.json").read_text())


def _computed(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not any(m in k for m in _MEASURED) and not k.endswith("_s")}


@pytest.mark.timeout(600)
def test_a_warmed_run_computes_what_an_unwarmed_one_does(tmp_path: Path) -> None:
    warm, warm_summary = _run(tmp_path, "true")
    cold, cold_summary = _run(tmp_path, "false")
    assert [_computed(r) for r in warm] == [_computed(r) for r in cold]  # bit for bit, both steps
    assert warm_summary["actor_checksum"] == cold_summary["actor_checksum"]
    assert warm_summary["weights_match"]
    warm_parts = [p["part"] for p in warm_summary["startup"]["parts"]]
    assert "warm-up (after roles)" in warm_parts
    assert warm_parts.index("warm-up (after roles)") < warm_parts.index("offload plan")
    detail = warm_summary["startup"]["alongside"]["warm-up (after roles)"]
    assert detail["actor"] > 0  # the trainers ran their phases
    assert detail["critic"] > 0
    assert detail["rollout"] == 0.0  # the CPU engine decodes in a loop: no graphs to capture
    assert "warm-up (after roles)" not in [p["part"] for p in cold_summary["startup"]["parts"]]
    first = warm_summary["first_step_time"]
    assert first["seconds"] > 0
    assert first["over_steady"] > 0
