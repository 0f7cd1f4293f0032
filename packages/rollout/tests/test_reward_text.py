"""The text a reward reads: the end-of-sequence (or stop) token that ends a response is dropped, any
other special token stays, so a model that pads its answer with ``<bos>`` instead of ending it earns
nothing for the padding (real tiny model folder, its char tokenizer, the run's ``Scorer``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from ppo_rollout.rewards import response_text
from ppo_rollout.rollout_fns import PromptGroup
from ppo_rollout.scoring import Scorer
from ppo_rollout.tasks import make_tiny_model
from ppo_rollout.trajectory import Segment, Trajectory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(
        make_tiny_model("copy_small", tmp_path_factory.mktemp("m") / "model")
    )


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _scored(
    scorer: Scorer, label: str, responses: list[tuple[list[int], str]], prompt_ids: list[int]
) -> list[float]:
    group = PromptGroup(
        0, {"prompt": label + ">", "label": label}, label + ">", tuple(prompt_ids), len(responses)
    )

    def trajectory(ids: list[int], finish: str) -> Trajectory:
        segment = Segment(tuple(ids), True, 0, (-1.0,) * len(ids))
        return Trajectory(
            0,
            group.prompt_ids,
            (segment,),
            status="done" if finish == "stop" else "length",
            finish_reason=finish,
            weight_versions=(0,),
        )

    return [t.reward for t in scorer.rewarded([group], [trajectory(ids, f) for ids, f in responses])]


@pytest.mark.parametrize("reward", ["exact_match", "char_match"])
def test_an_answer_padded_with_special_tokens_is_not_the_answer(tokenizer: Any, reward: str) -> None:
    label = "012"
    answer = _ids(tokenizer, label)
    eos, bos, pad, unk = (
        tokenizer.eos_token_id,
        tokenizer.bos_token_id,
        tokenizer.pad_token_id,
        tokenizer.unk_token_id,
    )
    scorer = Scorer(reward, tokenizer, timeout_s=30, score_unfinished=True)
    ended, *padded = _scored(
        scorer,
        label,
        [
            ([*answer, eos], "stop"),
            ([*answer, bos], "length"),  # the default run's model wrote these before it learnt to end
            ([answer[0], bos, *answer[1:]], "length"),
            ([*answer, pad], "length"),
            ([*answer, unk], "length"),
            ([answer[0], bos, *answer[1:], eos], "stop"),  # ended, the padding inside
            ([*answer, bos, eos], "stop"),
        ],
        _ids(tokenizer, label + ">"),
    )
    assert ended == 1.0
    # The padding counts against the answer as any other text would: never the ended answer's reward.
    assert all(r < ended for r in padded), padded
    if reward == "exact_match":
        assert padded == [0.0] * 6


def test_only_the_token_that_ends_a_response_is_dropped(tokenizer: Any) -> None:
    eos, bos, pad = tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), eos]) == "12"
    assert response_text(tokenizer, _ids(tokenizer, "12")) == "12"  # cut by the length limit
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), bos]) == "12" + tokenizer.bos_token
    assert response_text(tokenizer, [bos, *_ids(tokenizer, "12")]) == tokenizer.bos_token + "12"
    # <pad> does not stop the engine (the model's eos does): written by the model, it is text.
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), pad]) == "12" + tokenizer.pad_token
    assert response_text(tokenizer, [*_ids(tokenizer, "12"), eos, eos]) == "12" + tokenizer.eos_token


def test_a_sampling_stop_token_ends_a_response(tokenizer: Any) -> None:
    unk = tokenizer.unk_token_id
    label = "3"
    answer = [*_ids(tokenizer, label), unk]
    assert response_text(tokenizer, answer) == label + tokenizer.unk_token
    assert response_text(tokenizer, answer, stop_token_ids=(unk,)) == label
    scorer = Scorer("exact_match", tokenizer, timeout_s=30, score_unfinished=True, stop_token_ids=(unk,))
    assert _scored(scorer, label, [(answer, "stop")], _ids(tokenizer, label + ">")) == [1.0]


def test_a_model_folders_generation_config_eos_ends_a_response(tmp_path: Path) -> None:
    import json

    folder = make_tiny_model("copy_small", tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    unk = tokenizer.unk_token_id
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, unk]}))
    tokenizer = AutoTokenizer.from_pretrained(folder)  # another folder's ids: read afresh
    assert response_text(tokenizer, [*_ids(tokenizer, "3"), unk]) == "3"
