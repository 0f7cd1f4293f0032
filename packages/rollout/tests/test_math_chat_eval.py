"""Verifiable math rewards on real answer strings, the arithmetic tasks' streams, the chat template's
rendering and the held-out evaluation file."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from ppo_rollout.answers import extract_answer, parse_number
from ppo_rollout.config import RolloutConfig
from ppo_rollout.data import HeldOutEval, JsonlPrompts, PromptRenderer, describe_eval_source, open_prompts
from ppo_rollout.rewards import FORMAT_SCORE, RewardInput, compute_rewards, math_answer, math_answer_strict
from ppo_rollout.tasks import HELD_OUT_EVERY, TASKS, get_task, make_tiny_model
from ppo_rollout.tokenizer import build_char_tokenizer


def _inp(response: str, label: object) -> RewardInput:
    return RewardInput(
        prompt="What is it?",
        response=response,
        response_token_ids=(),
        finish_reason="stop",
        row={"label": label},
    )


@pytest.mark.parametrize(
    ("text", "value", "mark"),
    [
        ("12 + 7 = 19.", 19, "last_number"),
        ("The answer is -5.", -5, "phrase"),
        ("3 - 5 = -2", -2, "last_number"),
        ("12-5=7", 7, "last_number"),  # the minus of a subtraction is not a sign
        ("The total is $1,234,567 dollars", 1234567, "last_number"),
        ("#### 1,234", 1234, "hashes"),
        ("Natalia sold 48/2 = 24 clips in May.\n#### 72", 72, "hashes"),
        ("so x = 3 and \\boxed{-12}.", -12, "boxed"),
        ("\\boxed{\\frac{3}{4}}", Fraction(3, 4), "boxed"),
        ("\\boxed{x = 42}", 42, "boxed"),
        ("Answer: **42** apples, then 7 more pears", 42, "phrase"),
        ("The final answer is 3.50 km.", Fraction(7, 2), "phrase"),
        # several numbers: the marked one wins over the last one
        ("The answer is 19. Check: 19 - 7 = 12", 19, "phrase"),
        ("2 + 3 = 5, 5 + 4 = 9", 9, "last_number"),
        ("−7", -7, "last_number"),  # U+2212 minus
        ("I do not know.", None, "none"),
        ("", None, "none"),
    ],
)
def test_extract_answer(text: str, value: object, mark: str) -> None:
    found = extract_answer(text)
    assert found.mark == mark
    assert found.value == (None if value is None else Fraction(value))  # type: ignore[arg-type]


def test_parse_number_takes_labels_and_refuses_text() -> None:
    assert parse_number("-1,234.5") == Fraction(-2469, 2)
    assert parse_number("$42") == 42
    assert parse_number("3/4") == Fraction(3, 4)
    assert parse_number("42.") == 42
    assert parse_number("forty-two") is None
    assert parse_number("1/0") is None
    assert parse_number("1 2") is None


def test_math_answer_value_and_strict_format() -> None:
    responses = [
        "12 + 7 = 19",  # bare, right
        "The answer is 19.",  # marked, right
        "The answer is 18.",  # marked, wrong
        "It is 18",  # bare, wrong
        "no idea",  # no number at all
        "19.0",  # the same number written otherwise
        "#### 1,9",  # not a thousands group: "1", then "9"
    ]
    samples = [_inp(r, "19") for r in responses]
    assert compute_rewards(math_answer, samples) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert compute_rewards(math_answer_strict, samples) == [
        0.0,
        1.0,
        FORMAT_SCORE,
        0.0,
        0.0,
        0.0,
        FORMAT_SCORE,
    ]


@pytest.mark.parametrize("label", [-5, "-5", "−5", "The sum is 2 - 7.\n#### -5", "\\boxed{-5}", -5.0])
def test_math_labels_in_every_form(label: object) -> None:
    assert math_answer([_inp("so the answer is -5", label)]) == [1.0]
    assert math_answer([_inp("so the answer is 5", label)]) == [0.0]


def test_math_reward_names_a_missing_label() -> None:
    with pytest.raises(ValueError, match="numeric 'label'"):
        math_answer([_inp("42", None)])
    with pytest.raises(ValueError, match="numeric 'label'"):
        math_answer([_inp("42", "forty-two")])


@pytest.mark.parametrize("name", ["arithmetic_1", "arithmetic_2", "arithmetic_3", "arithmetic_4"])
def test_arithmetic_streams_are_exact_fixed_and_disjoint(name: str) -> None:
    task = get_task(name)
    train = [task.row(i, 7) for i in range(300)]
    held_out = [task.eval_row(i, 7) for i in range(60)]
    assert train[:5] == [task.row(i, 7) for i in range(5)]  # a row is a function of (index, seed)
    assert train[:5] != [task.row(i, 8) for i in range(5)]
    for row in train + held_out:
        question = row["prompt"].removeprefix("What is ").split("?")[0]
        assert int(row["label"]) == eval(question, {"__builtins__": {}})
        assert math_answer([_inp(f"{question} = {row['label']}", row["label"])]) == [1.0]
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held_out)
    assert task.reward == "math_answer"
    assert task.needs_real_tokenizer


def test_arithmetic_difficulty_grows() -> None:
    def terms(name: str) -> int:
        return TASKS[name].row(0, 0)["prompt"].count(" ") - 6  # "What is a + b? Answer ... only."

    assert terms("arithmetic_1") == terms("arithmetic_2") < terms("arithmetic_3")
    assert any(int(TASKS["arithmetic_3"].row(i, 0)["label"]) < 0 for i in range(50))  # negatives occur
    assert any("*" in TASKS["arithmetic_4"].row(i, 0)["prompt"] for i in range(20))
    assert HELD_OUT_EVERY > 1


def test_the_tiny_model_refuses_a_real_task(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a real model's tokenizer"):
        make_tiny_model("arithmetic_1", tmp_path / "m")


CHAT = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _chat_tokenizer():  # type: ignore[no-untyped-def]
    tok = build_char_tokenizer("0123456789>=+-: []abcdefghijklmnopqrstuvwxyzW?\n")
    tok.chat_template = CHAT
    return tok


def test_chat_template_renders_a_string_as_one_user_turn_with_the_system_prompt() -> None:
    tok = _chat_tokenizer()
    plain = PromptRenderer(tok, "prompt")
    assert plain.render({"prompt": "what is 2+3?"}) == "what is 2+3?"
    assert plain.encode("12") == tok("12")["input_ids"]  # <bos> added as before
    chat = PromptRenderer(tok, "prompt", chat_template=True, system_prompt="be brief")
    text = chat.render({"prompt": "what is 2+3?"})
    assert text == "[system]be brief\n[user]what is 2+3?\n[assistant]"
    # the template writes every special token it wants: no <bos> added on top
    assert chat.encode(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert chat.encode(text)[0] != tok.bos_token_id


def test_chat_template_takes_a_messages_list_and_keeps_its_own_system_turn() -> None:
    chat = PromptRenderer(_chat_tokenizer(), "messages", chat_template=True, system_prompt="ignored")
    row = {"messages": [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]}
    assert chat.render(row) == "[system]mine\n[user]hi\n[assistant]"


def test_chat_template_missing_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match=r"rollout\.chat_template is true but the model's tokenizer has no chat"
    ):
        PromptRenderer(build_char_tokenizer(), "prompt", chat_template=True)


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_messages_rows_need_the_chat_template(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}], "label": "1"}])
    with pytest.raises(ValueError, match=r"needs rollout\.chat_template=true"):
        JsonlPrompts(path, "prompt", 0)
    assert JsonlPrompts(path, "prompt", 0, messages_ok=True).rows[0]["label"] == "1"
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'prompt': message 0 must be an object"):
        JsonlPrompts(bad, "prompt", 0, messages_ok=True)


def test_eval_dataset_rows_come_from_their_own_file(tmp_path: Path, tiny_model: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}>", "label": str(i)} for i in range(8)])
    held = _jsonl(tmp_path / "held.jsonl", [{"prompt": f"9{i}>", "label": str(i)} for i in range(3)])
    config = RolloutConfig(
        model_path=str(tiny_model),
        task=None,
        dataset=str(train),
        eval_dataset=str(held),
        reward="exact_match",
    )
    source = open_prompts(config, seed=0)
    assert isinstance(source, HeldOutEval)
    assert [r["prompt"] for r in source.eval_rows(16)] == ["90>", "91>", "92>"]  # all 3, file order
    trained = {r["prompt"] for r in source.next_rows(16)}
    assert trained == {f"{i}>" for i in range(8)}
    state = source.state_dict()
    source.next_rows(3)
    source.load_state_dict(state)
    assert "held-out file" in describe_eval_source(config)
    without = RolloutConfig(model_path=str(tiny_model), task=None, dataset=str(train), reward="exact_match")
    assert [r["prompt"] for r in open_prompts(without, 0).eval_rows(2)] == ["0>", "1>"]
    assert "no rollout.eval_dataset is set" in describe_eval_source(without)
    assert "held-out stream of task copy" in describe_eval_source(RolloutConfig(model_path="m", task="copy"))


def test_settings_name_the_field_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rollout\.eval_dataset: no file at"):
        RolloutConfig(model_path="m", eval_dataset=str(tmp_path / "none.jsonl"))
    with pytest.raises(ValueError, match=r"rollout\.system_prompt needs rollout\.chat_template=true"):
        RolloutConfig(model_path="m", system_prompt="hi")
