"""The text a reward reads (issue 54): the end-of-sequence token that ends a response is dropped, any
other special token stays, so a model that pads its answer with ``<bos>`` instead of ending it earns
nothing for the padding (real tiny model folder, its char tokenizer, the run's ``Scorer``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from ppo_rollout.rewards import response_text
from ppo_rollout.tasks import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(
        make_tiny_model("copy_small", tmp_path_factory.mktemp("m") / "model")
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_only_the_trailing_end_tokens_are_dropped(tokenizer: Any) -> None:
    eos, bos, pad = tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), eos]) == "12"
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), eos, pad, pad]) == "12"
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), bos]) == "12" + tokenizer.bos_token
    assert response_text(tokenizer, [bos, *_ids(tokenizer, "12")]) == tokenizer.bos_token + "12"


def test_a_model_folders_generation_config_eos_ends_a_response(tmp_path: Path) -> None:
    import json

    folder = make_tiny_model("copy_small", tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    unk = tokenizer.unk_token_id
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, unk]}))
    tokenizer = AutoTokenizer.from_pretrained(folder)  # another folder's ids: read afresh
    assert response_text(tokenizer, [*_ids(tokenizer, "3"), unk]) == "3"
