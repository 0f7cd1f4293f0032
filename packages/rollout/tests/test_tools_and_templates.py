"""The calculator tool, stop strings, and observations rendered with a chat template."""

from __future__ import annotations

import string
import time
from typing import Any

import pytest

from ppo_rollout.environment import Action, resolve_environment
from ppo_rollout.environments.calculator import CalculatorEnvironment, CalculatorError, evaluate, format_value
from ppo_rollout.observation import TRUNCATION_MARKER, ObservationRenderer, check_append_only
from ppo_rollout.rollout_fns import cut_at_stop
from ppo_rollout.tokenizer import build_char_tokenizer

# -- the calculator -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("347 + 82 - 519 + 66", -24),
        ("2 * (3 + 4)", 14),
        ("-5 + 2", -3),
        ("7 / 2", 3.5),
        ("2 ** 10", 1024),
        ("17 // 5", 3),
        ("17 % 5", 2),
        (" 12 ", 12),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("().__class__", "only numbers"),
        ("(1).real", "only numbers"),
        ("9**9**9", "exponent above 12"),
        ("999999 * 999999 * 999999", "number too large"),
        ("'a' * 3", "only numbers"),
        ("[1, 2]", "only numbers"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an arithmetic expression"),
        ("1" + "+1" * 200, "longer than 200"),
        ("+".join(["1"] * 40), "more than 64 parts"),
        ("lambda: 1", "only numbers"),
    ],
)
def test_calculator_refuses_within_its_bound(expression: str, reason: str) -> None:
    started = time.perf_counter()
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)
    assert time.perf_counter() - started < 0.5  # refused before any large work


def test_format_value() -> None:
    assert [format_value(v) for v in (12, 12.0, 3.5, 1 / 3)] == ["12", "12", "3.5", "0.3333333333"]


def _action(text: str) -> Action:
    return Action(text=text, token_ids=(), finish_reason="stop", turn=0)


def test_calculator_environment_answers_calls_and_ends_on_an_answer() -> None:
    env = resolve_environment("calculator")()
    assert isinstance(env, CalculatorEnvironment)
    env.reset({"label": "5"})
    called = env.step(_action("Let me compute. <calc>2 + 3</calc>"))
    assert (called.observation, called.done, dict(called.info)) == (
        "<result>5</result>",
        False,
        {"tool_calls": 1.0, "tool_valid": 1.0},
    )
    bad = env.step(_action("<calc>os.system('x')</calc>"))
    assert (
        bad.observation == "<result>error: only numbers, + - * / // % ** and parentheses are allowed</result>"
    )
    assert bad.info["tool_valid"] == 0.0
    final = env.step(_action("The answer is 5."))
    assert final.done
    assert final.observation is None
    assert final.info["tool_calls"] == 0.0


def test_unknown_environment_is_named() -> None:
    with pytest.raises(ValueError, match=r"write 'package\.module:factory' or a built-in name"):
        resolve_environment("nope")
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        resolve_environment("no_such_module_xyz:Env")


# -- stop strings ---------------------------------------------------------------------------------------


def test_cut_at_stop_keeps_the_token_that_completes_the_stop_string() -> None:
    tokens = list("ab<calc>1+2</calc>tail")

    def decode(ids: Any) -> str:
        return "".join(ids)

    cut = cut_at_stop(tokens, ("</calc>",), decode)
    assert cut is not None
    assert decode(tokens[:cut]) == "ab<calc>1+2</calc>"
    assert cut_at_stop(tokens, ("nothing",), decode) is None
    assert cut_at_stop(tokens, (), decode) is None
    assert decode(tokens[: cut_at_stop(tokens, ("</calc>", "b<"), decode) or 0]) == "ab<"


# -- observations with a chat template -------------------------------------------------------------------

APPENDING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Shows only the last assistant message's content: earlier turns are rewritten.
REWRITING = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}<assistant>...<eos>\n"
    "{% else %}<{{ m.role }}>{{ m.content }}<eos>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture
def chat_tokenizer() -> Any:
    alphabet = "".join(dict.fromkeys(string.ascii_letters + string.digits + " .,:;!?<>/=+-*()[]\n_'"))
    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.chat_template = APPENDING
    return tokenizer


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_observations_continue_the_template_token_for_token(chat_tokenizer: Any) -> None:
    tok = chat_tokenizer
    eos = tok.eos_token_id
    renderer = ObservationRenderer(tok, chat_template=True, role="user", max_tokens=64, eos_token_ids=[eos])
    history = [{"role": "user", "content": "What is 2+3?"}]
    prompt = _encode(tok, tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False))
    turn1 = [*_encode(tok, "<calc>2+3</calc>"), eos]  # ended on the end-of-turn token
    reply1 = renderer.ids("<result>5</result>", turn1)
    turn2 = _encode(tok, "<calc>5*1</calc>")  # ended on a stop string: the reply closes the turn
    reply2 = renderer.ids("<result>5</result>", turn2)
    ids = prompt + turn1 + reply1 + turn2 + reply2
    messages = [
        *history,
        {"role": "assistant", "content": "<calc>2+3</calc>"},
        {"role": "user", "content": "<result>5</result>"},
        {"role": "assistant", "content": "<calc>5*1</calc>"},
        {"role": "user", "content": "<result>5</result>"},
    ]
    full = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ids == _encode(tok, full)
    assert reply2[0] == eos  # the closing end-of-turn token the model did not write


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(chat_tokenizer: Any) -> None:
    chat_tokenizer.chat_template = REWRITING
    chat_tokenizer.name_or_path = "models/rewriter"
    with pytest.raises(ValueError, match=r"the chat template of models/rewriter rewrites earlier turns"):
        check_append_only(chat_tokenizer, "user")
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        ObservationRenderer(chat_tokenizer, chat_template=True)


def test_a_long_observation_is_cut_with_the_marker(chat_tokenizer: Any) -> None:
    renderer = ObservationRenderer(chat_tokenizer, chat_template=False, max_tokens=30)
    text = "0123456789" * 10
    cut = renderer.truncate(text)
    assert cut.startswith("0123456789")
    assert cut.endswith(TRUNCATION_MARKER)
    assert len(renderer.ids(text, [])) == 30
    assert renderer.truncate("short") == "short"
    with pytest.raises(
        ValueError, match=r"must exceed the 15 tokens of rollout\.multi_turn\.truncation_marker"
    ):
        ObservationRenderer(chat_tokenizer, chat_template=False, max_tokens=5)
