from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_rollout.rewards import (
    RewardError,
    RewardInput,
    char_match,
    compute_rewards,
    exact_match,
    register_reward,
    resolve_reward,
)
from ppo_rollout.tasks import TASKS, get_task
from ppo_rollout.tokenizer import build_char_tokenizer


def _inp(response: str, label: str, i: int = 0, finish_reason: str = "stop") -> RewardInput:
    return RewardInput(
        prompt=label + ">",
        response=response,
        response_token_ids=(),
        finish_reason=finish_reason,
        row={"label": label},
        prompt_index=i,
    )


def test_char_tokenizer_round_trip_and_specials() -> None:
    tok = build_char_tokenizer()
    ids = tok("12>")["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert len(ids) == 4
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=True) == "12>"
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 2, 3)
    assert tok("x")["input_ids"] == [1, tok.unk_token_id]
    with pytest.raises(ValueError, match="repeated"):
        build_char_tokenizer("11")


def test_tiny_model_folder_loads_with_auto_classes(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert tok("3>")["input_ids"] == build_char_tokenizer()("3>")["input_ids"]
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    assert 50_000 < sum(p.numel() for p in model.parameters()) < 500_000


def test_tasks_are_deterministic_and_correct() -> None:
    rev = get_task("reverse")
    assert rev.row(3, 7) == rev.row(3, 7)
    assert rev.row(3, 7) != rev.row(4, 7)
    for i in range(20):
        row = rev.row(i, 1)
        digits = row["prompt"][:-1]
        assert row["prompt"].endswith(">")
        assert 3 <= len(digits) <= 4
        assert row["label"] == digits[::-1]
    small = TASKS["copy_small"].row(0, 0)
    assert set(small["label"]) <= set("0123")
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        get_task("nope")


def test_char_match_partial_credit() -> None:
    assert char_match([_inp("1234", "1234")]) == [1.0]
    assert char_match([_inp("1299", "1234")]) == [0.5]
    assert char_match([_inp("12345678", "1234")]) == [0.5]  # extra characters cost credit
    assert char_match([_inp("", "1234")]) == [0.0]
    assert exact_match([_inp(" 12 ", "12"), _inp("13", "12")]) == [1.0, 0.0]


def test_char_match_gives_a_response_the_length_limit_cut_less_than_an_ended_one() -> None:
    # Cut by the limit, the response did not end: it counts one character longer than its text.
    assert char_match([_inp("210", "210", finish_reason="length")]) == [0.75]
    assert char_match([_inp("2101", "210", finish_reason="length")]) == [0.6]
    assert char_match([_inp("12xy", "12", finish_reason="length")]) == [0.4]
    # Ending pays: the ended answer beats every cut one, even one whose text is the answer.
    (ended,) = char_match([_inp("210", "210")])
    assert ended == 1.0
    assert char_match([_inp("21", "210")]) == [pytest.approx(2 / 3)]  # ended too early: as before


@given(
    st.text("0123456789", max_size=6),
    st.text("0123456789", min_size=1, max_size=6),
    st.sampled_from(["stop", "length"]),
)
def test_char_match_is_bounded_and_one_only_when_equal(response: str, label: str, finish: str) -> None:
    (r,) = char_match([_inp(response, label, finish_reason=finish)])
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == (response == label and finish == "stop")


def test_registry_and_module_function() -> None:
    @register_reward("test_const_half")
    def half(samples):  # type: ignore[no-untyped-def]
        return [0.5] * len(samples)

    assert resolve_reward("test_const_half") is half
    register_reward("test_const_half")(half)  # the same function again: fine
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_const_half")(lambda s: [0.0] * len(s))
    mod = types.ModuleType("rollout_test_rewards_mod")
    mod.score = lambda samples: [1.0] * len(samples)  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    assert resolve_reward("rollout_test_rewards_mod:score") is mod.score  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="no callable 'missing'"):
        resolve_reward("rollout_test_rewards_mod:missing")
    with pytest.raises(ValueError, match="cannot import module"):
        resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="not registered"):
        resolve_reward("nope")


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1.0], "returned 1 values for 2 samples"),
        ([1.0, math.nan], r"returned nan for sample 1 \(prompt_index 1"),
        ([1.0, math.inf], "returned inf for sample 1"),
        # Finite in float64, inf in the float32 that training uses.
        ([1.0, 1e300], r"returned 1e\+300 for sample 1 .* training uses float32 rewards"),
        ([-3.5e38, 1.0], r"returned -3.5e\+38 for sample 0 .* float32"),
        ([True, 1.0], r"returned True \(bool\) for sample 0"),
        (["1", 1.0], r"returned '1' \(str\) for sample 0"),
        (None, "returned NoneType, expected a sequence"),
    ],
)
def test_bad_reward_results_name_sample_and_function(result: object, message: str) -> None:
    def bad_reward(samples):  # type: ignore[no-untyped-def]
        return result

    samples = [_inp("1", "1", 0), _inp("2", "2", 1)]
    with pytest.raises(RewardError, match=message) as info:
        compute_rewards(bad_reward, samples)
    assert "bad_reward" in str(info.value)


def test_a_reward_function_that_raises_is_named() -> None:
    def flaky_reward(samples):  # type: ignore[no-untyped-def]
        raise RuntimeError("reward service unavailable (test)")

    with pytest.raises(RewardError) as info:
        compute_rewards(flaky_reward, [_inp("1", "1")])
    message = str(info.value)
    assert "flaky_reward (rollout.reward) raised RuntimeError: reward service unavailable (test)" in message
    assert isinstance(info.value.__cause__, RuntimeError)  # the original, for the traceback in the log


def test_good_reward_results_are_floats() -> None:
    import numpy as np

    out = compute_rewards(lambda s: np.array([1, 0.25]), [_inp("1", "1"), _inp("2", "2")])
    assert out == [1.0, 0.25]
    assert compute_rewards(lambda s: [3.4e38, -3.4e38], [_inp("1", "1"), _inp("2", "2")]) == [3.4e38, -3.4e38]
    assert all(type(x) is float for x in out)


def test_a_reward_that_never_returns_is_stopped_at_its_timeout() -> None:
    import threading
    import time

    release = threading.Event()

    def hangs(samples: object) -> list[float]:
        release.wait(60)  # a judge service that stopped answering
        return [0.0, 0.0]

    samples = [
        RewardInput("p", "r", (1,), "stop", {}, prompt_index=3),
        RewardInput("q", "r", (1,), "stop", {}, prompt_index=5),
    ]
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        compute_rewards(hangs, samples, timeout_s=0.3)
    release.set()
    assert time.monotonic() - start < 5
    text = str(info.value)
    assert "\n" not in text
    assert (
        "hangs (rollout.reward) did not return within rollout.reward_timeout_s=0.3 s for 2 samples " in text
    )
    assert "(prompt_index 3 to 5)" in text
    assert compute_rewards(lambda s: [1.0] * len(s), samples, timeout_s=5) == [1.0, 1.0]
