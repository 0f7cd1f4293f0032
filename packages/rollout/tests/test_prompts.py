"""The dataset pre-flight: every row read and tokenized as the run will, the first bad one named by line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_rollout.config import RolloutConfig
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
