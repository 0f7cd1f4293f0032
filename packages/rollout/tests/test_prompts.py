"""The dataset pre-flight: every row read and tokenized as the run will, the first bad one named by line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ppo_rollout.config import RolloutConfig
from ppo_rollout.data import NEXT_EPOCH, DatasetChangedError, JsonlPrompts
from ppo_rollout.prompts import check_dataset

# The tiny model's char tokenizer: one token per character plus <bos>; 64 positions.


def _config(tiny_model: Path, dataset: Path, **extra: object) -> RolloutConfig:
    return RolloutConfig(
        model_path=str(tiny_model), task=None, dataset=str(dataset), reward="exact_match", **extra
    )


def _write(path: Path, prompts: list[str], bad_line: int | None = None) -> Path:
    lines = [json.dumps({"prompt": p, "label": p}) for p in prompts]
    if bad_line is not None:
        lines[bad_line - 1] = '{"prompt": "1",'  # cut short
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_whole_dataset_passes_with_its_size(tiny_model: Path, tmp_path: Path) -> None:
    dataset = _write(tmp_path / "d.jsonl", ["12", "345", "6789"] * 10)
    report = check_dataset(_config(tiny_model, dataset))
    assert report.rows == 30
    assert report.longest_prompt == 5  # <bos> + 4 characters
    assert report.seconds >= 0


def test_bad_json_beyond_the_first_lines_is_named(tiny_model: Path, tmp_path: Path) -> None:
    dataset = _write(tmp_path / "d.jsonl", ["12"] * 20, bad_line=17)
    with pytest.raises(ValueError, match=rf"{dataset}:17: not JSON"):
        check_dataset(_config(tiny_model, dataset))


def test_a_prompt_over_max_prompt_length_is_named_by_line(tiny_model: Path, tmp_path: Path) -> None:
    dataset = _write(tmp_path / "d.jsonl", ["12"] * 8 + ["1" * 40] + ["12"])
    with pytest.raises(
        ValueError, match=rf"{dataset}:9: prompt '1+' is too long: 41 tokens > rollout.max_prompt_length 16"
    ):
        check_dataset(_config(tiny_model, dataset, max_prompt_length=16))


def test_a_prompt_past_the_models_positions_is_named_by_line(tiny_model: Path, tmp_path: Path) -> None:
    # 61 tokens fit max_prompt_length, but with 4 new tokens not the model's 64 positions.
    dataset = _write(tmp_path / "d.jsonl", ["12", "1" * 60])
    with pytest.raises(
        ValueError,
        match=rf"{dataset}:2: the prompt is 61 tokens; with max_new_tokens 4 that is more than the "
        "model's max_position_embeddings 64",
    ):
        check_dataset(_config(tiny_model, dataset))


def _rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(n)))
    return path


def test_a_saved_position_holds_the_files_row_count_and_hash(tmp_path: Path) -> None:
    data = _rows(tmp_path / "d.jsonl", 128)
    source = JsonlPrompts(data, "prompt", 3)
    source.next_rows(90)
    state = source.state_dict()
    assert (state["rows"], state["epoch"], state["offset"]) == (128, 0, 90)
    assert state["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    again = JsonlPrompts(data, "prompt", 3)
    again.load_state_dict(state)
    assert again.next_rows(5) == source.next_rows(5)  # the same file: the same prompts follow


@pytest.mark.parametrize("rows", [64, 129])  # cut below the position; longer (reshuffled silently before)
def test_a_changed_file_refuses_the_saved_position(tmp_path: Path, rows: int) -> None:
    data = _rows(tmp_path / "d.jsonl", 128)
    source = JsonlPrompts(data, "prompt", 3)
    source.next_rows(90)
    state = source.state_dict()
    _rows(data, rows)
    changed = JsonlPrompts(data, "prompt", 3)
    with pytest.raises(
        DatasetChangedError, match=rf"the file changed since the checkpoint \(128 rows, .*; {rows} rows"
    ):
        changed.load_state_dict(state)
    changed.load_state_dict({**state, "on_change": NEXT_EPOCH})  # accepted: a new epoch of the new file
    assert (changed.epoch, changed.offset) == (1, 0)
    assert len(changed.next_rows(rows)) == rows


def test_a_position_saved_without_a_fingerprint_is_held_to_the_row_count(tmp_path: Path) -> None:
    data = _rows(tmp_path / "d.jsonl", 10)
    source = JsonlPrompts(data, "prompt", 3)
    old = {"kind": "jsonl", "path": str(data), "epoch": 0, "offset": 8}
    source.load_state_dict(old)
    _rows(data, 5)
    with pytest.raises(
        DatasetChangedError, match=r"the saved position \(epoch 0, row 8\) is past its 5 rows"
    ):
        JsonlPrompts(data, "prompt", 3).load_state_dict(old)


def test_an_eval_file_that_is_the_training_file_is_not_announced_as_held_out(tmp_path: Path) -> None:
    from ppo_rollout.config import RolloutSettings
    from ppo_rollout.data import describe_eval_source

    data = _rows(tmp_path / "d.jsonl", 4)
    same = RolloutSettings(task=None, dataset=str(data), eval_dataset=str(data), reward="exact_match")
    text = describe_eval_source(same)
    assert "held-out" not in text
    assert "which is also rollout.dataset: evaluation measures prompts the run trains on" in text
    other = _rows(tmp_path / "e.jsonl", 2)
    held = RolloutSettings(task=None, dataset=str(data), eval_dataset=str(other), reward="exact_match")
    assert describe_eval_source(held).startswith(f"held-out file {other}")
