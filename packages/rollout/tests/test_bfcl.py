"""The bfcl_multi_turn environment against bfcl-eval's real questions, simulated APIs and checker: the
gold calls score 1 on every multi_turn_base question, BFCL's own multi_turn_checker gives the same
verdicts, wrong calls score 0, malformed calls and slow calls are answered in one line, and every
trajectory has instances of its own."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils
from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

from ppo_rollout.environment import Action, StepResult, resolve_environment
from ppo_rollout.environments.bfcl import dataset
from ppo_rollout.environments.bfcl.calls import Call, Malformed, parse_calls
from ppo_rollout.environments.bfcl.data import Question, function_docs, questions, split_ids
from ppo_rollout.environments.bfcl.environment import BFCLMultiTurnEnvironment
from ppo_rollout.environments.bfcl.execution import SimulatedAPIs
from ppo_rollout.environments.bfcl.prompts import PromptStyle, first_messages, user_turn

BASE = questions("multi_turn_base")


def _act(text: str) -> Action:
    return Action(text, (), "stop", 0)


def _play(
    question_id: str, turns: list[tuple[str, ...]], **kwargs: object
) -> tuple[StepResult, BFCLMultiTurnEnvironment]:
    """Each turn's calls as one response, then a response without calls (the answer to the user)."""
    env = BFCLMultiTurnEnvironment(**kwargs)  # type: ignore[arg-type]
    env.reset({"id": question_id})
    result = StepResult()
    for calls in turns:
        if calls:
            result = env.step(_act("[" + ", ".join(calls) + "]"))
            assert not result.done
        result = env.step(_act("Done."))
    return result, env


# -- the gold answers ---------------------------------------------------------------------------------


def test_the_gold_calls_score_1_on_every_base_question() -> None:
    started = time.perf_counter()
    failed = {}
    for qid, q in BASE.items():
        result, env = _play(qid, list(q.gold))
        if not (result.done and result.reward == 1.0 and result.info["solved"] == 1.0):
            failed[qid] = env.checker.failure
    assert len(BASE) == 200
    assert not failed, f"{len(failed)} of 200 gold replays failed: {failed}"
    assert time.perf_counter() - started < 20


def _bfcl_verdict(q: Question, turns: list[tuple[str, ...]]) -> dict[str, object]:
    """BFCL's own multi_turn_checker on the same calls (its instances live in its module's globals,
    under the model name: a fresh name each time, removed after)."""
    model = f"ppo_{uuid.uuid4().hex}"
    entry = {"id": q.id, "initial_config": q.initial_config, "involved_classes": list(q.involved_classes)}
    decoded = [[list(calls)] if calls else [] for calls in turns]
    try:
        verdict: dict[str, object] = multi_turn_checker(
            decoded, [list(g) for g in q.gold], entry, q.category, model
        )
        return verdict
    finally:
        for name in [name for name in vars(multi_turn_utils) if model in name]:
            del vars(multi_turn_utils)[name]


@pytest.mark.parametrize("category", ["multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param"])
def test_verdicts_match_bfcls_own_checker(category: str) -> None:
    for q in list(questions(category).values())[::10]:
        first = next(i for i, calls in enumerate(q.gold) if calls)
        short = list(q.gold)
        short[first] = short[first][:-1]  # the turn's last call left out
        skipped = list(q.gold)
        skipped[first] = ()
        for turns in (list(q.gold), short, skipped):
            expected = _bfcl_verdict(q, turns)
            result, env = _play(q.id, turns)
            assert (result.reward == 1.0) == expected["valid"], (q.id, turns, expected)
            if not expected["valid"]:
                assert env.checker.failure is not None
                assert env.checker.failure["error_type"] == expected["error_type"], q.id


def test_wrong_calls_score_0_with_bfcls_reason() -> None:
    gold = list(BASE["multi_turn_base_0"].gold)
    wrong_dir = [
        ("cd(folder='document')", "mkdir(dir_name='tmp')", "mv(source='final_report.pdf', destination='tmp')")
    ]
    result, env = _play("multi_turn_base_0", wrong_dir + gold[1:])
    assert (result.done, result.reward, result.info["solved"]) == (True, 0.0, 0.0)
    assert env.checker.failure is not None
    assert env.checker.failure["error_type"] == "multi_turn:instance_state_mismatch"

    wrong_pattern = [
        *gold[:1],
        ("cd(folder='temp')", "grep(file_name='final_report.pdf', pattern='forecast')"),
        *gold[2:],
    ]
    result, env = _play("multi_turn_base_0", wrong_pattern)
    assert result.reward == 0.0
    assert env.checker.failure is not None
    assert env.checker.failure["error_type"] == "multi_turn:execution_response_mismatch"

    result, env = _play("multi_turn_base_0", [gold[0], (), *gold[2:]])  # turn 2 answered without calls
    assert result.reward == 0.0
    assert env.checker.failure is not None
    assert env.checker.failure["error_message"] == "Model response list is empty for turn 1"


def test_turns_passed_counts_the_turns_before_the_first_failing_one() -> None:
    gold = list(BASE["multi_turn_base_0"].gold)  # four user turns
    env = BFCLMultiTurnEnvironment()
    env.reset({"id": "multi_turn_base_0"})
    passed = []
    for calls in [gold[0], gold[1], (), gold[3]]:
        env.step(_act("[" + ", ".join(calls) + "]")) if calls else None
        passed.append(env.step(_act("Done.")).info["turns_passed"])
    assert passed == [0.25, 0.25, 0.0, 0.0]


def test_end_on_failed_turn_ends_the_trajectory_at_the_failing_turn() -> None:
    env = BFCLMultiTurnEnvironment(end_on_failed_turn=True)
    env.reset({"id": "multi_turn_base_0"})
    result = env.step(_act("I cannot do that."))  # turn 1 has gold calls: it fails here
    assert (result.done, result.reward, result.info) == (True, 0.0, {"turns_passed": 0.0, "solved": 0.0})


# -- the turns as the model reads them ----------------------------------------------------------------


def test_user_turns_follow_an_answer_without_calls() -> None:
    q = BASE["multi_turn_base_0"]
    env = BFCLMultiTurnEnvironment()
    env.reset({"id": q.id})
    result = env.step(_act("[cd(folder='document'), ls()]"))
    assert result.observation == repr(
        [
            {
                "role": "tool",
                "name": "cd(folder='document')",
                "content": '{"current_working_directory": "document"}',
            },
            {
                "role": "tool",
                "name": "ls()",
                "content": '{"current_directory_content": ["final_report.pdf", "previous_report.pdf"]}',
            },
        ]
    )
    assert result.info == {
        "tool_calls": 1.0,
        "tool_valid": 1.0,
        "calls": 2.0,
        "call_errors": 0.0,
        "call_timeouts": 0.0,
    }
    answer = env.step(_act("The file is moved."))
    assert answer.observation == q.turns[1][0]["content"]
    assert not answer.done


def test_the_prompt_holds_bfcls_system_prompt_and_the_classes_docs() -> None:
    q = BASE["multi_turn_base_0"]
    messages = first_messages(q, PromptStyle())
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[1]["content"] == q.turns[0][0]["content"]
    system = messages[0]["content"]
    assert (
        "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
        in system
    )
    docs = [d for name in q.involved_classes for d in function_docs(name)]
    assert json.dumps(docs, indent=4) in system
    compact = first_messages(q, PromptStyle(calls="json", docs="compact"))[0]["content"]
    assert '"function":"func_name1"' in compact
    assert '"response"' not in compact
    assert len(compact) < len(system) * 0.6


def test_held_back_functions_are_revealed_in_their_turn() -> None:
    q = questions("multi_turn_miss_func")["multi_turn_miss_func_0"]
    assert q.missed_functions == {3: ("sort",)}
    system = first_messages(q, PromptStyle())[0]["content"]
    assert '"name": "sort"' not in system
    assert '"name": "grep"' in system
    revealed = user_turn(q, 3, PromptStyle())
    assert revealed.endswith("\nI have updated some more functions you can choose from. What about now?")
    assert revealed.startswith("[{'name': 'sort'")


# -- calls ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "calls"),
    [
        (
            "[cd(folder='document'), sort('a.txt')]",
            [Call("cd", (), {"folder": "document"}), Call("sort", ("a.txt",))],
        ),
        ("ls(a=True)", [Call("ls", (), {"a": True})]),
        ("```python\n[mean(numbers=[1, -2.5])]\n```", [Call("mean", (), {"numbers": [1, -2.5]})]),
        ('[{"function": "cd", "parameters": {"folder": "x"}}]', [Call("cd", (), {"folder": "x"})]),
        ('```json\n{"function": "pwd", "parameters": {}}\n```', [Call("pwd")]),
        ("The file has 3 lines.", []),
        ("Sure (it is done).", []),
        ("[]", []),
        ("", []),
    ],
)
def test_calls_are_read_in_both_documented_formats(text: str, calls: list[Call]) -> None:
    assert parse_calls(text) == calls


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("[cd(folder=)]", "not Python call syntax"),
        ("[cd(folder=__import__('os').getcwd())]", "cd: argument folder is not a literal value"),
        ("[cd(*names)]", "cd: *arguments are not allowed"),
        ("[ls(), 3]", "item 2 of the list is not a function call"),
        ('[{"function": "cd", "parameters": {"folder": "x"}', "not JSON"),
        ('[{"name": "cd"}]', 'item 1 is not an object with a "function" name'),
    ],
)
def test_malformed_calls_say_why(text: str, reason: str) -> None:
    parsed = parse_calls(text)
    assert isinstance(parsed, Malformed)
    assert parsed.reason.startswith(reason)


def test_a_malformed_call_is_observed_and_counted() -> None:
    env = BFCLMultiTurnEnvironment()
    env.reset({"id": "multi_turn_base_0"})
    result = env.step(_act("[cd(folder=os.getcwd())]"))
    assert result.observation == (
        "Error: your function calls could not be read: cd: argument folder is not a literal value: write "
        "numbers, strings, lists, dicts, True, False or None. Write only the calls, as "
        "[func_name(param=value, ...), ...]."
    )
    assert result.info == {"tool_calls": 1.0, "tool_valid": 0.0, "malformed_calls": 1.0}
    assert not result.done
    assert env.turn_steps == []


def test_a_user_turn_is_cut_after_max_steps_per_turn() -> None:
    env = BFCLMultiTurnEnvironment(max_steps_per_turn=2)
    env.reset({"id": "multi_turn_base_0"})
    assert not env.step(_act("[pwd()]")).done
    assert not env.step(_act("[pwd(]")).done
    result = env.step(_act("[pwd()]"))
    assert (result.done, result.reward, result.info["step_limit"], result.info["solved"]) == (
        True,
        0.0,
        1.0,
        0.0,
    )


# -- execution -----------------------------------------------------------------------------------------


def test_names_outside_the_apis_are_errors_as_bfcl_words_them() -> None:
    env = BFCLMultiTurnEnvironment()
    env.reset({"id": "multi_turn_base_0"})
    result = env.step(_act("[foo(x=1), json.loads(s='1'), kill(), mkdir()]"))
    contents = [r["content"] for r in ast.literal_eval(result.observation or "")]
    assert contents == [
        "Error during execution: name 'foo' is not defined",
        "Error during execution: name 'json' is not defined",
        "Error during execution: Function call kill is not allowed.",
        "Error during execution: GorillaFileSystem.mkdir() missing 1 required positional argument: "
        "'dir_name'",
    ]
    assert result.info["call_errors"] == 4.0


def test_a_slow_call_is_cut_by_the_per_call_bound_and_scores_0() -> None:
    q = BASE["multi_turn_base_15"]
    assert "MathAPI" in q.involved_classes
    env = BFCLMultiTurnEnvironment(call_timeout_s=0.001)
    env.reset({"id": q.id})
    # A pure-Python sum over a million numbers (100 ms and more), sent as JSON (read in a few ms): the
    # call is still running when its bound has passed, however the machine schedules the two threads.
    numbers = json.dumps(list(range(1_000_000)))
    slow_call = f'{{"function": "standard_deviation", "parameters": {{"numbers": {numbers}}}}}'
    result = env.step(_act(f'[{slow_call}, {{"function": "pwd"}}]'))
    slow = "standard_deviation(numbers=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9,..."
    line = f"{slow} did not return within 0.001 s (rollout.environment_args.call_timeout_s)"
    assert repr(f"Error during execution: {line}") in (result.observation or "")
    assert repr(f"Error during execution: no call runs after {slow} timed out") in (result.observation or "")
    assert result.info["call_timeouts"] == 1.0
    for calls in q.gold:  # the gold calls cannot rescue it: the state is unknown
        if calls:
            env.step(_act("[" + ", ".join(calls) + "]"))
        result = env.step(_act("Done."))
    assert (result.done, result.reward) == (True, 0.0)
    assert env.checker.failure is not None
    assert env.checker.failure["error_type"] == "bfcl_environment:call_timeout"


def test_calls_that_would_hold_the_interpreter_are_refused_at_once() -> None:
    apis = SimulatedAPIs(BASE["multi_turn_base_15"])
    started = time.perf_counter()
    assert apis.run(Call("power", (), {"base": 10, "exponent": 10**9}), 1.0) == (
        "Error during execution: power: the result would have over 100000 digits"
    )
    assert apis.run(Call("logarithm", (), {"value": 2, "base": 10, "precision": 10**8}), 1.0) == (
        "Error during execution: logarithm: precision=100000000 is above this environment's bound of 1000"
    )
    assert time.perf_counter() - started < 0.5
    assert apis.run(Call("power", (), {"base": 2, "exponent": 10}), 1.0) == '{"result": 1024}'


def test_every_trajectory_has_instances_of_its_own() -> None:
    first, second = BFCLMultiTurnEnvironment(), BFCLMultiTurnEnvironment()
    first.reset({"id": "multi_turn_base_0"})
    second.reset({"id": "multi_turn_base_0"})
    assert first.apis.instances["GorillaFileSystem"] is not second.apis.instances["GorillaFileSystem"]
    assert first.apis.instances["GorillaFileSystem"] is not first.checker.gold.instances["GorillaFileSystem"]
    first.step(_act("[mkdir(dir_name='only_here')]"))
    listing = second.step(_act("[ls()]")).observation or ""
    assert "only_here" not in listing
    assert "document" in listing
    again = first.apis.instances["GorillaFileSystem"]
    first.reset({"id": "multi_turn_base_0"})
    assert first.apis.instances["GorillaFileSystem"] is not again
    assert "only_here" not in (first.step(_act("[ls()]")).observation or "")


# -- settings, rows and the split ---------------------------------------------------------------------


def test_the_environment_is_built_in_and_checks_its_arguments() -> None:
    assert resolve_environment("bfcl_multi_turn") is BFCLMultiTurnEnvironment
    with pytest.raises(ValueError, match=r"^rollout\.environment_args\.call_timeout_s=0: give a positive"):
        BFCLMultiTurnEnvironment(call_timeout_s=0)
    with pytest.raises(
        ValueError, match=r"^rollout\.environment_args\.max_steps_per_turn=0: give an integer"
    ):
        BFCLMultiTurnEnvironment(max_steps_per_turn=0)
    with pytest.raises(ValueError, match=r"needs the BFCL question's 'id' \(row keys: \['prompt'\]\)"):
        BFCLMultiTurnEnvironment().reset({"prompt": "hi"})
    with pytest.raises(ValueError, match=r"row id 'gsm8k_3' is not a BFCL multi-turn question"):
        BFCLMultiTurnEnvironment().reset({"id": "gsm8k_3"})


def test_the_split_is_by_question_number_in_every_category() -> None:
    ids = [*questions("multi_turn_base"), *questions("multi_turn_miss_func")]
    train, held = split_ids(ids, 0.2, seed=0)
    assert len(held) == 80
    assert len(train) == 320
    numbers = {i.rsplit("_", 1)[1] for i in held}
    assert len(numbers) == 40
    assert {i.rsplit("_", 1)[1] for i in train}.isdisjoint(numbers)
    assert split_ids(ids, 0.2, seed=0) == (train, held)
    assert split_ids(ids, 0.2, seed=1)[1] != held
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\)"):
        split_ids(ids, 1.0, seed=0)


def test_dataset_cli_writes_the_split(tmp_path: Path) -> None:
    out = tmp_path / "bfcl"
    assert (
        dataset.main(
            ["--out", str(out), "--category", "multi_turn_base", "--held-out", "0.2", "--docs", "compact"]
        )
        == 0
    )
    train = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (160, 40)
    assert {r["id"] for r in held} == set(split_ids(BASE, 0.2, seed=0)[1])
    row = held[0]
    assert (row["call_format"], row["docs"]) == ("python", "compact")
    assert row["prompt"] == first_messages(BASE[row["id"]], PromptStyle(docs="compact"))
    env = BFCLMultiTurnEnvironment()
    env.reset(row)  # the environment reads what the file holds
    assert env.style == PromptStyle(docs="compact")


def test_without_bfcl_eval_the_environment_names_its_install() -> None:
    code = (
        "import sys; sys.modules['bfcl_eval'] = None\n"
        "from ppo_rollout.environment import resolve_environment\n"
        "try:\n    resolve_environment('bfcl_multi_turn')\n"
        "except ValueError as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip().endswith(
        "the bfcl_multi_turn environment needs bfcl-eval: `uv sync` in this workspace (ppo-rollout's bfcl "
        "extra, installed without bfcl-eval's declared requirements), or `pip install --no-deps "
        "bfcl-eval==2026.3.23 mpmath`"
    )
