"""Checkpoint folders: temporary folder then rename, latest-complete discovery, driver state files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from ppo_driver import checkpoint as ck


def _write(folder: Path) -> None:
    (folder / "actor").mkdir()
    (folder / "actor" / "weights.bin").write_bytes(b"abc")


def test_write_renames_into_place_and_marks_complete(tmp_path: Path) -> None:
    final = ck.write_checkpoint(tmp_path, 3, _write)
    assert final == tmp_path / "step_000003"
    assert (final / ck.MARKER).is_file()
    assert (final / "actor" / "weights.bin").read_bytes() == b"abc"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003"]


def test_crash_mid_write_leaves_nothing_discoverable(tmp_path: Path) -> None:
    ck.write_checkpoint(tmp_path, 2, _write)

    def crash(folder: Path) -> None:
        _write(folder)
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        ck.write_checkpoint(tmp_path, 4, crash)
    assert ck.latest_complete(tmp_path) == (2, tmp_path / "step_000002")
    # The next save of that step cleans the leftover temporary folder.
    ck.write_checkpoint(tmp_path, 4, _write)
    assert ck.latest_complete(tmp_path) == (4, tmp_path / "step_000004")
    assert not (tmp_path / ".tmp-step_000004").exists()


def test_latest_ignores_folders_without_marker_and_other_names(tmp_path: Path) -> None:
    assert ck.latest_complete(tmp_path / "missing") is None
    (tmp_path / "step_000009").mkdir()  # no COMPLETE marker: a copy cut short
    (tmp_path / "notes").mkdir()
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_12" / ck.MARKER).write_text("{}")
    ck.write_checkpoint(tmp_path, 5, _write)
    ck.write_checkpoint(tmp_path, 10, _write)
    assert ck.latest_complete(tmp_path) == (10, tmp_path / "step_000010")
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [5, 10]


def test_keep_prunes_old_and_rewrite_replaces(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        ck.write_checkpoint(tmp_path, step, _write, keep=2)
    assert [s for s, _ in ck.complete_checkpoints(tmp_path)] == [2, 3]

    def other(folder: Path) -> None:
        (folder / "v2").write_text("new")

    ck.write_checkpoint(tmp_path, 3, other, keep=2)
    assert (tmp_path / "step_000003" / "v2").read_text() == "new"
    assert not (tmp_path / "step_000003" / "actor").exists()


def test_driver_state_round_trip_restores_rng(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = ck.DriverState(
        step=7,
        rollout={"position": 56, "rng": torch.arange(4, dtype=torch.int64), "order": (3, 1), "x": None},
        extra={"config_sha256": "ab", "arr": np.array([1.5, 2.5], dtype=np.float32)},
    )
    ck.save_driver_state(tmp_path, state)
    expected = (random.random(), float(np.random.rand()), torch.rand(2))
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)

    loaded = ck.load_driver_state(tmp_path)
    assert (random.random(), float(np.random.rand())) == expected[:2]
    assert torch.equal(torch.rand(2), expected[2])
    assert loaded.step == 7
    assert loaded.rollout["position"] == 56
    assert loaded.rollout["order"] == [3, 1]
    assert torch.equal(loaded.rollout["rng"], torch.arange(4))
    assert np.array_equal(loaded.extra["arr"], np.array([1.5, 2.5], dtype=np.float32))
    # Only JSON and safetensors on disk: nothing that needs unpickling.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["driver.json", "driver.safetensors"]
    json.loads((tmp_path / "driver.json").read_text())


def test_driver_state_rejects_what_json_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"rollout\.fn: builtin_function_or_method is not JSON"):
        ck.save_driver_state(tmp_path, ck.DriverState(step=1, rollout={"fn": len}, extra={}))
    with pytest.raises(TypeError, match="not a string"):
        ck.save_driver_state(tmp_path, ck.DriverState(step=1, rollout={1: 2}, extra={}))


def test_wrong_format_is_a_clear_error(tmp_path: Path) -> None:
    ck.save_driver_state(tmp_path, ck.DriverState(step=1, rollout={}, extra={}))
    doc = json.loads((tmp_path / "driver.json").read_text())
    doc["format"] = 99
    (tmp_path / "driver.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="format 99"):
        ck.load_driver_state(tmp_path)


def test_changed_fields_names_what_matters_for_resume() -> None:
    from ppo_driver.config import load_config
    from ppo_driver.resume import changed_fields

    saved = load_config(None, ["train.steps=10"]).model_dump(mode="json")
    assert changed_fields(saved, load_config(None, ["train.steps=20", "logging.progress=false"])) == []
    changed = load_config(None, ["train.actor_lr=0.01", "rollout.sampling.stop_token_ids=[3]"])
    assert changed_fields(saved, changed) == ["rollout.sampling.stop_token_ids", "train.actor_lr"]
    assert changed_fields({}, changed) == []  # a checkpoint that recorded no config
